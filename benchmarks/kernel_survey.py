"""Which CPU matmul kernels PyTorch ships are row-invariant, and how their cost grows with the row count M
(docs/results/decode-cpu.md, "Row invariance of what PyTorch ships"). SmolLM2-shaped weights, 2 threads.

    python benchmarks/kernel_survey.py

Prints, per kernel and shape: whether row 0 computed among 2..64 rows equals row 0 computed alone, the
one-row time, and the cost of 4 / 8 / 64 rows as a multiple of it. Ours (midlayer q4) last.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from midlayer.ops import kernels


def per_call_us(fn, n: int = 50) -> float:
    fn(), fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def candidates(w: torch.Tensor) -> dict:
    ops = torch.ops.aten
    N, K = w.shape
    s = w.abs().amax(1) / 127
    q8 = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8)
    out = {"fp32 (MKL)": lambda x: F.linear(x, w),
           "int8pack (bf16 x)": lambda x: ops._weight_int8pack_mm(x.bfloat16(), q8, s.bfloat16()).float()}
    g = w.reshape(N, K // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    q = ((g - lo[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.int32).reshape(N, K)
    packed = ops._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([d, lo + 8 * d], -1).transpose(0, 1).contiguous().bfloat16()
    out["int4pack (bf16 x)"] = lambda x: ops._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz).float()
    pk16 = torch.ops.quantized.linear_prepack_fp16(w, None)
    out["fbgemm fp16"] = lambda x: torch.ops.quantized.linear_dynamic_fp16(x, pk16)
    qw = torch.quantize_per_channel(w, s, torch.zeros(N, dtype=torch.long), 0, torch.qint8)
    pk8 = torch.ops.quantized.linear_prepack(qw, None)
    out["fbgemm dynamic int8"] = lambda x: torch.ops.quantized.linear_dynamic(x, pk8, True)
    q8t = q8.t()

    def int_mm(x: torch.Tensor) -> torch.Tensor:  # int8 x int8 -> int32, activations per row
        xs = x.abs().amax(-1, keepdim=True) / 127
        return torch._int_mm((x / xs).round().to(torch.int8), q8t).float() * xs * s

    out["torch._int_mm"] = int_mm
    wb = w.bfloat16()
    out["bf16 F.linear"] = lambda x: F.linear(x.bfloat16(), wb).float()
    codes, scales = kernels.quantize_q4_1(w)
    out["midlayer q4 (Q4_1 x Q8)"] = lambda x: kernels.gemm_q4_1(x, codes, scales)
    return out


def main() -> None:
    torch.manual_seed(0)
    print(kernels.cpu_info().summary())
    for N, K in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        w, X = torch.randn(N, K) * 0.02, torch.randn(64, K)
        for name, fn in candidates(w).items():
            inv = all(torch.equal(fn(X[:m])[:1], fn(X[:1])) for m in (2, 4, 8, 16, 64))
            t1 = per_call_us(lambda: fn(X[:1]))
            r = [per_call_us(lambda m=m: fn(X[:m]), 10 if m == 64 else 50) / t1 for m in (4, 8, 64)]
            print(f"{N}x{K} {name:24s} row-invariant={inv!s:5s} 1 row {t1:7.0f} us; 4/8/64 rows "
                  f"{r[0]:.2f}x {r[1]:.2f}x {r[2]:.1f}x")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # (--help ran the whole survey)
    main()

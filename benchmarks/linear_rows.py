"""The CPU's row-invariant C linear (kernels.linear_rows: fp32 or bf16, a fixed lane order) against PyTorch's
F.linear (the BLAS: MKL or oneDNN) at SmolLM2-135M's fused shapes, by row count M: microseconds a call, the
two interleaved in each of `--rounds` rounds (the median is printed), and whether every row of the C kernel's
M-row call has the bits of the row alone. What the static decode step pays for linear="c" (issue 42,
docs/results/static-step.md).

    OMP_NUM_THREADS=2 python benchmarks/linear_rows.py [--dtypes fp32,bf16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from midlayer.ops import kernels

# SmolLM2-135M's linears after fuse_projections: q|k|v, the attention's output, w1|w3, w2, the tied head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = (1, 8, 16, 32, 64)


def per_call(fn, *args, budget: float = 0.2) -> float:
    """Microseconds a call: as many calls as fit in `budget` seconds, after one warm-up call."""
    fn(*args)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < budget:
        fn(*args)
        n += 1
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= {"fp32", "bf16"} or args.rounds < 1:
        ap.error(f"--dtypes takes fp32 and/or bf16 (got {args.dtypes!r}) and --rounds at least 1 (got {args.rounds})")
    if not kernels.available():
        raise SystemExit(f"the C kernels are not built here: {kernels.unavailable_reason()}")
    info = kernels.cpu_info()
    print(f"{info.model}; SIMD level {kernels.SIMD_LEVELS[kernels.library().qk_simd_level()]}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} interleaved rounds")
    print("\n| dtype | N x K | M | C linear us | F.linear us | C / F.linear | C rows = alone |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        for N, K in SHAPES:
            w = torch.randn(N, K, generator=g).to(dtype) * 0.05
            for M in ROWS:
                x = torch.randn(M, K, generator=g).to(dtype)
                full = kernels.linear_rows(x, w)
                same = all(torch.equal(kernels.linear_rows(x[i:i + 1], w), full[i:i + 1]) for i in range(M))
                c, f = [], []
                for _ in range(args.rounds):
                    c.append(per_call(kernels.linear_rows, x, w))
                    f.append(per_call(F.linear, x, w))
                mc, mf = statistics.median(c), statistics.median(f)
                print(f"| {name} | {N} x {K} | {M} | {mc:.0f} | {mf:.0f} | {mc / mf:.2f} | {same} |")


if __name__ == "__main__":
    main()

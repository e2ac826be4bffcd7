"""Which PyTorch kernels give a row the same bits whatever shares its forward (issue 42; docs/results/
static-step.md): the fp32 GEMMs of the static step's attention by bucket, an fp32/bf16 GEMM at row counts
M = 1..256 and at each place in the batch, SDPA over a fixed key length, and the same attention with one key
moved to another slot (a tree node's ancestor that is not adjacent). Prints one line per case: the M (and
places) whose row differs from the reference.

    python benchmarks/row_invariance.py [--device cuda] [--linear-only] [--dtypes fp32] [--blas cublaslt|triton|c]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def gemm(dev: torch.device, dtype: torch.dtype, linear=F.linear) -> None:
    g = torch.Generator().manual_seed(0)
    for K, N in [(576, 576), (576, 1536), (1536, 576), (576, 49152)]:
        W = torch.randn(N, K, generator=g).to(dev, dtype)
        x = torch.randn(256, K, generator=g).to(dev, dtype)
        ref = {m0: linear(x[:m0], W)[:1] for m0 in (1, 2, 8)}
        for m0, r in ref.items():
            bad = []
            for M in (1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 128, 256):
                for p in sorted({0, M // 2, M - 1}):
                    xs = x[:M].clone()
                    xs[p] = x[0]
                    if not torch.equal(linear(xs, W)[p:p + 1], r):
                        bad.append((M, p))
            print(f"{dtype} linear {K}->{N}: row 0 as at M={m0}; (M, place) that differ: {bad}")


def attention(dev: torch.device, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    S, d = 300, 64
    k, v = (torch.randn(1, 3, S, d, generator=g).to(dev, dtype) for _ in range(2))
    q = torch.randn(1, 9, 64, d, generator=g).to(dev, dtype)
    mask = torch.full((1, 1, 64, S), float("-inf"), device=dev)
    mask[..., :200] = 0
    ref = F.scaled_dot_product_attention(q[:, :, :8].float(), k.float(), v.float(), attn_mask=mask[:, :, :8],
                                         enable_gqa=True)[:, :, :1]
    bad = [M for M in (8, 16, 32, 64) if not torch.equal(F.scaled_dot_product_attention(
        q[:, :, :M].float(), k.float(), v.float(), attn_mask=mask[:, :, :M], enable_gqa=True)[:, :, :1], ref)]
    print(f"{dtype} SDPA over {S} slots: row 0 as at 8 rows; row counts that differ: {bad}")
    # the same visible keys, one of them at slot 105 instead of 102 (zeros between)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 105], v2[:, :, 105] = k[:, :, 102], v[:, :, 102]
    k2[:, :, 102] = v2[:, :, 102] = 0
    mA = torch.full((1, 1, 8, S), float("-inf"), device=dev)
    mA[..., :103] = 0
    mB = torch.full((1, 1, 8, S), float("-inf"), device=dev)
    mB[..., :102] = 0
    mB[..., 105] = 0
    a = F.scaled_dot_product_attention(q[:, :, :8].float(), k.float(), v.float(), attn_mask=mA, enable_gqa=True)
    b = F.scaled_dot_product_attention(q[:, :, :8].float(), k2.float(), v2.float(), attn_mask=mB, enable_gqa=True)
    print(f"{dtype} SDPA, one key moved 3 slots on: equal {torch.equal(a, b)}, max difference "
          f"{(a - b).abs().max().item():.2e}")


def attention_gemms(dev: torch.device) -> None:
    """The fp32 batched GEMMs of the static step's `attend` at SmolLM2's shapes (3 kv heads of 3 heads, d 64)
    over 400 slots, in a bucket of N rows: the scores [rep N, d] @ [d, S] and the weighted sum [rep N, S] @
    [S, d] per kv head, and the window's [rep, W] @ [W, d] per row and kv head (N * 3 of them). A bf16 model
    runs these in fp32 too, so a difference here reaches its output wherever the cast to bf16 does not hide it."""
    g = torch.Generator().manual_seed(0)
    S, d, Hk, rep, W = 400, 64, 3, 3, 64
    q = torch.randn(Hk, rep * 256, d, generator=g).to(dev)
    k, v = (torch.randn(Hk, S, d, generator=g).to(dev) for _ in range(2))
    p = torch.softmax(torch.randn(Hk, rep * 256, S, generator=g), -1).to(dev)
    for name, a, b in (("scores", q, k.transpose(1, 2)), ("weighted sum", p, v)):
        ref = torch.bmm(a[:, :rep * 8].contiguous(), b)[:, :rep]
        bad = [N for N in (1, 16, 32, 64, 128, 256)
               if not torch.equal(torch.bmm(a[:, :rep * N].contiguous(), b)[:, :rep], ref)]
        print(f"fp32 attention {name} over {S} slots: row 0 as in a bucket of 8 rows; buckets that differ: {bad}")
    pw = torch.softmax(torch.randn(256 * Hk, rep, W, generator=g), -1).to(dev)
    vw = torch.randn(256 * Hk, W, d, generator=g).to(dev)
    ref = torch.bmm(pw[:8 * Hk], vw[:8 * Hk])[:Hk]
    bad = [N for N in (1, 16, 32, 64, 128, 256) if not torch.equal(torch.bmm(pw[:N * Hk], vw[:N * Hk])[:Hk], ref)]
    print(f"fp32 attention window ({W} keys), one product per row and kv head: row 0 as in a bucket of 8 rows; "
          f"buckets that differ: {bad}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--linear-only", action="store_true", help="only the linears' GEMMs (the fp32 question below)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--blas", default=None, choices=["cublas", "cublaslt", "triton", "c"],
                    help="CUDA: torch.backends.cuda.preferred_blas_library before any GEMM; triton: the linears "
                         "through the static step's row-linear kernel (midlayer/ops/row_linear.py); c: through "
                         "the CPU's C kernel (kernels.linear_rows)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[x] for x in args.dtypes.split(",")]
    # (on an H200 cuBLAS's fp32 GEMM gave a row other bits at every M: does a BLAS without split-K workspace,
    # CUBLAS_WORKSPACE_CONFIG=:0:0 in the environment, or cuBLASLt keep them? static_check.sh asks both)
    linear = F.linear
    if args.blas == "triton":
        from midlayer.ops.row_linear import row_linear as linear
    elif args.blas == "c":
        from midlayer.ops.kernels import linear_rows as linear
    elif args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    import os
    print(f"torch {torch.__version__}, {dev}, {torch.get_num_threads()} threads, BLAS {args.blas or 'default'}, "
          f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '')}")
    if not args.linear_only:
        attention_gemms(dev)
    for dtype in dtypes:
        gemm(dev, dtype, linear)
        if not args.linear_only:
            attention(dev, dtype)


if __name__ == "__main__":
    main()

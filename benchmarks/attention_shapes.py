"""The q4 attention kernel (`kernels.attention`, fp16 KV cache) at the shapes decoding and prefill give it:
microseconds per call, median of interleaved rounds. With `--against LIB`, another build of the kernel library
(e.g. the one an earlier commit's `python -m midlayer kernels` left in ~/.cache/midlayer) runs in the same
process, its rounds interleaved with this build's, and the ratio and the largest difference are printed.

    python benchmarks/attention_shapes.py [--against ~/.cache/midlayer/qkernels-<hash>-x86_64.so]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from midlayer.experiments.bench import machine_line
from midlayer.ops import kernels

# (B, T, H, Hk, S, D): rows of a batch, query rows each, heads, KV heads, keys, head dim
SHAPES = [(16, 1, 9, 3, 120, 64), (1, 1, 9, 3, 120, 64), (1, 1, 9, 3, 1000, 64), (16, 1, 4, 1, 120, 256),
          (1, 1, 4, 1, 1000, 256), (1, 64, 9, 3, 64, 64)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default=None, help="another build of the kernel library (.so)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    this = kernels.library()
    if this is None:
        raise SystemExit("the kernels are not built (no C compiler?)")
    libs = {"this": this}
    if args.against:
        other = ctypes.CDLL(args.against)
        other.qk_attention.argtypes = this.qk_attention.argtypes
        libs["other"] = other
    print(machine_line(), "\n")
    print("| B, T, H, Hk, S, D | " + " | ".join(f"{n} (us)" for n in libs)
          + (" | this / other | max abs difference |" if len(libs) > 1 else " |"))
    print("|---" * (1 + len(libs) + (2 if len(libs) > 1 else 0)) + "|")
    g = torch.Generator().manual_seed(0)
    for B, T, H, Hk, S, D in SHAPES:
        q = torch.randn(B, H, T, D, generator=g)
        k, v = torch.randn(B, Hk, S, D, generator=g).half(), torch.randn(B, Hk, S, D, generator=g).half()
        mask = torch.zeros(B, 1, T, S)
        times: dict[str, list[float]] = {n: [] for n in libs}
        outs = {}
        try:
            for r in range(args.rounds):
                for name in (list(libs) if r % 2 else list(libs)[::-1]):
                    kernels._lib = libs[name]
                    for _ in range(10):
                        outs[name] = kernels.attention(q, k, v, mask)
                    t = time.perf_counter()
                    for _ in range(args.reps):
                        kernels.attention(q, k, v, mask)
                    times[name].append((time.perf_counter() - t) / args.reps * 1e6)
        finally:
            kernels._lib = this
        med = {n: statistics.median(t) for n, t in times.items()}
        row = f"| {B}, {T}, {H}, {Hk}, {S}, {D} | " + " | ".join(f"{med[n]:.1f}" for n in libs)
        if len(libs) > 1:
            diff = (outs["this"] - outs["other"]).abs().max().item()
            row += f" | {med['this'] / med['other']:.2f} | {diff:.1e}"
        print(row + " |")


if __name__ == "__main__":
    main()

"""What the fused q4 block and the VNNI tiles save: one cached forward of SmolLM2-135M (q4) over T new rows,
timed in one run, the variants interleaved (issue 11; docs/results/decode-cpu.md, 27th session).

Variants: `fused` -- every block one C call (kernels.block_q4), the default; `modules` -- the same blocks
module by module (Block.fused_q4 = None: ~15 Python calls a block), the reference the fused call equals bit
for bit; and each at every SIMD level from `avx2` up that the CPU has (kernels.set_simd, kernels.SIMD_LEVELS:
`avx512-vnni` = the GEMM tiles on AVX512-VNNI in 256-bit registers, `avx512-vnni-zmm` = in 512-bit ones, also
bit for bit). Rows T > 1 are a chain-tree verification (its mask), as speculative decoding
runs them.

    python benchmarks/fused_block.py [--context 120] [--repeats 40]
"""

from __future__ import annotations

import argparse
import time

import torch

from midlayer.ops import kernels
from midlayer.engine.generate import forward_cached
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights
from midlayer.speculative.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=120, help="tokens already in the cache")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--rows", default="1,4,8")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    if not kernels.available():
        ap.error("the q4 kernels are not built (no C compiler?): nothing to time")
    if args.context < 1 or args.repeats < 1 or min(rows) < 1:
        ap.error("--context, --repeats and every row count must be >= 1")
    model, _ = load_pretrained("smollm2-135m")
    model = compress_weights(model, "q4").eval()
    plans = [b.fused_q4 for b in model.layers]
    ids = torch.randint(0, 1000, (1, args.context), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model.cfg, 1, max_len=args.context + max(rows), dtype=kv_dtype(model))
    with torch.inference_mode():
        forward_cached(model, ids, cache, torch.arange(args.context)[None])
    L = cache.length
    levels = {kernels.SIMD_LEVELS[lv]: lv for lv in kernels.simd_levels() if lv >= 1}  # avx2 and up
    variants = [(f, lv) for f in ("fused", "modules") for lv in levels]

    def step(T: int, fused: str, level: str) -> None:
        for b, p in zip(model.layers, plans):
            b.fused_q4 = p if fused == "fused" else None
        kernels.set_simd(levels[level])
        mask = DraftTree.chain(T - 1).verify_mask(L) if T > 1 else None
        forward_cached(model, torch.full((1, T), 5), cache, torch.arange(L, L + T)[None], extra_mask=mask,
                       last_only=T == 1)
        cache.truncate(L)

    total = {(T, *v): 0.0 for T in rows for v in variants}
    try:
        with torch.inference_mode():
            for key in total:  # warm-up
                step(*key)
            for _ in range(args.repeats):
                for key in total:
                    t = time.perf_counter()
                    step(*key)
                    total[key] += time.perf_counter() - t
    finally:
        kernels.set_simd(True)
        for b, p in zip(model.layers, plans):
            b.fused_q4 = p
    print(f"machine: {kernels.cpu_info().summary()}")
    print(f"SmolLM2-135M q4, one cached forward after {args.context} tokens, ms (mean of {args.repeats}, "
          "interleaved); in brackets: x the fused one-row step at the same SIMD level\n")
    print("| blocks | SIMD | " + " | ".join(f"T={T}" for T in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for fused, level in variants:
        one = 1e3 * total[(1, "fused", level)] / args.repeats if 1 in rows else None
        cells = []
        for T in rows:
            ms = 1e3 * total[(T, fused, level)] / args.repeats
            cells.append(f"{ms:.2f}" + (f" ({ms / one:.2f}x)" if one else ""))
        print(f"| {fused} | {level} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

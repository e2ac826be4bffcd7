"""Where a q4 decode step's time goes by C call, module by module, fused block by block, and with every block
in one call (stacked, the default; docs/results/decode-cpu.md, 27th and 28th sessions): one cached step of
SmolLM2-135M after 120 tokens, every kernel entry point wrapped with a timer; "Python" is the step's wall time
minus the wrapped calls (the timers add a little to both). `--rows N`: N sequences stepped together (a
continuous batch's step, whose linears are GEMMs of N rows).

    python benchmarks/step_parts.py [--repeats 100] [--rows 16]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from midlayer.ops import kernels
from midlayer.engine.generate import CachedStep, forward_cached
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights

ENTRY_POINTS = ("qk_blocks_q4", "qk_block_q4", "qk_linear_q4_1", "qk_linear_q8_0", "qk_attention", "qk_rmsnorm",
                "qk_rope_store", "qk_silu_mul", "qk_topk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--rows", type=int, default=1, help="sequences stepped together")
    args = ap.parse_args()
    if args.repeats < 1 or args.rows < 1:
        ap.error("--repeats and --rows must be >= 1")
    B = args.rows
    if not kernels.available():
        ap.error("the q4 kernels are not built (no C compiler?): nothing to time")
    model, _ = load_pretrained("smollm2-135m")
    model = compress_weights(model, "q4").eval()
    plans = [b.fused_q4 for b in model.layers]
    cache = KVCache.for_model(model.cfg, B, max_len=128, dtype=kv_dtype(model))
    with torch.inference_mode():
        forward_cached(model, torch.randint(0, 1000, (B, 120), generator=torch.Generator().manual_seed(0)), cache,
                       torch.arange(120)[None].expand(B, -1))
    L = cache.length
    lib = kernels.library()
    clock: dict[str, float] = collections.defaultdict(float)
    originals = {name: getattr(lib, name) for name in ENTRY_POINTS}

    def timed(name: str, f):
        def g(*a):
            t = time.perf_counter()
            try:
                return f(*a)
            finally:
                clock[name] += time.perf_counter() - t
        return g

    rows = []
    stacked = CachedStep.run_fused
    try:
        for name, f in originals.items():
            setattr(lib, name, timed(name, f))
        for variant in ("modules", "fused", "stacked"):
            for b, p in zip(model.layers, plans):
                b.fused_q4 = None if variant == "modules" else p
            CachedStep.run_fused = stacked if variant == "stacked" else (lambda *a: None)
            with torch.inference_mode():
                def step() -> None:
                    forward_cached(model, torch.full((B, 1), 5), cache, torch.full((B, 1), L), last_only=True)
                    cache.truncate(L)
                step()
                clock.clear()
                t = time.perf_counter()
                for _ in range(args.repeats):
                    step()
                total = 1e3 * (time.perf_counter() - t) / args.repeats
            parts = {k: 1e3 * v / args.repeats for k, v in clock.items()}
            rows.append((variant, total, parts))
    finally:
        CachedStep.run_fused = stacked
        for name, f in originals.items():
            setattr(lib, name, f)
        for b, p in zip(model.layers, plans):
            b.fused_q4 = p
    print(f"machine: {kernels.cpu_info().summary()}")
    print(f"SmolLM2-135M q4, one decode step of {B} sequence(s) after 120 tokens, ms (mean of {args.repeats}, "
          "timers in place)\n")
    names = [n for n in ENTRY_POINTS if any(n in p for _, _, p in rows)]
    print("| blocks | step | " + " | ".join(n.removeprefix("qk_") for n in names) + " | Python (the rest) |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for variant, total, parts in rows:
        cells = [f"{parts[n]:.2f}" if n in parts else "-" for n in names]
        print(f"| {variant} | {total:.2f} | " + " | ".join(cells) + f" | {total - sum(parts.values()):.2f} |")


if __name__ == "__main__":
    main()

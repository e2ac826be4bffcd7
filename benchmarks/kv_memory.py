"""KV cache bytes per model and context length: fp32 or fp16 K/V (the q4 format keeps fp16 since the 33rd
session), and with windowed and global blocks mixed (Gemma 3) every slot in every block or the windowed blocks
bounded to 2W - 1 slots (what plain generation allocates). Then a continuous batch of `--rows` rows at each
context, fp16: every slot against the windowed blocks bounded per row (2W - 1 columns plus the batch's one
scratch column, what `ContinuousBatch` allocates). Counted from the caches `KVCache.for_model` builds, nothing
timed (docs/results/gemma3-cpu.md).

    python benchmarks/kv_memory.py [--models smollm2-135m,gemma3-270m] [--contexts 2048,8192,32768] [--rows 16]
"""

from __future__ import annotations

import argparse

import torch

from midlayer.engine.pretrained import load_pretrained
from midlayer.model.kv_cache import KVCache


def kv_bytes(cfg, context: int, dtype: torch.dtype, bounded: bool, rows: int = 0) -> int:
    """Bytes of K and V in a one-sequence cache of `context` slots, or with `rows` a continuous batch's (the key
    biases and positions are not counted: 4 bytes per slot per layer and 8 per slot, per row)."""
    W = cfg.sliding_window
    cache = KVCache.for_model(cfg, max(rows, 1), max_len=context, dtype=dtype,
                              local_len=2 * W - 1 if bounded and cfg.mixed_windows else None, spare=1,
                              row_offsets=rows > 0)
    return sum(t.numel() * t.element_size() for t in cache.k_layers + cache.v_layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--rows", type=int, default=16, help="rows of the continuous batch in the second table")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print("| model | context | fp32, every slot (MB) | fp16, every slot | fp32, windowed blocks bounded | "
          "fp16, windowed blocks bounded |\n|---|---|---|---|---|---|")
    for name in args.models.split(","):
        cfg = load_pretrained(name)[0].cfg
        for ctx in contexts:
            if ctx > cfg.max_seq_len:
                continue
            cells = [kv_bytes(cfg, ctx, dt, b) / 1e6 for b in (False, True) for dt in (torch.float32, torch.float16)]
            bounded = [f"{c:,.0f}" for c in cells[2:]] if cfg.mixed_windows else ["-", "-"]
            print(f"| {name} | {ctx:,} | {cells[0]:,.0f} | {cells[1]:,.0f} | {bounded[0]} | {bounded[1]} |")
    print(f"\n| model | context | batch of {args.rows} rows, fp16, every slot (MB) | windowed blocks bounded per row "
          "|\n|---|---|---|---|")
    for name in args.models.split(","):
        cfg = load_pretrained(name)[0].cfg
        if not cfg.mixed_windows:
            continue
        for ctx in contexts:
            if ctx <= cfg.max_seq_len:
                every, bounded = (kv_bytes(cfg, ctx, torch.float16, b, args.rows) / 1e6 for b in (False, True))
                print(f"| {name} | {ctx:,} | {every:,.0f} | {bounded:,.0f} |")


if __name__ == "__main__":
    main()

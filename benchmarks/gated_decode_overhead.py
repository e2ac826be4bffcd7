"""What the gated engine costs per decoded token on a pretrained model (issue 15), before any skipping pays:
SmolLM2-135M-Instruct in q4, batch 1, greedy decode over the KV cache, ms/token, for

  * the dense model;
  * the dense model with its cache forced onto the masked attention path (what a layer that some token
    skipped costs: `KVCache.dense_layers` False);
  * skip gates with routers at 0 (every gate exactly 1: the dense outputs; only the gate bookkeeping);
  * static skips of blocks 14-15 and 10-19 for every token (`bench.static_skip_gates`: real skipping).

Rounds interleave the variants; the best round of each is printed. Run with nothing else on the CPU:

    OMP_NUM_THREADS=2 python benchmarks/gated_decode_overhead.py [--rounds 3] [--tokens 40]
Written up in docs/results/pretrained-skipping-cpu.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from midlayer.experiments.bench import machine_line, static_skip_gates  # noqa: E402
from midlayer.engine.generate import decode_one_token, prefill  # noqa: E402
from midlayer.model.kv_cache import KVCache, kv_dtype  # noqa: E402
from midlayer.engine.pretrained import load_pretrained  # noqa: E402
from midlayer.engine.quantization import compress_weights  # noqa: E402
from midlayer.speculative.skip_gates import SkipGates  # noqa: E402


@torch.no_grad()
def ms_per_token(model, ids: list[int], n: int, masked: bool = False) -> float:
    cache = KVCache.for_model(model.cfg, 1, len(ids) + n, dtype=kv_dtype(model))
    logits, pos = prefill(model, [ids], cache)
    if masked:
        cache.dense_layers = [False] * model.cfg.n_layers
    tok = logits.argmax(-1)
    t = time.perf_counter()
    for _ in range(n):
        logits = decode_one_token(model, cache, tok, pos)
        tok, pos = logits.argmax(-1), pos + 1
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    args = ap.parse_args()
    model = compress_weights(load_pretrained("smollm2-135m")[0].float(), "q4").eval()
    ids = list(range(100, 100 + args.prompt_tokens))
    variants = {"dense": (model, False), "dense, masked attention path": (model, True),
                "routers at 0 (gates 1)": (SkipGates.for_model(model).twin(model), False),
                "static skip 14-15": (static_skip_gates(model, 14).twin(model), False),
                "static skip 10-19": (static_skip_gates(model, 10).twin(model), False)}
    best = {k: float("inf") for k in variants}
    for _ in range(args.rounds):
        for k, (m, masked) in variants.items():
            best[k] = min(best[k], ms_per_token(m, ids, args.tokens, masked))
    print(machine_line())
    print(f"\nSmolLM2-135M-Instruct, q4, batch 1, {args.prompt_tokens}-token prompt, {args.tokens} decoded tokens, "
          f"best of {args.rounds} interleaved rounds\n")
    print("| variant | ms/token | vs dense |\n|---|---|---|")
    for k, v in best.items():
        print(f"| {k} | {v:.2f} | {best['dense'] / v:.2f}x |")


if __name__ == "__main__":
    main()

"""What a continuous batch's rows cost and what the engine gives without HTTP (docs/results/serve-cpu.md,
32nd session): (1) one decode step of a `ContinuousBatch` of N sequences at a 128-token context against a
forward of N rows of one sequence after the same context (the tree-verification shape; the difference is N
separate KV caches read per layer); (2) `ContinuousBatch` throughput on `midlayer bench serve`'s 32 held-out
chat prompts fed 1, 4 and 16 at a time, plain, for two output lengths.

    python benchmarks/batch_rows.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import midlayer
from midlayer.engine.generate import GenerationConfig, forward_cached
from midlayer.experiments.bench import heldout_texts, machine_line
from midlayer.model.kv_cache import KVCache


def step_costs(llm: midlayer.LLM, repeats: int) -> list[tuple[int, float, float]]:
    """(N, ms per batch step of N sequences, ms per forward of N rows of one sequence), medians."""
    model = llm.model
    ids = llm.encode("The quick brown fox jumps over the lazy dog. " * 20)[:128]
    out = []
    for n in (1, 4, 16):
        batch = llm.batch(16)
        for _ in range(n):
            batch.add(ids, GenerationConfig(max_new_tokens=1000))
        for _ in range(4):  # the join, then warm-up steps
            batch.step()
        steps = []
        for _ in range(repeats):
            t = time.perf_counter()
            batch.step()
            steps.append(time.perf_counter() - t)
        cache = KVCache.for_model(model.cfg, 1, max_len=200)
        forward_cached(model, torch.tensor([ids]), cache, torch.arange(128)[None])
        rows = []
        for _ in range(repeats):
            cache.truncate(128)
            t = time.perf_counter()
            forward_cached(model, torch.tensor([ids[:n]]), cache, torch.arange(128, 128 + n)[None])
            rows.append(time.perf_counter() - t)
        out.append((n, 1e3 * statistics.median(steps), 1e3 * statistics.median(rows)))
    return out


def engine_rates(llm: midlayer.LLM, max_tokens: int, n_prompts: int = 32) -> list[tuple[int, float]]:
    """(sequences at a time, tokens/s) over `n_prompts` held-out chat prompts fed 1, 4 and 16 at a time into
    `llm.batch` (also benchmarks/batch_lookup.py's measurement)."""
    ids = [llm.encode([{"role": "user", "content": t}]) for t in heldout_texts(n_prompts, "scaled")]
    cfg = llm.settings(max_tokens, 0.0, 0, 1.0, None)
    out = []
    for conc in (1, 4, 16):
        batch = llm.batch(16)
        pending, tokens = list(ids), 0
        t0 = time.perf_counter()
        while pending or len(batch):
            while pending and len(batch) < conc:
                batch.add(pending.pop(0), cfg)
            tokens += sum(len(new) for _, new, _ in batch.step())
        out.append((conc, tokens / (time.perf_counter() - t0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    llm = midlayer.LLM.load("smollm2-135m", weights="q4")
    print(machine_line(), "\n")
    print("| N | batch step, N sequences (ms) | N rows of one sequence (ms) |\n|---|---|---|")
    for n, step, rows in step_costs(llm, args.repeats):
        print(f"| {n} | {step:.1f} | {rows:.1f} |")
    for max_tokens in (64, 256):
        rates = engine_rates(llm, max_tokens)
        print(f"\nContinuousBatch alone, 32 prompts, up to {max_tokens} tokens: " + ", ".join(
            f"{c} at a time {r:.0f} tok/s ({r / rates[0][1]:.2f}x)" for c, r in rates))


if __name__ == "__main__":
    main()

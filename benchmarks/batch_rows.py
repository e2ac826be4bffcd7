"""What a continuous batch's rows cost and what the engine gives without HTTP (docs/results/serve-cpu.md,
32nd and 33rd sessions): (1) one decode step of a `ContinuousBatch` of N sequences at a --context-token
context against a forward of N rows of one sequence after the same context (the tree-verification shape;
the difference is N separate KV caches read per layer); (2) `ContinuousBatch` throughput on `midlayer bench
serve`'s held-out chat prompts (--prompts of them) fed 1, 4 and 16 at a time, plain, for two output lengths,
and how that time splits into the prompts' prefill (the same prompts with one new token each) and decoding:
the prefill costs about the same at any concurrency, so it bounds what the batch can gain (34th session).
--kv-cache fp16,fp32 measures each KV cache dtype (fp16, the q4 default since the 33rd session), alternating.

    python benchmarks/batch_rows.py [--repeats 10] [--context 128] [--prompts 32] [--kv-cache fp16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import midlayer
from midlayer.engine.generate import GenerationConfig, forward_cached
from midlayer.experiments.bench import heldout_texts, machine_line
from midlayer.model.kv_cache import KVCache, kv_dtype


def step_costs(llm: midlayer.LLM, repeats: int, context: int = 128) -> list[tuple[int, float, float]]:
    """(N, ms per batch step of N sequences, ms per forward of N rows of one sequence), medians."""
    model = llm.model
    ids = llm.encode("The quick brown fox jumps over the lazy dog. " * (1 + context // 8))[:context]
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
        cache = KVCache.for_model(model.cfg, 1, max_len=context + 64, dtype=kv_dtype(model))
        forward_cached(model, torch.tensor([ids]), cache, torch.arange(context)[None])
        rows = []
        for _ in range(repeats):
            cache.truncate(context)
            t = time.perf_counter()
            forward_cached(model, torch.tensor([ids[:n]]), cache, torch.arange(context, context + n)[None])
            rows.append(time.perf_counter() - t)
        out.append((n, 1e3 * statistics.median(steps), 1e3 * statistics.median(rows)))
    return out


def engine_rates(llm: midlayer.LLM, max_tokens: int, n_prompts: int = 32) -> list[tuple[int, float, float, float]]:
    """(sequences at a time, tokens/s, seconds, new tokens per decode forward) over `n_prompts` held-out chat
    prompts fed 1, 4 and 16 at a time into `llm.batch` (also benchmarks/batch_lookup.py's measurement). Tokens
    per forward counts each sequence's first token (from its prefill) as a forward of its own: 1.00 without
    drafts; with a drafter, the mean accepted length tau."""
    ids = [llm.encode([{"role": "user", "content": t}]) for t in heldout_texts(n_prompts, "scaled")]
    cfg = llm.settings(max_tokens, 0.0, 0, 1.0, None)
    out = []
    for conc in (1, 4, 16):
        batch = llm.batch(16)
        pending, tokens, forwards = list(ids), 0, 0
        t0 = time.perf_counter()
        while pending or len(batch):
            while pending and len(batch) < conc:
                batch.add(pending.pop(0), cfg)
            for seq, new, done in batch.step():
                tokens += len(new)
                forwards += (seq.forwards + 1) if done else 0
        seconds = time.perf_counter() - t0
        out.append((conc, tokens / seconds, seconds, tokens / max(forwards, 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--context", type=int, default=128, help="tokens before the timed decode steps of part (1)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out chat prompts of part (2)")
    ap.add_argument("--kv-cache", default="fp16", help="KV cache dtypes, comma-separated (fp16, fp32)")
    args = ap.parse_args()
    kvs = [k for k in args.kv_cache.split(",") if k]
    bad = [k for k in kvs if k not in ("fp16", "fp32")]
    if bad or not kvs:
        raise SystemExit(f"--kv-cache takes fp16 and/or fp32, got {args.kv_cache!r}")
    llm = midlayer.LLM.load("smollm2-135m", weights="q4")
    print(machine_line(), "\n")
    dtypes = {"fp16": torch.float16, "fp32": torch.float32}
    print("| KV cache | N | batch step, N sequences (ms) | N rows of one sequence (ms) |\n|---|---|---|---|")
    for kv in kvs:
        llm.model.kv_dtype = dtypes[kv]
        for n, step, rows in step_costs(llm, args.repeats, args.context):
            print(f"| {kv} | {n} | {step:.1f} | {rows:.1f} |")
    for max_tokens in (64, 256):
        for kv in kvs:
            llm.model.kv_dtype = dtypes[kv]
            rates = engine_rates(llm, max_tokens, args.prompts)
            print(f"\nContinuousBatch alone, KV {kv}, {args.prompts} prompts, up to {max_tokens} tokens: " + ", ".join(
                f"{c} at a time {r:.0f} tok/s ({r / rates[0][1]:.2f}x)" for c, r, _, _ in rates))
            # the split: the same prompts with one new token each (their prefill, and one sampled token)
            prefill = {c: sec for c, _, sec, _ in engine_rates(llm, 1, args.prompts)}
            decode = [(c, r * sec - args.prompts, sec - prefill[c]) for c, r, sec, _ in rates]
            print("  prefill alone: " + ", ".join(f"{c} at a time {prefill[c]:.2f} s" for c, _, _, _ in rates)
                  + f"; of {', '.join(f'{sec:.2f}' for _, _, sec, _ in rates)} s in all")
            print("  decoding alone (the rest): " + ", ".join(
                f"{c} at a time {n / sec:.0f} tok/s ({n / sec / (decode[0][1] / decode[0][2]):.2f}x)"
                for c, n, sec in decode))


if __name__ == "__main__":
    main()

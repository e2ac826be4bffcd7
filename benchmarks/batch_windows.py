"""Long prompts in the continuous batch on a model with windowed and global blocks (Gemma 3): the windowed
layers bounded per row (engine/batch.py, `bound_windows=True`, the default) against every slot kept. Several
long prompts (held-out prompts joined into one document each, "Summarise these notes:") decode a few rows at a
time; rounds alternate the two settings. Prints, per setting, the seconds and new tokens per second of each
round, the K/V bytes the batch's cache holds at the end (its largest: a cache only grows), and whether every
output equals the other setting's and, for the first prompts, `LLM.generate`'s.

    python benchmarks/batch_windows.py [gemma3-270m] [--prompts 6] [--rows 3] [--prompt-tokens 1500]
        [--max-tokens 48] [--rounds 2] [--check 2]
"""

from __future__ import annotations

import argparse
import time

import midlayer
from midlayer.experiments.bench import heldout_texts, machine_line


def documents(llm, n: int, tokens: int) -> list[list[int]]:
    """n chat prompts of about `tokens` tokens each: held-out prompts, rotated so that each starts elsewhere."""
    texts = heldout_texts(40, "scaled")
    out = []
    for i in range(n):
        notes, k = [], i
        while len(llm.encode("\n\n".join(notes))) < tokens:
            notes.append(texts[k % len(texts)])
            k += 1
        out.append(llm.encode([{"role": "user", "content": "Summarise these notes:\n\n" + "\n\n".join(notes)}]))
    return out


def run(llm, prompts: list[list[int]], cfg, rows: int, bound: bool) -> tuple[float, list[list[int]], float]:
    """(seconds, each prompt's new tokens, K/V MB of the batch's cache at the end)."""
    batch = llm.batch(rows, bound_windows=bound)
    t0 = time.perf_counter()
    handles = {batch.add(p, cfg): i for i, p in enumerate(prompts)}
    got = {i: [] for i in range(len(prompts))}
    while len(batch):
        for seq, tokens, _ in batch.step():
            got[handles[seq.handle]] += tokens
    seconds = time.perf_counter() - t0
    c = batch.cache
    mb = sum(t.numel() * t.element_size() for t in c.k_layers + c.v_layers) / 1e6
    return seconds, [got[i] for i in range(len(prompts))], mb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--rows", type=int, default=3, help="rows of the batch (sequences at a time)")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--check", type=int, default=2, help="prompts also decoded alone by LLM.generate")
    args = ap.parse_args()
    llm = midlayer.LLM.load(args.model, weights="q4")
    cfg = llm.settings(args.max_tokens, 0.0, 0, 1.0, None)
    prompts = documents(llm, args.prompts, args.prompt_tokens)
    run(llm, prompts[:1], llm.settings(2, 0.0, 0, 1.0, None), 1, True)  # warm-up
    results: dict[bool, list[tuple[float, list[list[int]], float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for bound in ((True, False) if r % 2 == 0 else (False, True)):
            results[bound].append(run(llm, prompts, cfg, args.rows, bound))
    ref = [llm.generate(p, max_tokens=args.max_tokens).token_ids for p in prompts[:args.check]]
    print(machine_line(), f"\n\n{args.model} (q4), {len(prompts)} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.rows} rows, {args.max_tokens} new tokens each, "
          f"{args.rounds} interleaved rounds\n")
    print("| windowed layers | seconds per round | new tok/s per round | K/V held at the end (MB) | "
          "outputs = the other setting's | first prompts = LLM.generate |\n|---|---|---|---|---|---|")
    base = results[False][0][1]
    for bound in (True, False):
        rs = results[bound]
        new = sum(len(t) for t in rs[0][1])
        same = all(x[1] == base for x in rs)
        alone = sum(a == b for a, b in zip(rs[0][1], ref))
        print(f"| {'bounded per row' if bound else 'every slot'} | {', '.join(f'{x[0]:.2f}' for x in rs)} | "
              f"{', '.join(f'{new / x[0]:.1f}' for x in rs)} | {rs[0][2]:,.1f} | {'yes' if same else 'NO'} | "
              f"{alone}/{len(ref)} |")


if __name__ == "__main__":
    main()

"""Prefix reuse in the continuous batch (engine/batch.py, `_prefix`): held-out chat prompts fed 1, 4 and 16 at a
time into `LLM.batch`, with reuse (the default, 16 tokens) and without (`prefix_reuse` 0), two interleaved passes;
aggregate tokens/s, and the prompts' prefill alone (the same prompts with one new token each). Chat prompts
share their template's start: SmolLM2's default system turn.

    python benchmarks/prefix_reuse.py [smollm2-135m | gemma3-270m] [--prompts N] [--max-tokens N]
"""

from __future__ import annotations

import argparse

import midlayer
from batch_rows import engine_rates  # (this folder is on the path when a benchmark runs as a script)
from midlayer.experiments.bench import heldout_texts, machine_line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = midlayer.LLM.load(args.model, weights="q4")
    ids = [llm.encode([{"role": "user", "content": t}]) for t in heldout_texts(args.prompts, "scaled")]
    shared = min(next((i for i, (a, b) in enumerate(zip(ids[0], x)) if a != b), len(x)) for x in ids[1:])
    engine_rates(llm, 8, n_prompts=2)  # warm-up
    rates: dict[tuple[int, int, int], list[float]] = {}
    for _ in range(2):
        for reuse in (16, 0):
            llm.prefix_reuse = reuse
            for tokens in (args.max_tokens, 1):
                for conc, rate, sec, _ in engine_rates(llm, tokens, args.prompts):
                    rates.setdefault((reuse, tokens, conc), []).append(rate if tokens > 1 else sec)
    print(machine_line(), f"\n\n{args.model} (q4), {args.prompts} held-out chat prompts ({sum(map(len, ids))} tokens; "
          f"all start with the same {shared}), up to {args.max_tokens} new tokens; two passes each\n")
    print("| at a time | tok/s, reuse off | tok/s, reuse on | on / off | prefill alone (s), off | prefill alone (s), on |"
          "\n|---|---|---|---|---|---|")
    for conc in (1, 4, 16):
        off, on = rates[(0, args.max_tokens, conc)], rates[(16, args.max_tokens, conc)]
        p_off, p_on = rates[(0, 1, conc)], rates[(16, 1, conc)]
        print(f"| {conc} | {off[0]:.0f}, {off[1]:.0f} | {on[0]:.0f}, {on[1]:.0f} | {sum(on) / sum(off):.2f}x | "
              f"{p_off[0]:.2f}, {p_off[1]:.2f} | {p_on[0]:.2f}, {p_on[1]:.2f} |")


if __name__ == "__main__":
    main()

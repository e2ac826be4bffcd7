"""A drafter inside a continuous batch (docs/results/gemma3-cpu.md, 32nd session; docs/results/serve-cpu.md,
33rd): 12 held-out chat prompts, up to 64 new tokens, fed 1, 4 and 16 at a time into `LLM.batch`, plain and
with the drafter attached -- prompt lookup (default), or a draft directory of Medusa heads, EAGLE or hidden
transfer, the drafters a batch runs (each step drafts to the depth that pays: engine/batch.py, "When a draft
pays"); aggregate tokens/s of two interleaved passes, and the drafter's tokens per decode forward (tau).

    python benchmarks/batch_lookup.py [smollm2-135m | gemma3-270m] [lookup | DRAFT_DIR]
"""

from __future__ import annotations


import midlayer
from batch_rows import engine_rates  # (this folder is on the path when a benchmark runs as a script)
from midlayer.experiments.bench import machine_line


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # (--help was taken for a model name)
    p.add_argument("model", nargs="?", default="gemma3-270m", help="smollm2-135m or gemma3-270m")
    p.add_argument("draft", nargs="?", default="lookup", help="lookup, or a train-draft directory")
    args = p.parse_args()
    name, draft = args.model, args.draft
    llm = midlayer.LLM.load(name, weights="q4")
    rates: dict[tuple[str, int], list[float]] = {}
    taus: dict[int, list[float]] = {}
    engine_rates(llm, 8, n_prompts=2)  # warm-up: the first timed pass would pay for it otherwise
    for mode in ("plain", "draft") * 2:
        llm.attach(draft if mode == "draft" else None)
        for conc, rate, _, tau in engine_rates(llm, 64, n_prompts=12):
            rates.setdefault((mode, conc), []).append(rate)
            if mode == "draft":
                taus.setdefault(conc, []).append(tau)
    print(machine_line(), f"\n\n{name} (q4), drafter {draft}, tok/s of two passes\n\n"
          "| at a time | plain | with the drafter | drafter / plain | tau |\n|---|---|---|---|---|")
    for conc in (1, 4, 16):
        p, lk = rates[("plain", conc)], rates[("draft", conc)]
        print(f"| {conc} | {p[0]:.0f}, {p[1]:.0f} | {lk[0]:.0f}, {lk[1]:.0f} | {sum(lk) / sum(p):.2f}x | "
              f"{sum(taus[conc]) / 2:.2f} |")


if __name__ == "__main__":
    main()

"""Prompt lookup inside a continuous batch (docs/results/gemma3-cpu.md, 32nd session): 12 held-out chat
prompts, up to 64 new tokens, fed 1, 4 and 16 at a time into `LLM.batch`, plain and with lookup attached
(each step drafts to the depth that pays: engine/batch.py, "When a draft pays"); aggregate tokens/s, two
interleaved passes.

    python benchmarks/batch_lookup.py [smollm2-135m | gemma3-270m]
"""

from __future__ import annotations

import sys
import time

import midlayer
from midlayer.experiments.bench import heldout_texts, machine_line


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
    llm = midlayer.LLM.load(name, weights="q4")
    ids = [llm.encode([{"role": "user", "content": t}]) for t in heldout_texts(12, "scaled")]
    cfg = llm.settings(64, 0.0, 0, 1.0, None)
    rates: dict[tuple[str, int], list[float]] = {}
    for mode in ("plain", "lookup") * 2:
        llm.attach("lookup" if mode == "lookup" else None)
        for conc in (1, 4, 16):
            batch = llm.batch(16)
            pending, tokens = list(ids), 0
            t0 = time.perf_counter()
            while pending or len(batch):
                while pending and len(batch) < conc:
                    batch.add(pending.pop(0), cfg)
                tokens += sum(len(new) for _, new, _ in batch.step())
            rates.setdefault((mode, conc), []).append(tokens / (time.perf_counter() - t0))
    print(machine_line(), f"\n\n{name} (q4), tok/s of two passes\n\n| at a time | plain | lookup | lookup / plain |\n|---|---|---|---|")
    for conc in (1, 4, 16):
        p, lk = rates[("plain", conc)], rates[("lookup", conc)]
        print(f"| {conc} | {p[0]:.0f}, {p[1]:.0f} | {lk[0]:.0f}, {lk[1]:.0f} | {sum(lk) / sum(p):.2f}x |")


if __name__ == "__main__":
    main()

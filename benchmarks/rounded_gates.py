"""Soft skip gates rounded to hard ones (issue 15): the held-out quality and skipping of gates trained with
eq. 2's soft values when the same routers are run with `gate_values = "hard"` (g = 1 while S < 1/2, else 0:
every closed gate a skipped block, no fractional multiply), beside the gates as trained.

Why: soft-trained gates settle at fractions (0.5-0.96 per token on SmolLM2) and skip nothing, while hard
gates trained from the dense start oscillate (docs/results/pretrained-skipping-cpu.md). Rounding the soft
gates asks whether the per-token spread they learned already ranks the tokens that can skip.

    python benchmarks/rounded_gates.py gates/smollm2-135m/t0.5-r0 gates/smollm2-135m/t0.25-r0 [--records 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from midlayer.speculative.distill import DistillSet
from midlayer.speculative.draft_training import DraftTrainConfig, _autocast, heldout_metrics, response_batches
from midlayer.speculative.registry import load_draft
from midlayer.engine.pretrained import load_pretrained


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gates", nargs="+", help="gates directories (train-gates --out-dir)")
    ap.add_argument("--records", type=int, default=32, help="held-out records (response positions)")
    args = ap.parse_args()
    rows = []
    model = data = None
    for path in args.gates:
        meta = json.loads((Path(path) / "draft.json").read_text())["meta"]
        cfg = DraftTrainConfig(**meta["train"])
        if model is None:
            model = load_pretrained(cfg.model)[0].eval()
            data = DistillSet.load(cfg.data)
        held = response_batches(data, cfg.seq_len, args.records)
        module, _ = load_draft(path, model)
        for values in ("soft", "hard"):
            module.gate_values = values
            module._twins.clear()  # the twin takes gate_values when built  # noqa: SLF001
            with _autocast(cfg, model):
                m = heldout_metrics(cfg, model, module, held)
            rows.append((Path(path).name, values, m))
    print(f"held-out: {args.records} records, response positions\n")
    print("| gates | values | KL to dense | greedy-token agreement | blocks skipped | mean gate, blocks 0 / 7 / 14 |")
    print("|---|---|---|---|---|---|")
    for name, values, m in rows:
        g = m["gate_mean"]
        print(f"| {name} | {values} | {m['kl']:.4f} | {m['top1'][0]:.3f} | {100 * m['skipped_blocks_frac']:.1f}% | "
              f"{g[0]:.2f} / {g[7]:.2f} / {g[14]:.2f} |")


if __name__ == "__main__":
    main()

"""Tables of the paper's analyses (arXiv 2404.12022 Figs. 3-6, sec. 4.5 ablation) from `train-draft` outputs.

Reads the held-out metrics each run saved (`runs/draft/<name>/metrics.json`) and prints Markdown:
  * Fig. 3: draft top-1 accuracy per step, hidden transfer vs Medusa vs early exit (given the true prefix);
  * Fig. 4: cosine similarity of pseudo vs real hidden states entering each block, per step;
  * Figs. 5-6: step-1 accuracy by its transfer block (k = 1 runs), step-2 accuracy by its block (t_1 = 14);
  * masked vs not masked, joint vs sequential training.

    .venv/bin/python benchmarks/draft_analyses.py [--root runs/draft] [--fig5 fig5-e2 --fig6 fig6-e2]
Written up in docs/results/hidden-transfer-cpu.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(root: Path, name: str) -> dict | None:
    f = root / name / "metrics.json"
    return json.loads(f.read_text()) if f.is_file() else None


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/draft")
    ap.add_argument("--fig5", default="fig5", help="run-name prefix of the step-1 layer study (PREFIX-tT)")
    ap.add_argument("--fig6", default="fig6", help="run-name prefix of the step-2 layer study (PREFIX-tT)")
    args = ap.parse_args()
    root = Path(args.root)
    out: list[str] = []

    out += ["### Draft top-1 accuracy per step, held-out (Fig. 3)", "",
            "| method | step 1 | step 2 | step 3 | held-out anchors (step 1) | steps trained | final train KL |",
            "|---|---|---|---|---|---|---|"]
    for name, label in [("hidden-transfer", "hidden transfer (t = 14, 19, 19)"), ("medusa", "Medusa (3 heads)"),
                        ("early-exit", "early exit (block 14), one step")]:
        m = load(root, name)
        if m:
            top = m["top1"] + [None] * (3 - len(m["top1"]))
            out.append(f"| {label} | {' | '.join(pct(x) for x in top[:3])} | {int(m['anchors'][0])} | {m['steps']} | "
                       f"{m['final_loss']:.3f} |")
    out.append("")

    m = load(root, "hidden-transfer")
    if m and "cosine" in m:
        layers = sorted({int(layer) for c in m["cosine"].values() for layer in c})
        out += ["### Cosine similarity, pseudo vs real state entering each block (Fig. 4)", "",
                "| step | " + " | ".join(str(layer) for layer in layers) + " |",
                "|---|" + "---|" * len(layers)]
        for step, c in m["cosine"].items():
            out.append(f"| {step} | " + " | ".join(f"{c[str(layer)]:.3f}" if str(layer) in c else "" for layer in layers) + " |")
        out += ["", "(block 30 = the final residual, before the last norm)", ""]

    rows = [(t, load(root, f"{args.fig5}-t{t}")) for t in (5, 10, 14, 20, 25)]
    if any(m for _, m in rows):
        out += ["### Step-1 accuracy by transfer block, k = 1 (Fig. 5)", "", "| block t_1 | step-1 top-1 | steps |",
                "|---|---|---|"]
        out += [f"| {t} | {pct(m['top1'][0])} | {m['steps']} |" for t, m in rows if m]
        out.append("")
    rows = [(t, load(root, f"{args.fig6}-t{t}")) for t in (14, 19, 24)]
    if any(m for _, m in rows):
        out += ["### Step-2 accuracy by its transfer block, t_1 = 14, k = 2 (Fig. 6)", "",
                "| block t_2 | step-1 top-1 | step-2 top-1 | steps |", "|---|---|---|---|"]
        out += [f"| {t} | {pct(m['top1'][0])} | {pct(m['top1'][1])} | {m['steps']} |" for t, m in rows if m]
        out.append("")
    rows = [("not masked, joint (default)", load(root, "hidden-transfer")), ("masked, joint", load(root, "ht-masked")),
            ("not masked, sequential", load(root, "ht-sequential"))]
    if sum(1 for _, m in rows if m) > 1:
        out += ["### Ablations: mask and training schedule (sec. 4.5)", "",
                "| variant | step 1 | step 2 | step 3 | steps |", "|---|---|---|---|---|"]
        out += [f"| {n} | {' | '.join(pct(x) for x in m['top1'])} | {m['steps']} |" for n, m in rows if m]
    print("\n".join(out))


if __name__ == "__main__":
    main()

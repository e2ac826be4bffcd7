"""How much training amplifies last-bit noise, dense against gated (issue 14, item 1).

Trains each model twice from the same seed and data order: once as is, once with every initial weight moved
by `--perturb` relative (`TrainConfig.init_perturb`; 1e-7 is about float32's unit roundoff, i.e. what another
CPU's rounding does to the first step), then compares the two on the same validation tokens
(`evaluate.compare_models`): parameter distance, KL, and for the gated model the gates that are exactly 0 in
one run and not the other. Also prints the first training step whose loss differs by more than 1e-3.

    python benchmarks/perturbation_spread.py                      # debug preset, 400 steps, ~2 min
    python benchmarks/perturbation_spread.py --synthetic --eval-tokens 8192
    python benchmarks/perturbation_spread.py --preset tiny --steps 800 --batch-size 16 --seq-len 256
Written up in docs/results/noise-cpu.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from midlayer.config import get_preset  # noqa: E402
from run_spread import compare_runs  # noqa: E402  (benchmarks/run_spread.py)
from midlayer.train.loop import train  # noqa: E402


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["ce"] for line in open(run / "metrics.jsonl")
            if '"ce"' in line and '"event"' not in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data", default="shakespeare")
    ap.add_argument("--synthetic", action="store_true",
                    help="train on the training tests' synthetic stream (tests/test_train.py) instead of --data")
    ap.add_argument("--perturb", type=float, default=1e-7)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--gamma", type=float, default=1e-2)
    ap.add_argument("--kp", type=float, default=0.3)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="perturb-"))
    if args.synthetic:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_train import synthetic_shards
        args.data = synthetic_shards(root)
    train_kw = dict(steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.batch_size, lr=args.lr,
                    data=args.data, log_every=1, eval_tokens=args.eval_tokens)
    if args.seq_len:
        train_kw["seq_len"] = args.seq_len
    print(f"preset {args.preset}, {args.steps} steps, perturbation {args.perturb:g} relative; runs in {root}")
    print("| model | val CE A | val CE B | KL(A||B)/token | top-1 agree | rel. param distance "
          "| gates 0 in one run only (per block) | skipped span differs | first step |dCE| > 1e-3 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gating in (False, True):
        kind = "gated" if gating else "dense"
        runs = []
        for p in (0.0, args.perturb):
            run = root / f"{kind}-p{p:g}"
            m, s, t = get_preset(args.preset, model=dict(gating=gating),
                                 sparsity=dict(mu0=1.0, mu_final=0.5, gamma=args.gamma, kp=args.kp),
                                 train=dict(train_kw, out_dir=str(run), init_perturb=p))
            train(m, s, t, progress=False)
            runs.append(run)
        r = compare_runs(runs[0], runs[1])
        a, b = _losses(runs[0]), _losses(runs[1])
        first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > 1e-3), None)
        flips = ", ".join(f"{f:.4f}" for f in r.get("zero_flip", [])) or "-"
        span = f"{r['span_differs']:.4f}" if "span_differs" in r else "-"
        print(f"| {kind} | {r['ce_a']:.5f} | {r['ce_b']:.5f} | {r['kl']:.2e} | {r['top1_agree']:.4f} | "
              f"{r['param_rel_dist']:.2e} | {flips} | {span} | {first if first else 'never'} |")


if __name__ == "__main__":
    main()

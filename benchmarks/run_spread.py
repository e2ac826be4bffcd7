"""How far apart two trained runs are (issue 14): a seed, or a last-bit perturbation of the initial weights
(`TrainConfig.init_perturb`, grid `cpu-noise`), on the same validation tokens (`compare_runs` here, over `evaluate.compare_models`).

    python benchmarks/run_spread.py sweeps/cpu-noise/gated-key-mu0.50-s0 sweeps/cpu-noise/gated-key-mu0.50-p1e-7-s0
    python benchmarks/run_spread.py A B --eval-tokens 50000
Written up in docs/results/noise-cpu.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from midlayer.data.shards import TokenWindows  # noqa: E402
from midlayer.train.evaluate import compare_models, load_run  # noqa: E402


def compare_runs(run_a: str | Path, run_b: str | Path, eval_tokens: int | None = None,
                 device: str = "cpu") -> dict[str, Any]:
    """`compare_models` on two runs' newest checkpoints, over run A's validation split and eval_tokens."""
    a, _, ta, files, _ = load_run(run_a, device)
    b, *_ = load_run(run_b, device)
    return compare_models(a, b, TokenWindows(files.val, ta.seq_len),
                          eval_tokens=ta.eval_tokens if eval_tokens is None else eval_tokens,
                          batch_size=ta.micro_batch_size)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--eval-tokens", type=int, default=None, help="default: run A's eval_tokens")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    r = compare_runs(args.run_a, args.run_b, args.eval_tokens)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"A {args.run_a}\nB {args.run_b}\n{r['tokens']:,} validation tokens")
    print(f"val CE A {r['ce_a']:.4f}  B {r['ce_b']:.4f}  |diff| {abs(r['ce_a'] - r['ce_b']):.4f}")
    print(f"KL(A||B) per token {r['kl']:.5f}  top-1 agreement {r['top1_agree']:.4f}  "
          f"relative parameter distance {r['param_rel_dist']:.3e}")
    if "zero_flip" in r:
        print("block | mean |g_A - g_B| | gates 0 in one run only")
        for b, (d, f) in enumerate(zip(r["gate_abs_diff"], r["zero_flip"])):
            print(f"{b:5d} | {d:16.4f} | {f:.4f}")
        print(f"tokens whose skipped span differs: {r['span_differs']:.4f}")


if __name__ == "__main__":
    main()

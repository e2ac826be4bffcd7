"""Why an uncontrolled gated model keeps its sparsity (issue 14): what the cross-entropy wants of each gate,
and what eq. 2 lets through.

For a trained run, on validation windows, per first-half block l and per token, the gradient of the mean
cross-entropy with respect to the gate value g(i, l) itself (both of its uses, block l and its mirror L-1-l):
dCE/dg < 0 means the loss would fall if the gate opened (CE summed over the batch's tokens, so the
numbers do not shrink with the batch size). A token with g = 0 (S >= 1) gets none of that
gradient through eq. 2 -- the clamp's derivative is 0 -- and neither does a token with g = 1 (every score
<= 0, ReLU's derivative is 0). If most saturated tokens have dCE/dg < 0, the model is held sparse by the
gradient path, not by the loss: the hypothesis of issue 14. How far past 1 their S lies (the margin the
router would have to move) is printed too.

What it leaves out: the gate's other use, eq. 3's key bias ln(max(g, eps)). A gate that is exactly 0 sits
under the clamp_min floor (ln eps), whose derivative in g is 0, so that path passes nothing back either;
the dCE/dg measured here is the multiply-by-gate path of blocks l and L-1-l (what reopening would change
in the residual), not the attention-visibility path of a gate moving off 0.

    python benchmarks/gate_gradients.py runs/sweep/cpu/gated-none [--batches 8]
Written up in docs/results/controller-cpu.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from midlayer.data.shards import TokenWindows  # noqa: E402
from midlayer.train.evaluate import load_run  # noqa: E402


def gate_gradients(run_dir: str, batches: int = 8) -> list[dict[str, float]]:
    model, mcfg, tcfg, files, step = load_run(run_dir)
    if not mcfg.gating:
        raise SystemExit(f"{run_dir}: a dense model has no gates")
    half = mcfg.n_layers // 2
    acc = [dict(n=0, n_zero=0, n_one=0, n_mid=0, zero_neg=0, zero_grad=0.0, mid_neg=0, one_neg=0,
                margin=[]) for _ in range(half)]
    windows = TokenWindows(files.val, tcfg.seq_len)
    for k, (x, y) in enumerate(windows.sequential(tcfg.micro_batch_size)):
        if k == batches:
            break
        walker = model.gate_walker()
        model.gate_walker = lambda w=walker: w  # this forward uses our walker, so its gates are reachable
        out = model(x, y)
        for g in walker.first_half:
            g.retain_grad()
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        del model.gate_walker
        for l, g in enumerate(walker.first_half):
            d, gv = g.grad.detach() * y.numel(), g.detach()  # d(summed CE)/dg: per token, not per batch
            a = acc[l]
            zero, one = gv == 0, gv == 1
            mid = ~zero & ~one
            a["n"] += gv.numel()
            a["n_zero"] += int(zero.sum())
            a["n_one"] += int(one.sum())
            a["n_mid"] += int(mid.sum())
            a["zero_neg"] += int((d[zero] < 0).sum())
            a["zero_grad"] += float(d[zero].sum())
            a["mid_neg"] += int((d[mid] < 0).sum())
            a["one_neg"] += int((d[one] < 0).sum())
        a = acc[half - 1]
        sat = walker.first_half[-1].detach() == 0
        a["margin"].extend(walker.cum.detach()[sat].flatten().tolist())  # S at the innermost block, S >= 1
    rows = []
    for l, a in enumerate(acc):
        rows.append({
            "block": l, "tokens": a["n"], "frac_zero": a["n_zero"] / a["n"], "frac_one": a["n_one"] / a["n"],
            "zero_want_open": a["zero_neg"] / max(1, a["n_zero"]),
            "zero_mean_grad": a["zero_grad"] / max(1, a["n_zero"]),
            "mid_want_open": a["mid_neg"] / max(1, a["n_mid"]),
            "one_want_more": a["one_neg"] / max(1, a["n_one"]),
            "median_S_saturated": float(torch.tensor(a["margin"]).median()) if a["margin"] else float("nan"),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--batches", type=int, default=8, help="validation micro-batches (default 8)")
    args = ap.parse_args()
    rows = gate_gradients(args.run_dir, args.batches)
    print(f"run {args.run_dir}: per first-half block, validation tokens")
    print("| block | tokens | g = 0 | g = 1 | g=0 with dCE/dg < 0 | mean dCE/dg at g=0 | 0<g<1 with dCE/dg < 0 "
          "| g=1 with dCE/dg < 0 | median S of saturated (innermost) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        med = f"{r['median_S_saturated']:.2f}" if r["block"] == len(rows) - 1 else "-"
        print(f"| {r['block']} | {r['tokens']:,} | {r['frac_zero']:.3f} | {r['frac_one']:.3f} | "
              f"{r['zero_want_open']:.3f} | {r['zero_mean_grad']:.2e} | {r['mid_want_open']:.3f} | "
              f"{r['one_want_more']:.3f} | {med} |")


if __name__ == "__main__":
    main()

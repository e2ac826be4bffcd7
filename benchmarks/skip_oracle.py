"""Which tokens could skip the middle of a pretrained model cheaply? (issue 15)

Learned routers on SmolLM2 have not found tokens that skip at a small KL (docs/results/pretrained-skipping-cpu.md).
This asks the question without routers: every static span [a, L-1-a] is skipped by all tokens at once
(`bench.static_skip_gates`, the engine's gated path), and each held-out response position's KL to the dense
model and greedy agreement are recorded per token. The "oracle" rows then let every token take the largest
span whose cost for *it* stays under a threshold: an estimate of what per-token skipping could save at that
cost, if the routers ranked tokens perfectly.

Caveat (why an estimate, not a bound): under the static skip every other token skips too, so a token's cost
is measured with the spans' keys gone for all positions; a per-token policy would leave the non-skipping
tokens' keys in place (eq. 3 hides only skipped keys). Cheap tokens under collective skipping should be no
dearer alone, but that is not proved here.

    python benchmarks/skip_oracle.py                         # SmolLM2-135M-Instruct, 32 held-out records
    python benchmarks/skip_oracle.py --records 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from midlayer.bench import static_skip_gates  # noqa: E402
from midlayer.drafters import kl_rows  # noqa: E402
from midlayer.model import Transformer  # noqa: E402

THRESHOLDS = (0.01, 0.05, 0.1, 0.5)


def per_token_costs(model: Transformer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """kl[a], agree[a]: 1-D tensors over the valid positions of `batches`, for the static span starting at
    routed block a (a = 0 .. L/2 - 1; span [a, L-1-a], L - 2a blocks)."""
    L = model.cfg.n_layers
    kl: dict[int, list[torch.Tensor]] = {a: [] for a in range(L // 2)}
    agree: dict[int, list[torch.Tensor]] = {a: [] for a in range(L // 2)}
    twins = {a: static_skip_gates(model, a).twin(model) for a in range(L // 2)}
    with torch.no_grad():
        for tokens, mask in batches:
            valid = mask[0]
            dense = model(tokens).logits[0, valid]
            for a, twin in twins.items():
                skip = twin(tokens).logits[0, valid]
                kl[a].append(kl_rows(dense, skip))  # KL(dense || skipped) per position
                agree[a].append(dense.argmax(-1) == skip.argmax(-1))
    return {"kl": {a: torch.cat(v) for a, v in kl.items()}, "agree": {a: torch.cat(v) for a, v in agree.items()}}


def oracle(costs: dict, n_layers: int, threshold: float) -> dict:
    """Every token takes the largest span (smallest a) whose KL for it is <= threshold and whose greedy token
    is the dense one; none if no span qualifies. Returns the mean share of the L blocks skipped, the mean KL
    paid and the share of tokens that skip anything."""
    firsts = sorted(costs["kl"])
    n = costs["kl"][firsts[0]].numel()
    skipped = torch.zeros(n)
    paid = torch.zeros(n)
    chosen = torch.zeros(n, dtype=torch.bool)
    for a in firsts:  # smallest a = largest span first; a token keeps its first qualifying span
        ok = (costs["kl"][a] <= threshold) & costs["agree"][a] & ~chosen
        skipped[ok] = n_layers - 2 * a
        paid[ok] = costs["kl"][a][ok]
        chosen |= ok
    return {"skipped_frac": float(skipped.mean()) / n_layers, "kl": float(paid.mean()),
            "tokens_skipping": float(chosen.float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="data/distill/smollm2-135m-q4-greedy.jsonl")
    ap.add_argument("--records", type=int, default=32, help="held-out records (response positions)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", default="", help="also write the table's numbers here")
    args = ap.parse_args()
    if args.records < 1 or args.seq_len < 2:
        ap.error("--records must be >= 1 and --seq-len >= 2")
    from midlayer.distill import DistillSet
    from midlayer.draft_training import response_batches
    from midlayer.kernels import cpu_info
    from midlayer.pretrained import load_pretrained

    model = load_pretrained(args.model)[0].float().eval()
    held = response_batches(DistillSet.load(args.data), args.seq_len, args.records)
    if not held:
        sys.exit(f"{args.data}: no held-out records")
    L = model.cfg.n_layers
    costs = per_token_costs(model, held)
    n = costs["kl"][0].numel()
    print(f"{cpu_info().summary()}\n{args.model} (fp32), {len(held)} held-out records, {n} response positions\n")
    print("| static span | blocks skipped | mean KL | median KL | agreement | "
          + " | ".join(f"KL <= {t:g}" for t in THRESHOLDS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(THRESHOLDS))
    rows = []
    for a in sorted(costs["kl"], reverse=True):  # smallest span first
        k, g = costs["kl"][a], costs["agree"][a]
        row = {"first": a, "blocks": L - 2 * a, "kl_mean": float(k.mean()), "kl_median": float(k.median()),
               "agree": float(g.float().mean()), "share_below": {str(t): float((k <= t).float().mean())
                                                                 for t in THRESHOLDS}}
        rows.append(row)
        print(f"| {a}-{L - 1 - a} | {row['blocks']} | {row['kl_mean']:.3f} | {row['kl_median']:.4f} | "
              f"{row['agree']:.3f} | " + " | ".join(f"{row['share_below'][str(t)]:.3f}" for t in THRESHOLDS) + " |")
    print("\nper-token oracle: each token skips its largest span with KL <= threshold and the dense greedy token\n")
    print("| threshold | blocks skipped (mean share) | tokens skipping | mean KL paid |")
    print("|---|---|---|---|")
    orc = {}
    for t in THRESHOLDS:
        o = orc[str(t)] = oracle(costs, L, t)
        print(f"| {t:g} | {o['skipped_frac']:.3f} | {o['tokens_skipping']:.3f} | {o['kl']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "records": len(held), "positions": n,
                                               "spans": rows, "oracle": orc}, indent=2) + "\n")


if __name__ == "__main__":
    main()

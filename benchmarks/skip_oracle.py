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

With `--gates DIR` (a `midlayer train-gates` output with adapters, `--lora-rank` > 0) the spans are skipped
in the *adapted* model (its low-rank adapters kept, its routers replaced by the static spans) and every cost is
still measured against the frozen dense model: does training the blocks make skipping cheaper? An extra row,
span "none", is the adapted model skipping nothing; a token that takes no span pays that row's KL.

    python benchmarks/skip_oracle.py                         # SmolLM2-135M-Instruct, 32 held-out records
    python benchmarks/skip_oracle.py --records 64 --json out.json
    python benchmarks/skip_oracle.py --gates gates/smollm2-135m/t0.5-r8-sampled-norm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from midlayer.experiments.bench import static_skip_gates  # noqa: E402
from midlayer.train.evaluate import kl_rows  # noqa: E402
from midlayer.model.transformer import Transformer  # noqa: E402
from midlayer.speculative.skip_gates import SkipGates  # noqa: E402

THRESHOLDS = (0.01, 0.05, 0.1, 0.5)


def per_token_costs(model: Transformer, batches: list[tuple[torch.Tensor, torch.Tensor]],
                    adapters: SkipGates | None = None) -> dict:
    """kl[a], agree[a]: 1-D tensors over the valid positions of `batches`, for the static span starting at
    routed block a (a = 0 .. L/2 - 1; span [a, L-1-a], L - 2a blocks), against the dense `model`. With
    `adapters` carrying low-rank adapters, the spans are skipped in the adapted model, and a = L/2 (no block
    skipped) is the adapted model itself."""
    L = model.cfg.n_layers
    firsts: list[int | None] = list(range(L // 2))
    if adapters is not None and adapters.lora_rank:
        firsts.append(None)
    twins = {L // 2 if a is None else a: static_skip_gates(model, a, adapters).twin(model) for a in firsts}
    kl: dict[int, list[torch.Tensor]] = {a: [] for a in twins}
    agree: dict[int, list[torch.Tensor]] = {a: [] for a in twins}
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
    is the dense one; none if no span qualifies (it then pays the KL of span a = L/2, the adapted model
    unskipped, where the costs have it; 0 otherwise). Returns the mean share of the L blocks skipped, the mean
    KL paid and the share of tokens that skip anything."""
    firsts = sorted(a for a in costs["kl"] if a < n_layers // 2)
    n = costs["kl"][firsts[0]].numel()
    skipped = torch.zeros(n)
    none = costs["kl"].get(n_layers // 2)
    paid = torch.zeros(n) if none is None else none.clone().float()
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
    ap.add_argument("--gates", default="", help="a train-gates output with adapters: skip in the adapted model")
    args = ap.parse_args()
    if args.records < 1 or args.seq_len < 2:
        ap.error("--records must be >= 1 and --seq-len >= 2")
    from midlayer.speculative.distill import DistillSet
    from midlayer.speculative.draft_training import response_batches
    from midlayer.ops.kernels import cpu_info
    from midlayer.engine.pretrained import load_pretrained

    model = load_pretrained(args.model)[0].float().eval()
    adapters = None
    if args.gates:
        from midlayer.speculative.registry import DraftMismatchError, load_draft

        try:
            adapters = load_draft(args.gates, model, args.model)[0]
        except DraftMismatchError as e:
            sys.exit(f"--gates: {e}")
        if not isinstance(adapters, SkipGates) or not adapters.lora_rank:
            sys.exit(f"{args.gates}: not skip gates with adapters (--lora-rank > 0); without adapters the spans "
                     "are the base model's, which the run without --gates measures")
        adapters = adapters.float().eval()
    held = response_batches(DistillSet.load(args.data), args.seq_len, args.records)
    if not held:
        sys.exit(f"{args.data}: no held-out records")
    L = model.cfg.n_layers
    costs = per_token_costs(model, held, adapters)
    n = costs["kl"][0].numel()
    what = f"{args.model} (fp32)" + (f" with the adapters of {args.gates}" if adapters is not None else "")
    print(f"{cpu_info().summary()}\n{what}, {len(held)} held-out records, {n} response positions\n")
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
        span = "none" if a == L // 2 else f"{a}-{L - 1 - a}"
        print(f"| {span} | {row['blocks']} | {row['kl_mean']:.3f} | {row['kl_median']:.4f} | "
              f"{row['agree']:.3f} | " + " | ".join(f"{row['share_below'][str(t)]:.3f}" for t in THRESHOLDS) + " |")
    print("\nper-token oracle: each token skips its largest span with KL <= threshold and the dense greedy token\n")
    print("| threshold | blocks skipped (mean share) | tokens skipping | mean KL paid |")
    print("|---|---|---|---|")
    orc = {}
    for t in THRESHOLDS:
        o = orc[str(t)] = oracle(costs, L, t)
        print(f"| {t:g} | {o['skipped_frac']:.3f} | {o['tokens_skipping']:.3f} | {o['kl']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "gates": args.gates or None,
                                               "records": len(held), "positions": n,
                                               "spans": rows, "oracle": orc}, indent=2) + "\n")


if __name__ == "__main__":
    main()

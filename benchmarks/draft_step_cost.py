"""What one `train-draft` step costs per drafter, with and without a draft vocabulary (issue 11).

    python benchmarks/draft_step_cost.py --data data/distill/smollm2-135m-q4-greedy.jsonl
    python benchmarks/draft_step_cost.py --data ... --vocab 0,8192,16384 --batch-tokens 4096 --repeats 2

On the first batch of the distillation file (the batches of `train-draft`, same seed): the shared frozen
states (`FrozenStates`: one base forward with the residuals every method needs), then for each method the
teacher logits from those states, the loss forward and the backward -- what a lockstep step
(`train-draft --methods`) pays per drafter after the base forward. Each configuration is timed `--repeats`
times in rounds (vocabularies interleaved) and the median is printed. Run it on an idle machine: the
numbers are seconds of wall time on the cores torch uses.
Written up in docs/results/hidden-transfer-cpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a midlayer.speculative.distill file made with --model")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--vocab", default="0,16384", help="draft vocabulary sizes to compare (0 = full)")
    ap.add_argument("--methods", default="eagle,medusa,early-exit,hidden-transfer")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--joint-ht", action="store_true",
                    help="hidden transfer's reference training pass (every row with autograd) instead of the split one")
    ap.add_argument("--loss-positions", choices=("response", "all"), default="response",
                    help="the positions the loss counts (train-draft's setting of the same name)")
    args = ap.parse_args()

    from midlayer.speculative.distill import DistillSet, batches
    from midlayer.speculative.draft_training import (DraftTrainConfig, FrozenStates, _loss, build_module, loss_inputs,
                                         needed_layers)
    from midlayer.engine.draft_vocab import frequent_tokens, set_draft_vocab
    from midlayer.speculative.drafting import FrozenBase
    from midlayer.ops.kernels import cpu_info
    from midlayer.engine.pretrained import load_pretrained

    if args.joint_ht:  # the reference pass: all rows through autograd (hidden_transfer._TransferRows)
        import functools

        import midlayer.speculative.hidden_transfer as ht_mod

        ht_mod.transfer_forward = functools.partial(ht_mod.transfer_forward, split=False)

    model = load_pretrained(args.model)[0].eval()
    ds = DistillSet.load(args.data)
    lens = ds.prompt_lens("train") if args.loss_positions == "response" else None
    tokens, mask = batches(ds.sequences("train"), args.batch_tokens, args.seq_len, 0, pad_id=ds.pad_id,
                           prompt_lens=lens)[0]
    sizes = [int(v) for v in args.vocab.split(",")]
    methods = args.methods.split(",")
    times: dict[tuple[int, str, str], list[float]] = {}
    with FrozenBase(model):
        for _ in range(args.repeats):
            for n in sizes:
                mods = {}
                for m in methods:
                    cfg = DraftTrainConfig(method=m, model=args.model, data=args.data, out_dir="unused")
                    torch.manual_seed(0)
                    mod = build_module(cfg, model)
                    if n:
                        set_draft_vocab(mod, frequent_tokens((r.response_ids for r in ds.split("train")), n,
                                                             model.cfg.vocab_size))
                    mods[m] = (cfg, mod)
                layers = set().union(*(needed_layers(c, model, mo) for c, mo in mods.values()))
                t0 = time.perf_counter()
                states = FrozenStates(model, layers, 0.0).states(0, tokens)
                times.setdefault((n, "(base forward)", "states"), []).append(time.perf_counter() - t0)
                memo: dict = {}
                for m, (cfg, mod) in mods.items():
                    t0 = time.perf_counter()
                    cached = loss_inputs(cfg, model, mod, states, memo)
                    t1 = time.perf_counter()
                    with torch.enable_grad():
                        loss, _ = _loss(cfg, model, mod, tokens, mask, 0, cached, 0)
                        t2 = time.perf_counter()
                        loss.backward()
                    t3 = time.perf_counter()
                    for part, dt in (("teacher", t1 - t0), ("forward", t2 - t1), ("backward", t3 - t2)):
                        times.setdefault((n, m, part), []).append(dt)
    info = cpu_info()
    feats = ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in info.flags)
    print(f"CPU: {info.model} ({feats}; torch {info.torch_capability}); torch threads {torch.get_num_threads()}; batch {tuple(tokens.shape)}, "
          f"{int(mask.sum())} counted positions ({args.loss_positions}); median of {args.repeats}")
    print("| draft vocab | method | teacher s | loss forward s | backward s | step s (after the base forward) |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        base = statistics.median(times[(n, "(base forward)", "states")])
        print(f"| {n or 'full'} | (shared base forward) | | | | {base:.2f} |")
        for m in methods:
            t = [statistics.median(times[(n, m, p)]) for p in ("teacher", "forward", "backward")]
            print(f"| {n or 'full'} | {m} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} | {sum(t):.2f} |")


if __name__ == "__main__":
    main()

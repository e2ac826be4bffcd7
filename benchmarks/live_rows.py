"""Hidden transfer's fused rounds through the static step, each block on the rows present there against every
row at every block (issue 42). The paper's pseudo states of step i enter at block t_i (arXiv 2404.12022
sec. 3.4), so below it a round needs only its tree rows: `decode_step.live_rows`, for SmolLM2's transfer
(t = 14, 19, 19 of 30) and a 24-node tree 32 rows at blocks 0-13, 64 at 14-18 and 128 at 19-29, where the step
ran 128 at every block before. Times both on the same held-out prompts, alternating prompt by prompt (the
reference: `live_rows` replaced by every row at every block), and checks that both give plain greedy decoding's
tokens. Prints a table per tree size: ms/token of each, their ratio, plain decoding's time over each, tau and
the outputs equal to plain.

    python benchmarks/live_rows.py [--dtype fp32] [--nodes 24,12] [--new-tokens 64] [--max-prompts 4]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch

from midlayer.common import device_sync
from midlayer.engine import decode_step
from midlayer.engine.decode_step import DecodeStep, any_round_slots, static_stream
from midlayer.engine.generate import GenerationConfig
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import fuse_projections
from midlayer.experiments.bench import heldout_chats
from midlayer.experiments.static_bench import _decode_timed, _prefill_s, DTYPES, machine_lines, static_methods
from midlayer.speculative.registry import DraftMismatchError
from midlayer.speculative.static import fused_steps, static_speculative_generate


def every_row(first: int, per_step: int, n_rows: int, join_at: dict, n_layers: int, buckets) -> tuple[int, ...]:
    """The schedule before `live_rows`: every row of the round at every block."""
    return (n_rows,) * (n_layers + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="drafts/smollm2-135m-scale/hidden-transfer")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--graphs", default="eager", choices=decode_step.GRAPH_MODES)
    ap.add_argument("--nodes", default="24,12", help="comma-separated tree sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompts", type=int, default=4)
    a = ap.parse_args()
    try:
        sizes = [int(n) for n in a.nodes.split(",")]
    except ValueError:
        ap.error(f"--nodes: comma-separated tree sizes, got {a.nodes!r}")
    if min(sizes) < 1 or a.new_tokens < 2 or a.max_prompts < 1:
        ap.error(f"tree sizes >= 1, --new-tokens >= 2, --max-prompts >= 1; got {a.nodes}, {a.new_tokens}, "
                 f"{a.max_prompts}")
    base, tok = load_pretrained(a.model)
    model = fuse_projections(base.to(a.device, DTYPES[a.dtype]).eval())
    prompts = heldout_chats(tok, a.max_prompts)
    try:
        methods = {n: static_methods(model, {"ht": a.draft}, n)["ht"] for n in sizes}
    except DraftMismatchError as e:
        ap.error(f"--draft: {e}")
    room = max(any_round_slots(len(t), fused_steps(d)) for d, t in methods.values())
    max_len = max(map(len, prompts)) + a.new_tokens + room
    step = DecodeStep(model, max_len=max_len, graphs=a.graphs)
    print("\n".join(machine_lines(step.device)))
    print(f"{a.model} {a.dtype}, {a.graphs} step: buckets {step.buckets}, attention {step.attention}, linears "
          f"{step.linear}; {len(prompts)} held-out prompts ({min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens), {a.new_tokens} new tokens each")
    cfg = GenerationConfig(max_new_tokens=a.new_tokens)
    plain, plain_s = [], 0.0  # (plain decoding through the same step: its tokens, and its ms/token for scale)
    for p in prompts:
        out, s = _decode_timed(static_stream(model, p, cfg, step=step))
        plain.append(out)
        plain_s += s / len(prompts)
    print(f"plain decoding through the step: {1e3 * plain_s:.2f} ms/token (the mean over prompts)")
    kinds = {"rows present": contextlib.nullcontext, "every row": lambda: mock.patch.object(
        decode_step, "live_rows", every_row)}
    # a step each (the probe's choice is the model's, the same): a captured round is kept per step, so each
    # schedule replays its own graphs under graphs="cudagraph"
    steps = {"rows present": step, "every row": DecodeStep(model, max_len=max_len, graphs=a.graphs)}
    for n, (drafter, tree) in methods.items():
        for name, kind in kinds.items():  # (warm-up: each kind's first round; in CUDA graphs, their capture)
            with kind():
                static_speculative_generate(model, prompts[0], drafter, tree, 4, step=steps[name])
        secs = dict.fromkeys(kinds, 0.0)
        toks = dict.fromkeys(kinds, 0)
        rounds = dict.fromkeys(kinds, 0)
        same = dict.fromkeys(kinds, 0)
        for i, p in enumerate(prompts):
            order = list(kinds) if i % 2 == 0 else list(kinds)[::-1]  # (alternating which goes first)
            for name in order:
                st = steps[name]
                with kinds[name]():
                    pre = _prefill_s(st, p[:-1]) if len(p) > 1 else 0.0  # (subtracted: the same for both)
                    device_sync(st.device)
                    t = time.perf_counter()
                    out, stats = static_speculative_generate(model, p, drafter, tree, a.new_tokens, step=st)
                    device_sync(st.device)
                    secs[name] += time.perf_counter() - t - pre
                toks[name] += len(out)
                rounds[name] += stats.base_forwards
                same[name] += out == plain[i]
        print(f"\nhidden transfer, fused, {len(tree)}-node tree (device rounds; decode only)")
        print("| rows per block | ms/token | vs every row | speedup over plain | tau | = plain |")
        print("|---|---|---|---|---|---|")
        ref = secs["every row"] / toks["every row"]
        for name in kinds:
            ms = secs[name] / toks[name]
            print(f"| {name} | {1e3 * ms:.2f} | {ms / ref:.2f}x | {plain_s / ms:.2f}x | "
                  f"{toks[name] / rounds[name]:.2f} | "
                  f"{same[name]}/{len(prompts)} |")


if __name__ == "__main__":
    main()

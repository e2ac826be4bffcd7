"""Hidden transfer's anchors on the CPU's default engine: the dynamic engine's fused pass with pseudo rows for
every tree row against pseudo rows for the root and the m - 1 rows where a round most likely ends
(`HiddenTransferDrafter.anchors`, `DraftTree.likeliest_ends`; a round that ends elsewhere drafts from its
deepest anchor's later steps, `decode_step.anchor_shifts`). Every variant runs on the same held-out prompts, in
an order that rotates prompt by prompt, beside plain decoding (`generate`); a prompt's prefill, timed once per
prompt, is subtracted. Prints a table per tree size: ms/token, the speed-up over plain decoding, tau, the rows a
round runs at the last block, and the outputs equal to plain decoding's. (The static step's rows are `midlayer
bench static --anchors`.)

    python benchmarks/anchors.py [--weights fp32] [--nodes 24,12] [--anchors 2,4] [--new-tokens 64] [--max-prompts 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from midlayer.engine.generate import forward_cached, generate, GenerationConfig
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights, WEIGHT_FORMATS
from midlayer.experiments.bench import heldout_chats
from midlayer.experiments.static_bench import machine_lines, static_methods
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.speculative.registry import DraftMismatchError
from midlayer.speculative.verify import speculative_generate


def counts(ap: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A comma-separated list of positive counts, or the parser's error naming the flag."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        ap.error(f"{flag}: comma-separated counts >= 1, got {text!r}")
    return out


def timed(fn) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="drafts/smollm2-135m-scale/hidden-transfer")
    ap.add_argument("--weights", default="fp32", choices=WEIGHT_FORMATS, help="the base's weight format")
    ap.add_argument("--nodes", default="24,12", help="comma-separated tree sizes")
    ap.add_argument("--anchors", default="2,4", help="comma-separated anchor counts (beside every row's)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompts", type=int, default=4)
    a = ap.parse_args()
    sizes, anchors = counts(ap, "--nodes", a.nodes), counts(ap, "--anchors", a.anchors)
    if a.new_tokens < 2 or a.max_prompts < 1:
        ap.error(f"--new-tokens >= 2, --max-prompts >= 1; got {a.new_tokens}, {a.max_prompts}")
    base, tok = load_pretrained(a.model)
    model = compress_weights(base.float(), a.weights).eval()  # (as `generate --weights` runs it)
    prompts = heldout_chats(tok, a.max_prompts)
    try:
        methods = {n: static_methods(model, {"ht": a.draft}, n)["ht"] for n in sizes}
    except DraftMismatchError as e:
        ap.error(f"--draft: {e}")
    print("\n".join(machine_lines(torch.device("cpu"))))
    print(f"{a.model} {a.weights}, the dynamic engine; {len(prompts)} held-out prompts ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens), {a.new_tokens} new tokens each, decode only")
    cfg = GenerationConfig(max_new_tokens=a.new_tokens)
    pre = []  # each prompt's prefill (the same forward every row's call starts with)
    for p in prompts:
        cache = KVCache.for_model(model.cfg, 1, len(p) + 8, dtype=kv_dtype(model))
        pre.append(timed(lambda: forward_cached(model, torch.tensor([p[:-1]]), cache,
                                                torch.arange(len(p) - 1)[None]))[1])
    for n, (drafter, tree) in methods.items():
        kinds = ["plain"] + [m for m in [0, *anchors] if m <= len(tree)]
        secs, toks, rounds, same = ({k: 0 for k in kinds} for _ in range(4))
        for i, p in enumerate(prompts):
            order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]  # (rotating which goes first)
            outs = {}
            for k in order:
                if k == "plain":
                    out, s = timed(lambda: generate(model, [p], cfg)[0])
                    r = len(out)
                else:
                    drafter.anchors = k
                    (out, stats), s = timed(lambda: speculative_generate(model, p, drafter, tree, a.new_tokens))
                    r = stats.base_forwards
                secs[k] += s - pre[i]
                toks[k] += len(out)
                rounds[k] += r
                outs[k] = out
            for k in kinds[1:]:
                same[k] += outs[k] == outs["plain"]
        print(f"\nhidden transfer, fused, {len(tree)}-node tree")
        print("| anchors | rows at the last block | ms/token | speed-up over plain | tau | = plain |")
        print("|---|---|---|---|---|---|")
        ms = {k: 1e3 * secs[k] / toks[k] for k in kinds}
        print(f"| plain decoding | 1 | {ms['plain']:.2f} | 1.00x | 1.00 | - |")
        for k in kinds[1:]:
            drafter.anchors = k
            rows = drafter.verify_forward(tree, model.cfg.n_layers)[0][-1]
            print(f"| {k or 'every row'} | {rows} | {ms[k]:.2f} | {ms['plain'] / ms[k]:.2f}x | "
                  f"{toks[k] / rounds[k]:.2f} | {same[k]}/{len(prompts)} |")


if __name__ == "__main__":
    main()

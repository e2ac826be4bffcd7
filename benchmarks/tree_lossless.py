"""Is speculative decoding with *branching* trees lossless on the real model? (issue 11)

Greedy speculative decoding is lossless exactly when the verification forward gives each tree node the
logits a plain decode step gives the same token. A chain's rows see contiguous keys; a branching tree's
node sees its ancestors with its siblings' rows masked in between. The q4 attention kernel once summed by
cache slot, so those nodes rounded differently and near-ties flipped (docs/results/hidden-transfer-cpu.md,
25th session). This decodes held-out prompts with one draft on a static branching tree and on EAGLE-2
dynamic trees, and counts the prompts whose output equals plain greedy decoding, per weight format.

    python benchmarks/tree_lossless.py                        # q4 and fp32, the at-scale EAGLE draft
    python benchmarks/tree_lossless.py --weights q4 --draft drafts/smollm2-135m-scale/hidden-transfer
"""

from __future__ import annotations

import argparse

import torch

from midlayer.speculative.registry import load_drafter
from midlayer.speculative.eagle import EagleDrafter
from midlayer.engine.generate import GenerationConfig, generate
from midlayer.engine.pretrained import load_pretrained
from midlayer.data.prompt_recipe import load as load_prompts
from midlayer.engine.quantization import compress_weights
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="drafts/smollm2-135m-scale/eagle")
    ap.add_argument("--weights", default="q4,fp32", help="comma-separated weight formats")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts: the first 5N, every fifth")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.prompts < 1 or args.new_tokens < 1:
        ap.error(f"--prompts and --new-tokens must be >= 1, got {args.prompts} and {args.new_tokens}")
    torch.manual_seed(0)
    held = [p for p in load_prompts() if p.split == "heldout"][:5 * args.prompts:5]
    print("| weights | drafter | tree | output = plain greedy | first differing token (prompt: index) |")
    print("|---|---|---|---|---|")
    for weights in args.weights.split(","):
        model, tok = load_pretrained("smollm2-135m")
        model = compress_weights(model, weights).eval()
        stop = tuple(sorted(tok.eos_ids))
        drafter, module, _ = load_drafter(args.draft, model)
        runs = [("static", drafter, DraftTree([(0,), (1,), (0, 0)])), ("chain", drafter, DraftTree.chain(3))]
        if isinstance(drafter, EagleDrafter):
            runs += [(f"dynamic, {k} children", EagleDrafter(model, module, dynamic_k=k), DraftTree.chain(3))
                     for k in (1, 2, 4)]
        cfg = GenerationConfig(max_new_tokens=args.new_tokens, stop_tokens=stop)
        encoded = [tok.encode_chat([{"role": "user", "content": p.text}]) for p in held]
        plain = [generate(model, [ids], cfg)[0] for ids in encoded]
        for name, d, tree in runs:
            equal, first = 0, []
            for i, (ids, ref) in enumerate(zip(encoded, plain)):
                out, _ = speculative_generate(model, ids, d, tree, args.new_tokens, stop_tokens=stop)
                equal += out == ref
                if out != ref:
                    j = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
                    first.append(f"{i}: {j}")
            print(f"| {weights} | {type(d).__name__} | {name} | {equal}/{len(held)} | {', '.join(first) or '-'} |",
                  flush=True)


if __name__ == "__main__":
    main()

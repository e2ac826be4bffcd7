"""Where a speculative round's time goes, against a plain decode step (issue 11).

A round is: the drafter's `propose` (for EAGLE: its draft-layer calls and its draft-head logits, the rest
being Python), the base's verification forward with its acceptance (`speculative.verify_tree`), and the
loop's own bookkeeping. Plain decoding of the same prompts is timed in the same run, prompt by prompt, so
the two sides see the same machine state. The last line is what that round cost allows: the speedup if
drafting were free, tau x plain ms per token / (verification + bookkeeping) ms per round.

    python benchmarks/round_breakdown.py                                   # EAGLE-2 dynamic, q4, chain of 3
    python benchmarks/round_breakdown.py --draft drafts/smollm2-135m-scale/hidden-transfer --dynamic 0
Written up in docs/results/hidden-transfer-cpu.md.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

import midlayer.speculative.eagle as eagle
import midlayer.speculative.verify as speculative
from midlayer.speculative.registry import load_drafter
from midlayer.engine.generate import GenerationConfig, generate
from midlayer.engine.pretrained import load_pretrained
from midlayer.data.prompt_recipe import load as load_prompts
from midlayer.engine.quantization import compress_weights
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate


def timed(clock: dict[str, float], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """f, adding its wall time to clock[name] on every call."""
    def g(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            clock[name] += time.perf_counter() - t
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="drafts/smollm2-135m-scale/eagle")
    ap.add_argument("--weights", default="q4")
    ap.add_argument("--dynamic", type=int, default=4, help="EAGLE-2 children per node (0: the static chain)")
    ap.add_argument("--depth", type=int, default=3, help="chain depth (the node budget of a dynamic tree)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts: the first 5N, every fifth")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if min(args.prompts, args.new_tokens, args.depth) < 1 or args.dynamic < 0:
        ap.error("--prompts, --new-tokens and --depth must be >= 1, --dynamic >= 0")
    model, tok = load_pretrained("smollm2-135m")
    model = compress_weights(model, args.weights).eval()
    stop = tuple(sorted(tok.eos_ids))
    kw = {"dynamic_k": args.dynamic} if args.dynamic else {}
    drafter, module, _ = load_drafter(args.draft, model, **kw)
    tree = DraftTree.chain(args.depth)
    held = [p for p in load_prompts() if p.split == "heldout"][:5 * args.prompts:5]
    encoded = [tok.encode_chat([{"role": "user", "content": p.text}]) for p in held]
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, stop_tokens=stop)

    clock = {k: 0.0 for k in ("round", "propose", "draft layer", "draft head", "verify", "plain")}
    drafter.propose = timed(clock, "propose", drafter.propose)
    saved = speculative.verify_tree, eagle.EagleDrafter._run, eagle.feature_logits
    speculative.verify_tree = timed(clock, "verify", saved[0])
    eagle.EagleDrafter._run = timed(clock, "draft layer", saved[1])
    eagle.feature_logits = timed(clock, "draft head", saved[2])
    rounds = tokens = plain_tokens = 0
    try:
        with torch.inference_mode():
            speculative_generate(model, encoded[0][:8], drafter, tree, 4, stop)  # warm-up
            generate(model, [encoded[0][:8]], GenerationConfig(max_new_tokens=4))
            for k in clock:
                clock[k] = 0.0
            for ids in encoded:
                t = time.perf_counter()
                ref = generate(model, [ids], cfg)[0]
                clock["plain"] += time.perf_counter() - t
                plain_tokens += len(ref)
                t = time.perf_counter()
                out, st = speculative_generate(model, ids, drafter, tree, args.new_tokens, stop)
                clock["round"] += time.perf_counter() - t
                if out != ref:
                    raise SystemExit(f"not lossless on a prompt of {len(ids)} tokens")
                rounds, tokens = rounds + st.base_forwards, tokens + len(out)
    finally:
        speculative.verify_tree, eagle.EagleDrafter._run, eagle.feature_logits = saved
    ms = {k: 1e3 * v / rounds for k, v in clock.items() if k != "plain"}
    plain_ms = 1e3 * clock["plain"] / plain_tokens
    tau = tokens / rounds
    print(f"{args.draft} ({type(drafter).__name__}{', dynamic ' + str(args.dynamic) if args.dynamic else ''}), "
          f"{args.weights}, chain budget {args.depth}, {len(encoded)} prompts x {args.new_tokens} tokens, "
          f"{torch.get_num_threads()} threads; prefill included on both sides")
    print("| per round | ms |\n|---|---|")
    for k in ("round", "propose", "draft layer", "draft head", "verify"):
        print(f"| {k} | {ms[k]:.2f} |")
    rest = ms["round"] - ms["propose"] - ms["verify"]
    print(f"| bookkeeping (round - propose - verify) | {rest:.2f} |")
    print(f"\ntau {tau:.2f}; plain {plain_ms:.2f} ms/token; speculative {ms['round'] / tau:.2f} ms/token "
          f"({plain_ms * tau / ms['round']:.2f}x); with free drafting {plain_ms * tau / (ms['verify'] + rest):.2f}x")


if __name__ == "__main__":
    main()

"""Which EAGLE-2 tree a GPU run should try (issue 42): tau and the kernels of one device round for several tree
shapes (k expanded a depth, the depth, the nodes), on this machine. Where a captured round is bound by its
kernels, a drafter gains about tau / (its round's kernels / the plain step's), the projection printed last
(docs/results/static-step.md).

tau comes from EAGLE-2's device rounds on the static step (SmolLM2 fused, fp32, the PyTorch path), held-out
chat prompts x new tokens; the kernels from `step_kernels.round_kernels` through the Triton kernels' launches
(their PyTorch formulas standing in, so no interpreter). A deeper tree runs the draft layer once more a depth.

    python benchmarks/eagle_tree_shape.py [--shapes 4x3x24,8x4x24,...] [--prompts 4] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (step_kernels, beside this file)

import step_kernels  # noqa: E402  (sets MIDLAYER_NO_KERNELS and TRITON_INTERPRET first)
import torch  # noqa: E402

from midlayer.engine.decode_step import DecodeStep  # noqa: E402
from midlayer.engine.pretrained import load_pretrained  # noqa: E402
from midlayer.engine.quantization import fuse_projections  # noqa: E402
from midlayer.experiments.bench import heldout_chats  # noqa: E402
from midlayer.experiments.static_bench import static_methods  # noqa: E402
from midlayer.speculative.static import static_speculative_generate  # noqa: E402


def shapes(text: str) -> list[tuple[int, int, int]]:
    """'KxDxN,...' -> [(k, depth, nodes), ...]."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            k, d, n = (int(x) for x in part.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shapes: KxDEPTHxNODES each, got {part!r}") from None
        if not (1 <= k <= 16 and 1 <= d <= 8 and 1 <= n <= 63):
            raise argparse.ArgumentTypeError(f"--shapes {part}: k 1..16, depth 1..8, nodes 1..63")
        out.append((k, d, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="drafts/smollm2-135m-scale/eagle")
    ap.add_argument("--shapes", type=shapes, default=shapes("4x3x24,8x3x24,8x4x24,8x4x32,8x5x32,8x5x48"))
    ap.add_argument("--prompts", type=int, default=4, help="held-out chat prompts, spread over the categories")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if not os.path.isdir(args.draft):
        ap.error(f"--draft {args.draft}: not a train-draft output")
    if args.prompts < 1 or args.new_tokens < 2:
        ap.error(f"--prompts at least 1 and --new-tokens at least 2, got {args.prompts} and {args.new_tokens}")
    base, tok = load_pretrained("smollm2-135m")
    model = fuse_projections(copy.deepcopy(base).eval())
    chats = heldout_chats(tok, args.prompts)
    with step_kernels.standing_in():
        plain = sum(step_kernels.step_kernels(model, "triton")[0].values())
    print(f"SmolLM2 fp32, {len(chats)} held-out prompts x {args.new_tokens} new tokens; the plain step: {plain} "
          "kernels\n")
    print("| k | depth | nodes | tau | round kernels | x plain | tau / x plain |\n|---|---|---|---|---|---|---|")
    for k, depth, nodes in args.shapes:
        drafter, tree = static_methods(model, {"eagle": args.draft}, nodes, k, depth)["eagle"]  # (as bench static)
        step = DecodeStep(model, max_len=max(len(c) for c in chats) + args.new_tokens + 256)
        made = forwards = 0
        t = time.time()
        with torch.no_grad():
            for ids in chats:
                out, stats = static_speculative_generate(model, ids, drafter, tree, args.new_tokens, step=step)
                made, forwards = made + len(out), forwards + stats.base_forwards
        with step_kernels.standing_in():
            kernels = step_kernels.round_kernels(model, drafter, tree, "triton")[0]
        tau, x = made / forwards, kernels / plain
        print(f"| {k} | {depth} | {len(tree)} | {tau:.2f} | {kernels} | {x:.2f} | {tau / x:.2f} |  "
              f"({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

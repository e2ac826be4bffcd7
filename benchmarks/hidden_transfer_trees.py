"""Would a dynamic tree pay for hidden transfer? An offline estimate on logged rounds (66th session).

Hidden transfer's tree is static: node (r_1..r_d) takes the rank-r_d token of step d's pseudo-row distribution,
and the tree is the n rank paths of highest expected acceptance under the draft's held-out accuracies
(`DraftTree.greedy_from_accuracies`, what `--tree auto` and `bench static` use). EAGLE-2's dynamic tree (Li et
al. 2024, arXiv 2406.16858, sec. 4) instead takes, every round, the n paths of highest *draft* confidence, the
product of the draft's probabilities along the path. Hidden transfer's k steps are drafted independently (each
pseudo row predicts one position from the anchor's residual), so a path's confidence is p_1(t_1) ... p_d(t_d)
and the round's best n paths are a top-n over rank tuples, prefix-closed since no factor exceeds 1.

This script runs the dynamic engine's fused pass (every tree row an anchor) on held-out prompts, logs each
round's step distributions (their top `K` tokens and probabilities) and, after the generation (which equals
plain greedy decoding), the tokens that the round's depths had to match. On the same rounds it then counts the
tokens a round would commit (1 + the accepted depth) with (a) the static tree of n nodes and (b) the per-round
top-n tree, for several n. The rounds are those the logging run visited (its own 24-node tree); a round's
acceptance depends only on its distributions and the text, so both trees are scored on the same sample. A
second table repeats (b) with each probability replaced by its held-out frequency (fit on the even rounds,
scored on the odd ones): whether calibrating the confidences helps.

    python benchmarks/hidden_transfer_trees.py [--weights q4] [--max-prompts 60] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
import time

import torch

from midlayer.engine.draft_vocab import draft_vocab, restrict_logits, to_token_ids
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights, WEIGHT_FORMATS
from midlayer.experiments.bench import heldout_chats
from midlayer.experiments.static_bench import machine_lines, static_methods
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate

K = 8  # candidates kept per step: a 48-node top-n tree uses ranks below 8


def log_rounds(model, drafter, tree, prompts, new_tokens: int) -> list[tuple[list[int], list[list[float]]]]:
    """(ranks, probs) per round: ranks[d] the rank of the token depth d + 1 had to match among step d + 1's top
    K (K: not among them), probs[d] step d + 1's top-K probabilities (softmax over the draft vocabulary)."""
    logged: list[tuple[int, list[list[int]], list[list[float]]]] = []
    propose = type(drafter).propose
    vocab = draft_vocab(drafter.transfer)

    def logging(self, ctx):
        out = propose(self, ctx)
        if self.last_logits is not None:
            lg = self.last_logits.float()
            if vocab is not None and lg.shape[-1] != vocab.numel():
                lg = restrict_logits(lg, vocab)
            p, ix = torch.softmax(lg, -1).topk(K, -1)
            logged.append((len(ctx.tokens), to_token_ids(ix, vocab).tolist(), p.tolist()))
        return out

    rounds = []
    type(drafter).propose = logging
    try:
        for i, prompt in enumerate(prompts):
            logged.clear()
            t = time.perf_counter()
            out, _ = speculative_generate(model, prompt, drafter, tree, new_tokens)
            text = list(prompt) + list(out)
            for at, toks, probs in logged:  # tokens[at - 1] is the round's root: depth d + 1 matches text[at + d]
                truth = text[at:at + len(toks)]
                if len(truth) == len(toks):
                    rounds.append(([c.index(x) if x in c else K for c, x in zip(toks, truth)], probs))
            print(f"prompt {i + 1}/{len(prompts)}: {len(prompt)} tokens, {len(logged)} rounds, "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
    finally:
        type(drafter).propose = propose
    return rounds


def accepted(ranks: list[int], paths: set) -> int:
    """The depth a round accepts with the tree `paths` (rank tuples): the longest prefix of the ranks in it."""
    a = 0
    while a < len(ranks) and tuple(ranks[:a + 1]) in paths:
        a += 1
    return a


def top_paths(score, depth: int, n: int) -> set:
    """The n rank paths (depth at most `depth`, ranks below K) of highest score(path), a score that never grows
    along a path (so the set is prefix-closed): best-first from the depth-1 ranks."""
    heap = [(-score((r,)), (r,)) for r in range(K)]
    heapq.heapify(heap)
    out: set = set()
    while heap and len(out) < n:
        _, path = heapq.heappop(heap)
        out.add(path)
        if len(path) < depth:
            for r in range(K):
                heapq.heappush(heap, (-score(path + (r,)), path + (r,)))
    return out


def confidence(probs: list[list[float]]):
    return lambda path: math.prod(probs[d][r] for d, r in enumerate(path))


def calibrated(fit: dict, probs: list[list[float]]):
    """confidence with each factor replaced by the held-out frequency of its (depth, rank, probability bin)."""
    def score(path):
        v = 1.0
        for d, r in enumerate(path):
            seen, hit = fit.get((d, r, min(int(probs[d][r] * 20), 19)), (0, 0))
            v *= (hit + 1) / (seen + 2) if seen else probs[d][r]
        return v
    return score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="drafts/smollm2-135m-scale/hidden-transfer")
    ap.add_argument("--weights", default="q4", choices=WEIGHT_FORMATS, help="the base's weight format")
    ap.add_argument("--nodes", default="4,12,24,48", help="comma-separated tree sizes to score")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-prompts", type=int, default=60)
    a = ap.parse_args()
    try:
        sizes = [int(x) for x in a.nodes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or a.new_tokens < 2 or a.max_prompts < 1:
        ap.error("--nodes: comma-separated counts >= 1; --new-tokens >= 2; --max-prompts >= 1")
    base, tok = load_pretrained(a.model)
    model = compress_weights(base.float(), a.weights).eval()
    drafter, tree = static_methods(model, {"ht": a.draft}, 24)["ht"]
    acc = drafter.acc
    if not acc:
        ap.error("--draft: the draft has no held-out accuracies (its static tree needs them)")
    prompts = heldout_chats(tok, a.max_prompts)
    print("\n".join(machine_lines(torch.device("cpu"))))
    print(f"{a.model} {a.weights}, hidden transfer (fused, every row an anchor, k = {drafter.transfer.k}); logged "
          f"with its {len(tree)}-node static tree on {len(prompts)} held-out prompts, {a.new_tokens} new tokens each")
    rounds = log_rounds(model, drafter, tree, prompts, a.new_tokens)
    D = drafter.transfer.k
    print(f"\n{len(rounds)} rounds; tokens a round commits (1 + accepted depth), the same rounds for every row\n")
    print("| nodes | static tree (held-out accuracies) | per-round top-n by the draft's confidence | ratio |")
    print("|---|---|---|---|")
    for n in sizes:
        static = {p for p in DraftTree.greedy_from_accuracies(acc, n).paths}
        s = sum(1 + accepted(r, static) for r, _ in rounds) / len(rounds)
        d = sum(1 + accepted(r, top_paths(confidence(p), min(D, len(p)), n)) for r, p in rounds) / len(rounds)
        print(f"| {n} | {s:.3f} | {d:.3f} | {d / s:.3f} |")
    fit: dict = collections.defaultdict(lambda: [0, 0])
    for r, p in rounds[0::2]:
        for d, row in enumerate(p):
            for k, q in enumerate(row):
                cell = fit[(d, k, min(int(q * 20), 19))]
                cell[0] += 1
                cell[1] += r[d] == k
    odd = rounds[1::2]
    print(f"\nthe odd rounds ({len(odd)}), confidences calibrated on the even ones\n")
    print("| nodes | static tree | draft's confidence | calibrated confidence |")
    print("|---|---|---|---|")
    for n in sizes:
        static = {p for p in DraftTree.greedy_from_accuracies(acc, n).paths}
        row = [sum(1 + accepted(r, static) for r, _ in odd)]
        for score in (confidence, lambda p: calibrated(fit, p)):
            row.append(sum(1 + accepted(r, top_paths(score(p), min(D, len(p)), n)) for r, p in odd))
        print(f"| {n} | " + " | ".join(f"{v / len(odd):.3f}" for v in row) + " |")


if __name__ == "__main__":
    main()

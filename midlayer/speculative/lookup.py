"""Prompt lookup: a drafter that needs no training (issue 45, item 3).

The draft is copied from the text itself: find where the last n tokens (the pending one included) occurred
before in the prompt or the output so far, and propose the tokens that followed that occurrence (Saxena 2023,
"prompt lookup decoding"; transformers' `prompt_lookup_num_tokens`, vLLM's n-gram and llama.cpp's lookup
drafting do the same). It pays where the answer repeats its context: summaries, retrieval-augmented answers,
code edits. n runs from `max_ngram` down to `min_ngram`; the most recent occurrence ranks first.

Branching trees: rank r at a node is the r-th distinct next token among the occurrences whose continuation
agrees with the node's path so far, most recent first; a node with no such occurrence gets a placeholder that
verification rejects. Losslessness does not depend on the drafter (verification accepts only what the base
model would have produced), so output equals plain greedy decoding token for token (tested).

Cost: drafting runs no forward (`draft_forwards` is empty), so a round costs its verification forward and the
lookup's Python. `--tree auto` prices trees with per-rank accuracies that `self_accuracies` measures on the
prompt itself: at each prompt position the lookup's proposal is compared with the tokens that follow it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .protocol import Draft, DraftContext, Drafter, Forward
from .tree import DraftTree


def continuations(tokens: Sequence[int], depth: int, max_ngram: int = 3, min_ngram: int = 1,
                  limit: int = 8) -> list[list[int]]:
    """Up to `limit` continuations (each up to `depth` tokens) of earlier occurrences of the suffix of
    `tokens`: longest n-gram first (n = max_ngram .. min_ngram), most recent occurrence first within an n;
    an occurrence already found with a longer n-gram is not repeated."""
    out: list[list[int]] = []
    seen: set[int] = set()
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tok - n:])
        for j in range(n_tok - n - 1, -1, -1):  # occurrences ending before the suffix starts (most recent first)
            if j + n in seen or list(tokens[j:j + n]) != suffix:
                continue
            seen.add(j + n)
            out.append(list(tokens[j + n:j + n + depth]))
            if len(out) >= limit:
                return out
    return out


def fill_tree(tree: DraftTree, conts: Sequence[Sequence[int]], placeholder: int) -> list[int]:
    """One token per node of `tree` (breadth-first): rank r under a node is the r-th distinct next token of the
    continuations that agree with the node's path (in their order), else `placeholder`."""
    tokens: list[int] = []
    by_path: dict[tuple[int, ...], tuple[int, list[Sequence[int]]]] = {(): (-1, list(conts))}
    for path in tree.paths:
        _, alive = by_path.get(path[:-1], (placeholder, []))
        d = len(path) - 1
        distinct: list[int] = []
        for c in alive:
            if len(c) > d and c[d] not in distinct:
                distinct.append(c[d])
        r = path[-1]
        tok = distinct[r] if r < len(distinct) else placeholder
        tokens.append(tok)
        by_path[path] = (tok, [c for c in alive if len(c) > d and c[d] == tok] if r < len(distinct) else [])
    return tokens


class PromptLookupDrafter(Drafter):
    """Draft tokens copied from earlier occurrences of the last n tokens in the prompt and output."""

    static_step = True  # reads ctx.tokens only

    def __init__(self, vocab_size: int, k: int = 4, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if k < 1:
            raise ValueError(f"k (the draft depth) must be >= 1, got {k}")
        self.vocab_size, self.k, self.max_ngram, self.min_ngram = vocab_size, k, max_ngram, min_ngram

    def draft_steps(self) -> int:
        return self.k

    def draft_forwards(self, tree: DraftTree, n_layers: int) -> list[Forward]:
        return []  # no forward: the draft is a lookup in the token history

    def chain(self, tokens: Sequence[int], depth: int) -> list[int]:
        """The most likely continuation (longest n-gram, most recent occurrence) of up to `depth` tokens, or
        []: the chain draft a continuous batch feeds in a row (engine/batch.py)."""
        conts = continuations(tokens, depth, self.max_ngram, self.min_ngram, limit=1)
        return conts[0] if conts else []

    def propose(self, ctx: DraftContext) -> Draft:
        conts = continuations(ctx.tokens, ctx.tree.max_depth, self.max_ngram, self.min_ngram)
        # a placeholder verification rejects unless the base happens to choose it: the pending token itself
        placeholder = int(ctx.tokens[-1]) if ctx.tokens else 0
        return Draft(node_tokens=torch.tensor(fill_tree(ctx.tree, conts, placeholder), dtype=torch.long))

    def prompt_prior(self, tokens: Sequence[int]) -> float | None:
        """The acceptance a continuous batch starts a row at (engine/batch.py, `accept_prior`): lookup's
        depth-1 hit rate on the prompt itself, over its last 32 positions; None for a prompt under 24 tokens."""
        if len(tokens) < 24:
            return None
        # the last 32 positions, each one (the end of a prompt tells how its continuation starts; an even spread
        # over a prompt whose start repeats and whose end does not said 0.84 where the end hits 0)
        return self.self_accuracies(tokens, depth=1, ranks=1, start=max(8, len(tokens) - 33), positions=32)[0][0]

    def self_accuracies(self, tokens: Sequence[int], depth: int | None = None, ranks: int = 3,
                        start: int = 8, positions: int = 256) -> list[list[float]]:
        """acc[d][r] (tree.greedy_from_accuracies' format) measured on `tokens` (a prompt): at every position
        from `start` on, the lookup's rank-r candidate at depth d + 1 against the token that follows, counted
        where its depth-d prefix is right (acc[d][r] is then the conditional rate the product along a path
        needs). At most `positions` positions, evenly spaced (the lookup is quadratic in the prompt's length).
        Zeros where no position was counted."""
        depth = depth or self.k
        hits = [[0] * ranks for _ in range(depth)]
        counted = [0] * depth
        at = range(start, len(tokens) - 1)
        for i in (at if len(at) <= positions else [at[j * len(at) // positions] for j in range(positions)]):
            history, future = tokens[:i + 1], tokens[i + 1:i + 1 + depth]
            conts = continuations(history, depth, self.max_ngram, self.min_ngram)
            alive = conts
            for d, truth in enumerate(future):
                distinct: list[int] = []
                for c in alive:
                    if len(c) > d and c[d] not in distinct:
                        distinct.append(c[d])
                counted[d] += 1
                if truth in distinct[:ranks]:
                    hits[d][distinct.index(truth)] += 1
                alive = [c for c in alive if len(c) > d and c[d] == truth]
                if not alive:
                    break
        return [[h / counted[d] if counted[d] else 0.0 for h in hits[d]] for d in range(depth)]

"""Prompt lookup (issue 45, item 3): the n-gram search and tree fill against hand computations, exact
losslessness on both decode loops, and its price for `--tree auto` (no draft forward, accuracies measured on
the prompt)."""

from __future__ import annotations

import pytest
import torch

from midlayer.engine.generate import GenerationConfig, generate
from midlayer.speculative import tree_cost as tc
from midlayer.speculative.lookup import PromptLookupDrafter, continuations, fill_tree
from midlayer.speculative.static import static_speculative_generate
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from tiny_models import make_tiny

V = 64
DIMS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=160, multiple_of=32)
TREES = [DraftTree.chain(4), DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])]


def test_continuations_longest_ngram_first_then_most_recent():
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 1, 6, 7, 2, 9, 6, 7]  # suffix (6, 7): occurrences end at 6 and 3; suffix (7,) likewise
    assert continuations(toks, 3, max_ngram=2) == [[2, 9, 6], [1, 6, 7]]
    assert continuations(toks, 2, max_ngram=3) == [[2, 9], [1, 6]]  # (9, 6, 7) never occurred before
    assert continuations([1, 2, 3], 2) == []  # no earlier occurrence of any suffix
    assert continuations(toks, 2, max_ngram=2, limit=1) == [[2, 9]]
    assert continuations([5, 6, 5], 2) == [[6, 5]]  # the only occurrence starts the text (index 0 is searched)


def test_fill_tree_ranks_distinct_next_tokens_along_each_path():
    tree = DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (2,)])
    conts = [[4, 5], [4, 8], [3, 1], [4, 5]]  # after 4: 5 (twice) and 8; after 3: 1; no third first token
    assert fill_tree(tree, conts, placeholder=0) == [4, 3, 0, 5, 8, 1]  # breadth-first: (0,) (1,) (2,) (0,0) ...
    assert list(tree.paths[:3]) == [(0,), (1,), (2,)]
    # a child of a placeholder node is a placeholder too, even where the placeholder is a real candidate's token
    # (0 here, whose continuation goes on with 7): no continuation agrees with a path through a placeholder
    assert fill_tree(DraftTree([(0,), (1,), (2,), (2, 0)]), [[4, 5], [0, 7]], placeholder=0) == [4, 0, 0, 0]


def test_self_accuracies_on_a_periodic_text():
    d = PromptLookupDrafter(V, k=3)
    acc = d.self_accuracies([1, 2, 3] * 10, ranks=2)
    assert acc == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # every continuation of a period-3 text is right
    rnd = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 1000, (80,), generator=rnd).tolist()  # (almost) nothing repeats
    assert max(max(row) for row in d.self_accuracies(noise)) < 0.2


def test_self_accuracies_by_hand():
    """acc[d][r] counts depth d + 1 only where the lookup's depth-d prefix was right, and the rank among the
    distinct candidates of the continuations that agree with that prefix. The continuations at positions 2..10
    (`continuations(text[:i + 1], 2)`; their truths are the next two tokens):
        i=2 []  (7, 1)             miss                  i=7 [3 7] [2 7]  (2, 7)   rank 1, then rank 0
        i=3 [1 2]  (1, 3)          rank 0, then miss     i=8 [7 1]  (7, 1)        rank 0, then rank 0
        i=4 [2 7]  (3, 7)          miss                  i=9 [1 3] [1 2] [1 2]  (1, 3)  rank 0, then rank 0
        i=5 []  (7, 1)             miss                  i=10 [3 7] [2 7] [2 7]  (3,)   rank 0
        i=6 [1 3] [1 2]  (1, 2)    rank 0, then rank 1
    Depth 1: 9 positions, rank 0 at i = 3, 6, 8, 9, 10, rank 1 at i = 7. Depth 2: counted at the 5 positions
    whose first token was right (i = 3, 6, 7, 8, 9): rank 0 at 7, 8, 9, rank 1 at 6 (at i = 4 the lookup's 7 would
    have matched, but its first token was wrong)."""
    text = [7, 1, 2, 7, 1, 3, 7, 1, 2, 7, 1, 3]
    acc = PromptLookupDrafter(V, k=2).self_accuracies(text, ranks=2, start=2)
    assert acc == [[5 / 9, 1 / 9], [3 / 5, 1 / 5]]


def test_prompt_prior_is_the_hit_rate_of_the_prompts_last_32_positions():
    """The batch's starting acceptance for a lookup row: depth-1 hits over the prompt's last 32 positions, by
    hand. A prompt whose start repeats and whose end is fresh text has a prior of 0 (an even spread over the
    whole prompt said 0.84), and the reverse 1."""
    d = PromptLookupDrafter(2000, k=3)
    fresh = list(range(1000, 1033))  # 33 distinct tokens: no n-gram of the end occurs before it
    assert d.prompt_prior([1, 2, 3, 4] * 42 + fresh) == 0.0
    assert d.prompt_prior(fresh + [1, 2, 3, 4] * 42) == 1.0
    assert d.prompt_prior(fresh[:23]) is None
    assert d.prompt_prior(fresh[:24]) == 0.0  # 24 tokens are enough
    # 45 tokens: positions 12..43 are the last 32; the one hit is at the first of them (token 12 = token 0, and
    # the lookup proposes token 1, which follows both)
    one_hit = list(range(1000, 1045))
    one_hit[12:14] = one_hit[0:2]
    assert d.prompt_prior(one_hit) == 1 / 32


def test_lookup_rounds_run_no_draft_forward():
    d = PromptLookupDrafter(V, k=3)
    assert tc.round_forwards(d, DraftTree.chain(3), 4) == [([4] * 4, 4)]  # the verification forward alone
    assert d.draft_steps() == 3 and d.static_step and d.fused is None


@pytest.mark.parametrize("tree", TREES, ids=["chain4", "tree6"])
def test_lookup_is_lossless_and_accepts_repeated_text(tree):
    model = make_tiny(DIMS, False)
    prompt = [3, 9, 14, 27, 3, 9, 14, 27, 3, 9, 14, 27, 3, 9]  # a repeated phrase, as in a summary or an edit
    ref = generate(model, [prompt], GenerationConfig(max_new_tokens=40))[0]
    drafter = PromptLookupDrafter(V, k=tree.max_depth)
    out, stats = speculative_generate(model, prompt, drafter, tree, 40)
    assert out == ref
    # a random tiny model's greedy text loops, so copying from the history is accepted
    assert stats.tau > 1.5, stats
    static, _ = static_speculative_generate(model, prompt, drafter, tree, 40)
    assert static == ref


def test_lookup_refuses_bad_sizes():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(V, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="draft depth"):
        PromptLookupDrafter(V, k=0)

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


def test_fill_tree_ranks_distinct_next_tokens_along_each_path():
    tree = DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (2,)])
    conts = [[4, 5], [4, 8], [3, 1], [4, 5]]  # after 4: 5 (twice) and 8; after 3: 1; no third first token
    assert fill_tree(tree, conts, placeholder=0) == [4, 3, 0, 5, 8, 1]  # breadth-first: (0,) (1,) (2,) (0,0) ...
    assert list(tree.paths[:3]) == [(0,), (1,), (2,)]


def test_self_accuracies_on_a_periodic_text():
    d = PromptLookupDrafter(V, k=3)
    acc = d.self_accuracies([1, 2, 3] * 10, ranks=2)
    assert acc == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # every continuation of a period-3 text is right
    rnd = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 1000, (80,), generator=rnd).tolist()  # (almost) nothing repeats
    assert max(max(row) for row in d.self_accuracies(noise)) < 0.2


def test_prompt_prior_is_the_hit_rate_of_the_prompts_last_32_positions():
    """The batch's starting acceptance for a lookup row: depth-1 hits over the prompt's last 32 positions, by
    hand. A prompt whose start repeats and whose end is fresh text has a prior of 0 (an even spread over the
    whole prompt said 0.84), and the reverse 1."""
    d = PromptLookupDrafter(2000, k=3)
    fresh = list(range(1000, 1033))  # 33 distinct tokens: no n-gram of the end occurs before it
    assert d.prompt_prior([1, 2, 3, 4] * 42 + fresh) == 0.0
    assert d.prompt_prior(fresh + [1, 2, 3, 4] * 42) == 1.0
    assert d.prompt_prior(fresh[:23]) is None


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

"""The draft vocabulary (midlayer/engine/draft_vocab.py): the frequency rule by hand, the restricted head against the
full one (fp32 and the q4 format's Q8 head), every drafter lossless with it and proposing only its tokens,
save/load, and training scoring candidates against the base's full-vocabulary argmax."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from midlayer.speculative.static import static_speculative_generate
from midlayer.engine.draft_vocab import (draft_vocab, frequent_tokens, head_logits, restrict_logits, set_draft_vocab,
                                  teacher_logits, to_token_ids, vocab_topk)
from midlayer.speculative.registry import DraftMismatchError, load_draft, save_draft
from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads
from midlayer.speculative.eagle import EagleDrafter, EagleHead
from midlayer.speculative.hidden_transfer import HiddenTransferDrafter
from midlayer.speculative.protocol import Draft
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from test_drafters import D, MODELS, PROMPT, SMALL_TREE, V, greedy, perturbed_transfer


def test_frequent_tokens_by_hand():
    # counts: 5 x3, 3 x2, 7 x1, 9 x1 -> top 3 = {5, 3, 7} (7 before 9: the tie goes to the smaller id)
    responses = [[5, 5, 3], [3, 7, 5], [9]]
    assert frequent_tokens(responses, 3, 16).tolist() == [3, 5, 7]
    assert frequent_tokens(responses, 1, 16).tolist() == [5]
    assert frequent_tokens(responses, 100, 16).tolist() == [3, 5, 7, 9]  # never padded with unseen tokens
    with pytest.raises(ValueError, match="n >= 1"):
        frequent_tokens(responses, 0, 16)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        frequent_tokens([[3, 16]], 4, 16)
    with pytest.raises(ValueError, match="no response tokens"):
        frequent_tokens([[], []], 4, 16)


@pytest.mark.parametrize("V", [49152, 5000])
def test_the_two_pass_top_k_gives_topks_values_and_indices_that_hold_them(V):
    """`vocab_topk` in two passes (the k best of each 1,024 entries, then of those; the GPU's way) against
    torch.topk: the same values, largest first, and indices that hold them, distinct, within the vocabulary.
    Rows with the best entries in one segment, spread over several, and in the last, padded segment; rows of
    bf16 values with ties; a batch dimension; k from 1 to 8."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g)
    x[0, 2048:2056] += 10  # (the 8 best in one segment)
    x[1, torch.arange(8) * 600] += 10  # (in 5 segments)
    x[2, V - 5:] += 10  # (at the end: the padded segment where V is no multiple of 1,024)
    x[3] = -x[3].abs() - 1  # (every entry below 0: no padding may win)
    for rows in (x, x.bfloat16(), x.view(2, 3, V)):
        for k in (1, 4, 8):
            v, i = vocab_topk(rows, k, split=True)
            want = rows.topk(k, -1)
            assert torch.equal(v, want.values) and i.shape == want.indices.shape
            assert torch.equal(rows.gather(-1, i), v) and int(i.max()) < V
            assert all(len(set(r)) == k for r in i.reshape(-1, k).tolist())
    assert torch.equal(vocab_topk(x, 4)[1], x.topk(4, -1).indices)  # (on a CPU: torch.topk itself)


def test_restrict_map_and_teacher():
    vocab = torch.tensor([1, 4, 6])
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 9.0, 3.0, 4.0]])
    r = restrict_logits(logits, vocab)
    assert r.tolist() == [[5.0, 9.0, 4.0]]
    assert to_token_ids(r.topk(2, -1).indices, vocab).tolist() == [[4, 1]]
    assert restrict_logits(logits, None) is logits and to_token_ids(torch.tensor([2]), None).tolist() == [2]
    m = torch.nn.Linear(2, 2)
    set_draft_vocab(m, vocab)
    assert teacher_logits(logits, m).tolist() == r.tolist() and teacher_logits(r, m) is r  # already restricted
    with pytest.raises(ValueError, match="increasing order"):
        set_draft_vocab(m, torch.tensor([4, 1]))
    set_draft_vocab(m, None)
    assert draft_vocab(m) is None


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_sub_head_equals_the_full_head_restricted(fmt):
    from midlayer.engine.quantization import compress_weights

    model = copy.deepcopy(MODELS[False])
    if fmt == "q4":
        compress_weights(model, "q4")
    module = MedusaHeads(D, 1)
    vocab = torch.tensor([0, 3, 5, 17, 40, 63])
    set_draft_vocab(module, vocab)
    x = torch.randn(7, D)
    with torch.no_grad():
        full = model.output(x)
        sub = head_logits(module, model, x)
    assert sub.shape == (7, 6)
    if fmt == "q4":  # a Q8 head rebuilt from the dequantised rows: the same codes, the same integer sums
        assert torch.equal(sub, full[:, vocab])
    else:  # MKL's fp32 GEMM sums in an order that depends on the output width: equal to rounding
        assert torch.allclose(sub, full[:, vocab], rtol=1e-5, atol=1e-6)


def _recording(drafter):
    """Wrap propose to collect every proposed token."""
    seen: list[int] = []
    inner = drafter.propose

    def propose(ctx):
        out = inner(ctx)
        if isinstance(out, Draft):
            seen.extend(out.node_tokens.tolist())
        else:
            seen.extend(t for row in out for t in row)
        return out

    drafter.propose = propose
    return seen


def _module(kind: str):
    g = torch.Generator().manual_seed(5)
    if kind == "ht":
        return perturbed_transfer([1, 2, 2])
    if kind == "medusa":
        m = MedusaHeads(D, 3)
        with torch.no_grad():
            for lin in m.heads:
                lin.weight.copy_(0.3 * torch.randn(D, D, generator=g))
        return m
    if kind == "early_exit":
        return EarlyExitHead(D, 2)
    m = EagleHead.for_model(MODELS[False])
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def _drafter(kind: str, model, module):
    return {"ht": HiddenTransferDrafter, "medusa": MedusaDrafter, "early_exit": EarlyExitDrafter,
            "eagle": EagleDrafter}[kind](model, module)


@pytest.mark.parametrize("kind", ["ht", "medusa", "early_exit", "eagle"])
def test_drafters_with_a_draft_vocabulary_are_lossless_and_propose_only_its_tokens(kind):
    model = MODELS[False]
    ref = greedy(model, PROMPT, 24)
    # a subset holding half of what greedy emits and every third token: some drafts must miss
    vocab = torch.tensor(sorted(set(ref[::2]) | set(range(0, V, 3))))
    module = _module(kind)
    set_draft_vocab(module, vocab)
    drafter = _drafter(kind, model, module)
    seen = _recording(drafter)
    for tree in (DraftTree.chain(3), SMALL_TREE):
        seen.clear()
        out, stats = speculative_generate(model, PROMPT, drafter, tree, 24)
        assert out == ref
        assert seen and set(seen) <= set(vocab.tolist())
        if drafter.static_step:  # the static step's device rounds restrict the same way: the same rounds
            static_out, static_stats = static_speculative_generate(model, PROMPT, drafter, tree, 24)
            assert static_out == ref and static_stats.base_forwards == stats.base_forwards


def test_early_exit_at_full_depth_with_a_draft_vocabulary_accepts_exactly_the_in_vocabulary_tokens():
    """The exit after the last block is the base itself: restricted to a subset it drafts the base's argmax
    whenever that is in the subset, so a chain of 1 accepts exactly at those steps."""
    model = MODELS[False]
    ref = greedy(model, PROMPT, 16)
    vocab = torch.tensor(sorted(set(ref[1::2]) | {0}))
    head = EarlyExitHead(D, model.cfg.n_layers)
    set_draft_vocab(head, vocab)
    out, stats = speculative_generate(model, PROMPT, EarlyExitDrafter(model, head), DraftTree.chain(1), 16)
    assert out == ref
    full = EarlyExitHead(D, model.cfg.n_layers)
    _, oracle = speculative_generate(model, PROMPT, EarlyExitDrafter(model, full), DraftTree.chain(1), 16)
    assert oracle.tau == 2.0 and stats.tau < 2.0  # the oracle always accepts; the subset misses some


def test_save_load_keeps_the_draft_vocabulary(tmp_path):
    model = MODELS[False]
    module = _module("medusa")
    set_draft_vocab(module, torch.tensor([2, 9, 11]))
    path = save_draft(tmp_path / "m", module, base=model)
    loaded, _ = load_draft(path, model)
    assert draft_vocab(loaded).tolist() == [2, 9, 11]
    plain = save_draft(tmp_path / "p", _module("medusa"), base=model)  # no subset: none after loading
    assert draft_vocab(load_draft(plain, model)[0]) is None
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "draft.safetensors"))
    # the file's checksum would refuse any edit first (its own test: test_bad_inputs_train); without it, as in a
    # draft written before checksums, the vocabulary's own checks must hold
    doc = json.loads((path / "draft.json").read_text())
    doc.pop("weights_sha256")
    (path / "draft.json").write_text(json.dumps(doc))
    state["vocab"] = torch.tensor([9, 2, 11])
    save_file(state, str(path / "draft.safetensors"))
    with pytest.raises(DraftMismatchError, match="invalid draft vocabulary"):
        load_draft(path, model)
    state["vocab"] = torch.tensor([2, 9, V])
    save_file(state, str(path / "draft.safetensors"))
    with pytest.raises(DraftMismatchError, match="beyond the base"):
        load_draft(path, model)


def test_round_cost_counts_the_draft_vocabularys_share_of_the_head():
    from midlayer.speculative import tree_cost as tc

    costs = tc.RowCosts((1, 8), (10.0, 24.0), (2.0, 9.0), 4)
    # by hand: head(3) = 2 + (9 - 2) * (3 - 1) / (8 - 1) = 4.0; a quarter of the head's rows: 1.0; no block rows
    assert tc.forward_ms(costs, ([0] * 4, 3, 0.25)) == pytest.approx(1.0)
    assert tc.forward_ms(costs, ([0] * 4, 3)) == pytest.approx(4.0)
    model = MODELS[False]
    heads = _module("medusa")
    set_draft_vocab(heads, torch.arange(0, V, 4))  # 16 of 64 tokens
    forwards = tc.round_forwards(MedusaDrafter(model, heads), DraftTree.chain(3), 4)
    assert forwards[-1] == ([0] * 4, 3, 0.25)
    ee = EarlyExitHead(D, 2)
    set_draft_vocab(ee, torch.arange(0, V, 2))
    forwards = tc.round_forwards(EarlyExitDrafter(model, ee), SMALL_TREE, 4)
    assert [f[2] for f in forwards[1:]] == [0.5] * 3 and [f[1] for f in forwards[1:]] == [1, 2, 3]

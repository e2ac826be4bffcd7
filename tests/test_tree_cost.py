"""Trees sized by measured cost (midlayer.speculative.tree_cost): the cost model against hand computations, the choice
against a known optimum, the forwards each drafter runs, and the cached measurement."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from midlayer.speculative import tree_cost as tc
from midlayer.speculative.eagle import EagleDrafter, EagleHead
from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
from midlayer.speculative.layer_skip import LayerSkipDrafter
from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads
from midlayer.engine.generate import GenerationConfig, generate
from midlayer.speculative.hidden_transfer import HiddenTransfer, HiddenTransferDrafter
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from midlayer.speculative.protocol import Drafter
from tiny_models import make_tiny


class Free(Drafter):
    """A drafter that declares nothing of its own: its rounds are the verification forward only."""


FREE = Free()

V, D = 64, 32
TINY = dict(dim=D, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=48, multiple_of=16)
LINEAR = tc.RowCosts(rows=(1, 2, 4, 8), total_ms=(12.0, 14.0, 18.0, 26.0), head_ms=(0.0, 0.0, 0.0, 0.0), n_layers=2)
ACC = [[0.9, 0.05], [0.8, 0.05], [0.7, 0.05]]


def test_row_costs_interpolate_and_split_blocks_from_head():
    c = tc.RowCosts(rows=(1, 4), total_ms=(10.0, 16.0), head_ms=(2.0, 5.0), n_layers=4)
    assert c.head(1) == 2.0 and c.head(2) == 3.0 and c.head(7) == 8.0  # linear, extrapolated beyond 4
    assert c.blocks(1) == 8.0 and c.blocks(4) == 11.0 and c.blocks(0) == 0.0
    # a forward with rows [1, 1, 4, 4] at the 4 blocks and 4 head rows: (8 + 8 + 11 + 11) / 4 + 5
    assert tc.forward_ms(c, ([1, 1, 4, 4], 4)) == pytest.approx(14.5)
    with pytest.raises(ValueError):
        tc.forward_ms(c, ([1, 1], 1))
    with pytest.raises(ValueError):
        tc.RowCosts(rows=(4, 1), total_ms=(1.0, 2.0), head_ms=(0.0, 0.0), n_layers=1)


def test_every_forward_call_pays_the_fixed_cost_once():
    """call_ms: a full forward still costs blocks + head (the fixed cost is part of them); a one-block draft
    call pays it whole, not a block's share; a head-only call (no block) does not pay it."""
    c = tc.RowCosts(rows=(1, 4), total_ms=(10.0, 16.0), head_ms=(2.0, 5.0), n_layers=4, call_ms=2.0)
    assert tc.forward_ms(c, ([1, 1, 4, 4], 4)) == pytest.approx(14.5)  # 2 + (6 + 6 + 9 + 9) / 4 + 5
    assert tc.forward_ms(c, ([1, 0, 0, 0], 1, 0.5)) == pytest.approx(4.5)  # 2 + 6 / 4 + 0.5 * 2
    no_call = tc.RowCosts(rows=(1, 4), total_ms=(10.0, 16.0), head_ms=(2.0, 5.0), n_layers=4)
    assert tc.forward_ms(no_call, ([1, 0, 0, 0], 1, 0.5)) == pytest.approx(3.0)  # 8 / 4 + 1: the old model
    assert tc.forward_ms(c, ([0, 0, 0, 0], 2)) == pytest.approx(3.0)  # Medusa's heads: the LM head only
    with pytest.raises(ValueError):  # more than the blocks' whole cost at one row
        tc.RowCosts(rows=(1, 4), total_ms=(10.0, 16.0), head_ms=(2.0, 5.0), n_layers=4, call_ms=9.0)


class ScriptedClock:
    """A fake clock for `measure_row_costs`: per repeat and row count, a forward "takes" 10 ms and the head
    2 ms; the one-block one-row call 3 ms (the warm-up pass, repeat 0, reads the clock once fewer after it)."""

    def __init__(self, rows: tuple[int, ...], repeats: int) -> None:
        steps = []
        for rep in range(repeats + 1):
            steps += [0.0, 0.010, 0.002] * len(rows) + ([0.0] if rep == 0 else [0.0, 0.003])
        self.steps, self.t, self.i = steps, 0.0, 0

    def __call__(self) -> float:
        self.t += self.steps[self.i]
        self.i += 1
        return self.t


def test_call_ms_prices_the_measured_one_block_call_at_what_it_took():
    """blocks_ms(1) = 10 - 2 = 8 ms over L = 4 blocks; the one-block call took t_1 = 3 ms. call_ms c solves
    c + (8 - c) / 4 = 3: c = (3 - 2) * 4 / 3 = 4/3 ms, and the cost model then prices that call at 3 ms."""
    model = make_tiny(TINY, False)
    rows = (1, 2, 4)
    costs = tc.measure_row_costs(model, rows=rows, context=8, repeats=2, timer=ScriptedClock(rows, 2))
    assert costs.total_ms == pytest.approx((10.0,) * 3) and costs.head_ms == pytest.approx((2.0,) * 3)
    assert costs.call_ms == pytest.approx(4 / 3)
    assert tc.forward_ms(costs, ([1, 0, 0, 0], 0)) == pytest.approx(3.0)
    assert tc.forward_ms(costs, ([1] * 4, 1)) == pytest.approx(10.0)  # a whole forward: still blocks + head


def test_expected_tokens_hand_computation():
    acc = [[0.5, 0.2], [0.4]]
    assert tc.expected_tokens(DraftTree.chain(2), acc) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    tree = DraftTree([(0,), (1,), (0, 0), (1, 0)])
    assert tc.expected_tokens(tree, acc) == pytest.approx(1 + 0.5 + 0.2 + 0.2 + 0.08)
    assert tc.expected_tokens(DraftTree([(0,), (0, 1)]), acc) == pytest.approx(1.5)  # rank 1 at depth 2: never
    # one row of accuracies (early exit measures depth 1 only) serves every depth: 1 + 0.5 + 0.25 + 0.125
    assert tc.expected_tokens(DraftTree.chain(3), [[0.5]]) == pytest.approx(1.875)


def test_expected_tokens_with_anchors_by_hand():
    """A chain of 2 with pseudo rows for the root only: a round that ends at depth delta drafts depth j from the
    root's step j + delta. delta 0: ends at the root, row 1, row 2 with .5, .5 x .6, .5 x .4, 1.7 tokens; delta
    1 (depth 1 as accurate as depth 2, depth 2 never): .6, .4, 1.4 tokens; delta 2: 1 token. The chain over
    delta stays at pi = (1, .5, .2) / 1.7, so a round makes (1.7 + .7 + .2) / 1.7 tokens. Every row an anchor:
    the formula without anchors."""
    acc = [[0.5], [0.4]]
    chain = DraftTree.chain(2)
    assert tc.expected_tokens(chain, acc, (0,)) == pytest.approx(2.6 / 1.7)
    assert tc.expected_tokens(chain, acc, (0, 1, 2)) == pytest.approx(tc.expected_tokens(chain, acc)) == 1.7
    tree = DraftTree.greedy_from_accuracies(ACC, 6)
    assert tc.expected_tokens(tree, ACC, range(7)) == pytest.approx(tc.expected_tokens(tree, ACC))
    assert tc.expected_tokens(tree, ACC, (0, 1)) < tc.expected_tokens(tree, ACC, (0, 1, 3)) < tc.expected_tokens(
        tree, ACC)


def test_auto_prices_hidden_transfers_anchors_and_takes_the_count_it_chose():
    """`auto` also prices a hidden-transfer tree with pseudo rows for 1, 2, 4, ... of its rows (the rows each
    forward then runs), and sets the drafter's anchors to the chosen count. Rows dear (a forward's cost grows with
    its rows): fewer anchors win; rows free: every row's (anchors 0). A drafter without a fused pass is priced as
    before, one row per tree size. A static tree asked for afterwards carries every row's pseudo rows again."""
    model = make_tiny(TINY, False)
    ht = HiddenTransferDrafter(model, HiddenTransfer(D, [1, 2, 2]))
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]]
    dear = tc.RowCosts(rows=(1, 64), total_ms=(10.0, 22.6), head_ms=(0.0, 0.0), n_layers=4)  # 0.2 ms a row
    tree, table = tc.auto_tree(model, ht, acc, dear, max_nodes=12)
    chosen = [r for r in table if r.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["nodes"] == len(tree) and chosen[0]["anchors"] == ht.anchors >= 1
    assert {r["anchors"] for r in table if r["nodes"] == 12} == {0, 1, 2, 4, 8}
    row = next(r for r in table if r["nodes"] == 12 and r["anchors"] == 2)
    twelve = DraftTree.greedy_from_accuracies(acc, 12)
    assert row["tokens"] == pytest.approx(tc.expected_tokens(twelve, acc, twelve.likeliest_ends(acc, 2)))
    priced = HiddenTransferDrafter(model, HiddenTransfer(D, [1, 2, 2]), anchors=2)
    assert row["ms"] == pytest.approx(tc.round_ms(dear, priced, twelve))
    text = tc.table_text(table, tree)  # (per tree: every row's pseudo rows, and the fastest anchor count)
    fastest = max((r for r in table if r["nodes"] == 12 and r["anchors"]), key=lambda r: r["tok_per_s"])
    assert f"| 12 | 3 | {fastest['anchors']} |" in text and text.count("| 12 | 3 |") == 2 and text.count("**<-**") == 1
    free = tc.RowCosts(rows=(1, 64), total_ms=(10.0, 10.0), head_ms=(0.0, 0.0), n_layers=4)
    assert tc.auto_tree(model, ht, acc, free, max_nodes=12)[1] and ht.anchors == 0
    medusa = MedusaDrafter(model, MedusaHeads(D, 3))
    assert all(r["anchors"] == 0 for r in tc.auto_tree(model, medusa, acc, dear, max_nodes=12)[1])
    ht.anchors = 4
    tc.select_tree(model, ht, acc, "sparse:6", model_name="tiny", weights="fp32", prompt_ids=[1, 2, 3])
    assert ht.anchors == 0


def test_choose_tree_finds_the_known_optimum():
    # verification only (an unknown drafter drafts for free): round = total(n + 1) = 10 + 2 (n + 1) ms.
    # By hand: n=0 1/12, n=1 1.9/14, n=2 2.62/16, n=3 3.124/18 = 0.1736 (best), n=4 adds (1,) 0.05: 3.174/20.
    tree, table = tc.choose_tree(ACC, lambda t: tc.round_ms(LINEAR, FREE, t))
    assert tree == DraftTree.chain(3)
    assert [r["nodes"] for r in table[:5]] == [0, 1, 2, 3, 4]
    assert table[3]["tok_per_s"] == pytest.approx(1e3 * 3.124 / 18)
    # verification far dearer per row: plain decoding wins; free rows: every path is taken
    steep = tc.RowCosts(rows=(1, 2), total_ms=(12.0, 24.0), head_ms=(0.0, 0.0), n_layers=1)
    assert len(tc.choose_tree(ACC, lambda t: tc.round_ms(steep, FREE, t))[0]) == 0
    flat = tc.RowCosts(rows=(1, 2), total_ms=(12.0, 12.0), head_ms=(0.0, 0.0), n_layers=1)
    assert len(tc.choose_tree(ACC, lambda t: tc.round_ms(flat, FREE, t), max_nodes=100)[0]) == 2 + 4 + 8
    # a node never accepted adds no token: at no cost it ties, and a tie keeps the smaller tree
    assert tc.choose_tree([[0.9, 0.0]], lambda t: tc.round_ms(flat, FREE, t))[0] == DraftTree.chain(1)


def test_choose_tree_repeats_a_one_row_table_down_to_max_depth():
    """Early exit measures depth 1 only (acc = [[0.9]]): deeper depths are assumed as accurate. Rows cost
    11.5 + 0.5 T ms for T rows: chain n gives (1 + 0.9 + ... + 0.9^n) / (12 + 0.5 n), which grows up to n = 3
    (3.439 tokens in 13.5 ms), the deepest allowed."""
    lin = tc.RowCosts(rows=(1, 2, 4, 8), total_ms=(12.0, 12.5, 13.5, 15.5), head_ms=(0.0,) * 4, n_layers=2)
    tree, table = tc.choose_tree([[0.9]], lambda t: tc.round_ms(lin, FREE, t), max_depth=3)
    assert tree == DraftTree.chain(3)
    assert table[3]["tokens"] == pytest.approx(3.439) and table[3]["ms"] == pytest.approx(13.5)


def test_round_forwards_per_drafter():
    model = make_tiny(TINY, False)
    chain = DraftTree.chain(3)
    ht = HiddenTransferDrafter(model, HiddenTransfer(D, [1, 2, 2]))
    # fused pass: 4 tree rows everywhere, + 4 pseudo rows per step joined at or below the block; the LM head
    # reads the 4 tree rows, then the accepted anchor's 3 pseudo rows (its draft vocabulary: all of it here)
    assert tc.round_forwards(ht, chain, 4) == [([4, 8, 16, 16], 4), ([0] * 4, 3, 1.0)]
    sep = HiddenTransferDrafter(model, HiddenTransfer(D, [1, 2, 2]), fused=False)
    assert tc.round_forwards(sep, chain, 4) == [([4] * 4, 4), ([0, 1, 3, 3], 3, 1.0)]
    assert tc.round_forwards(MedusaDrafter(model, MedusaHeads(D, 3)), chain, 4) == [([4] * 4, 4), ([0] * 4, 3, 1.0)]
    tree = DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # levels run: root, 2 at depth 1, 3 at depth 2
    ee = EarlyExitDrafter(model, EarlyExitHead(D, 2))
    assert tc.round_forwards(ee, tree, 4) == [([7] * 4, 7), ([1, 1, 0, 0], 1, 1.0), ([2, 2, 0, 0], 2, 1.0),
                                              ([3, 3, 0, 0], 3, 1.0)]
    ls = LayerSkipDrafter(model, [1, 2])
    assert tc.round_forwards(ls, chain, 4)[1:] == [([1, 0, 0, 1], 1)] * 3
    assert tc.round_forwards(ht, DraftTree.chain(0), 4) == [([1] * 4, 1)]
    # trees shallower than the drafter's k steps: the fused pass still decodes the anchor's k = 3 pseudo rows
    # (`fused_draft`); the separate pass runs the tree's depth of steps (step 1 joins at block 1); Medusa runs
    # the tree's depth of heads
    assert tc.round_forwards(ht, DraftTree.chain(2), 4)[1:] == [([0] * 4, 3, 1.0)]
    assert tc.round_forwards(sep, DraftTree.chain(1), 4)[1:] == [([0, 1, 1, 1], 1, 1.0)]
    assert tc.round_forwards(MedusaDrafter(model, MedusaHeads(D, 3)), DraftTree.chain(1), 4)[1:] == [([0] * 4, 1, 1.0)]
    # EAGLE: the root row rides the commit call; then one draft-layer call per level after the root: the static
    # tree's level sizes, or EAGLE-2's k expanded nodes at each depth but the last
    eagle = EagleHead.for_model(model)
    root = ([1, 0, 0, 0], 1, 1.0)
    assert EagleDrafter(model, eagle).draft_forwards(tree, 4) == [root, ([2, 0, 0, 0], 2, 1.0), ([3, 0, 0, 0], 3, 1.0)]
    assert EagleDrafter(model, eagle, dynamic_k=2).draft_forwards(chain, 4) == [root, *[([2, 0, 0, 0], 2, 1.0)] * 2]


def test_medusa_runs_the_heads_its_tree_prices():
    """A tree of depth 1 prices one head row (above) and runs head 0 only: it ran all k = 3 heads, 3x the head
    cost that `--tree auto` counted. The output stays plain greedy decoding's."""
    torch.manual_seed(0)
    model = make_tiny(TINY, False)
    heads = MedusaHeads(D, 3)
    for lin in heads.heads:  # trained-looking heads, so that the heads' proposals differ
        torch.nn.init.normal_(lin.weight, std=0.2)
    calls = [0, 0, 0]
    for i, lin in enumerate(heads.heads):
        lin.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    prompt = [3, 9, 27, 17, 51]
    out, _ = speculative_generate(model, prompt, MedusaDrafter(model, heads), DraftTree.chain(1), 10)
    assert calls[0] > 0 and calls[1:] == [0, 0]
    assert out == generate(model, [prompt], GenerationConfig(max_new_tokens=10))[0]
    for bad in (dict(depth=0), dict(depth=4), dict(head=0, depth=1)):
        with pytest.raises(ValueError, match="heads asked of 3 Medusa heads"):
            heads.logits(model, torch.zeros(D), **bad)


def test_single_point_curve_is_proportional_to_rows():
    """A curve measured at one row count (T = 1) prices T rows at T times it: head 2 ms, blocks 8 ms a row."""
    c = tc.RowCosts((1,), (10.0,), (2.0,), 4)
    assert c.blocks(4) == 32.0 and c.head(3) == 6.0


def test_measured_costs_are_cached_per_machine_and_damage_is_remeasured(tmp_path, monkeypatch):
    monkeypatch.setenv("MIDLAYER_CACHE", str(tmp_path))
    model = make_tiny(TINY, False)
    ticks = iter(range(10 ** 6))
    costs = tc.row_costs(model, "tiny", "fp32", rows=(1, 2, 4), context=8, repeats=2,
                         timer=lambda: float(next(ticks)))
    # the fake clock advances 1 s per call: every forward and every head "takes" exactly 1000 ms
    assert costs.total_ms == (1000.0,) * 3 and costs.head_ms == (1000.0,) * 3 and costs.n_layers == 4
    assert costs.call_ms == 0.0  # a one-block call "took" 1000 ms, clamped to the blocks' 0 ms at one row
    store = json.loads((tmp_path / "row_costs.json").read_text())
    assert list(store) == [tc.cost_key("tiny", "fp32", model)]
    again = tc.row_costs(model, "tiny", "fp32", timer=lambda: pytest.fail("measured again despite the cache"))
    assert again == costs
    key = tc.cost_key("tiny", "fp32", model)  # a curve stored before call_ms was measured: measured again
    del store[key]["call_ms"]
    (tmp_path / "row_costs.json").write_text(json.dumps(store))
    ticks = iter(range(10 ** 6))
    assert tc.row_costs(model, "tiny", "fp32", rows=(1, 2, 4), context=8, repeats=2,
                        timer=lambda: float(next(ticks))) == costs
    assert "call_ms" in json.loads((tmp_path / "row_costs.json").read_text())[key]
    (tmp_path / "row_costs.json").write_text("{not json")
    ticks = iter(range(0, 10 ** 6, 2))
    remeasured = tc.row_costs(model, "tiny", "fp32", rows=(1, 2), context=8, repeats=1,
                              timer=lambda: float(next(ticks)))
    assert remeasured.total_ms == (2000.0, 2000.0)


def test_a_short_context_measures_the_rows_that_fit_and_sizes_trees_to_it():
    """A model whose context is at most the largest default row count (64) still gets a curve, of the row counts
    that leave a token of context, and auto trees no larger than a round after one token (it refused --tree auto
    outright: "max_seq_len 48 leaves no room for 64 rows")."""
    model = make_tiny(TINY, False)  # a context of 48
    ticks = iter(range(10 ** 6))
    costs = tc.measure_row_costs(model, repeats=1, timer=lambda: float(next(ticks)))
    assert costs.rows == tuple(r for r in tc.DEFAULT_ROWS if r < 48) and max(costs.rows) == 32
    with pytest.raises(ValueError, match="max_seq_len 1 leaves no room"):
        tc.measure_row_costs(make_tiny({**TINY, "max_seq_len": 1}, False), repeats=1)
    free = tc.RowCosts((1, 64), (10.0, 10.0), (0.0, 0.0), 4)  # rows cost nothing: the largest tree allowed wins
    acc = [[0.99] * 8] * 8
    assert len(tc.auto_tree(model, FREE, acc, free)[0]) == 46
    short = make_tiny({**TINY, "max_seq_len": 6}, False)
    assert len(tc.auto_tree(short, FREE, acc, free)[0]) == 4


def test_auto_tree_speculation_stays_lossless():
    model = make_tiny(TINY, True)
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    drafter = MedusaDrafter(model, MedusaHeads(D, 3))
    tree, _ = tc.auto_tree(model, drafter, ACC, LINEAR.__class__(LINEAR.rows, LINEAR.total_ms, LINEAR.head_ms, 4))
    assert len(tree) > 0
    out, _ = speculative_generate(model, prompt, drafter, tree, 12)
    assert out == generate(model, [prompt], GenerationConfig(max_new_tokens=12))[0]


def test_overhead_is_split_per_round_and_per_draft_call_and_priced():
    """The excess a round costs beyond its modelled forwards: a line through (draft calls, excess) points,
    by hand; the round cost adds it per round and per call, or per token for plain decoding."""
    assert tc.split_excess([(1, 2.0), (3, 4.0)]) == pytest.approx((1.0, 1.0))  # slope 1 ms a call, 1 ms a round
    assert tc.split_excess([(1, 2.0), (1, 3.0)]) == pytest.approx((2.5, 0.0))  # one call count: all per round
    assert tc.split_excess([(1, 4.0), (3, 2.0)]) == pytest.approx((3.0, 0.0))  # no negative slope
    assert tc.split_excess([(1, -1.0), (3, 1.0)]) == pytest.approx((-2.0, 1.0))  # a curve measured slower
    assert tc.split_excess([]) == (0.0, 0.0)
    model = make_tiny(TINY, True)
    drafter = MedusaDrafter(model, MedusaHeads(D, 3))
    costs = tc.RowCosts(LINEAR.rows, LINEAR.total_ms, LINEAR.head_ms, 4)
    over = tc.Overhead(plain_ms=0.5, round_ms=2.0, call_ms=3.0)
    chain = DraftTree.chain(2)
    assert tc.draft_calls(drafter, chain, 4) == 1 and tc.draft_calls(drafter, DraftTree([]), 4) == 0
    assert tc.total_round_ms(costs, drafter, chain, over) == pytest.approx(tc.round_ms(costs, drafter, chain) + 5.0)
    empty = DraftTree([])
    assert tc.total_round_ms(costs, drafter, empty, over) == pytest.approx(tc.round_ms(costs, drafter, empty) + 0.5)
    faster = tc.Overhead(plain_ms=-2.0)  # the machine runs faster now than when the curve was measured
    assert tc.total_round_ms(costs, drafter, empty, faster) == pytest.approx(tc.round_ms(costs, drafter, empty) - 2.0)
    wild = tc.Overhead(round_ms=-1e3)
    assert tc.total_round_ms(costs, drafter, chain, wild) == pytest.approx(0.25 * tc.round_ms(costs, drafter, chain))


def test_measured_overhead_decides_between_speculation_and_plain_decoding():
    """measure_overhead on a real drafter gives finite non-negative parts; rows that are nearly free make
    speculation pay, and the same rows with a large measured per-round cost make `auto` fall back to the
    empty tree (plain decoding), which is what a round that costs more than it saves deserves."""
    model = make_tiny(TINY, False)
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    drafter = MedusaDrafter(model, MedusaHeads(D, 3))
    costs = tc.RowCosts(LINEAR.rows, LINEAR.total_ms, LINEAR.head_ms, 4)
    over = tc.measure_overhead(model, drafter, costs, prompt, new_tokens=8)
    assert all(math.isfinite(v) for v in (over.plain_ms, over.round_ms)) and over.call_ms >= 0.0
    assert over.call_ms == 0.0  # Medusa drafts in one call whatever the tree: nothing to split
    two = MedusaDrafter(model, MedusaHeads(D, 2))  # chains deeper than its 2 heads are cut to 2, not refused
    assert math.isfinite(tc.measure_overhead(model, two, costs, prompt, new_tokens=6, repeats=1).round_ms)
    cheap = tc.auto_tree(model, drafter, ACC, costs, overhead=tc.Overhead())[0]
    dear = tc.auto_tree(model, drafter, ACC, costs, overhead=tc.Overhead(round_ms=50.0))[0]
    assert len(cheap) > 0 and len(dear) == 0


def test_measured_overhead_is_cached_per_drafter_and_remeasured_against_a_new_curve(tmp_path, monkeypatch):
    """cached_overhead measures once per key (machine + drafter), then reads the cache; it measures again
    for another draft architecture, for a changed curve (the overhead is relative to it), with refresh, and
    when the cache is damaged."""
    monkeypatch.setenv("MIDLAYER_CACHE", str(tmp_path))
    model = make_tiny(TINY, False)
    drafter = MedusaDrafter(model, MedusaHeads(D, 3))
    costs = tc.RowCosts(LINEAR.rows, LINEAR.total_ms, LINEAR.head_ms, 4)
    measured = []

    def fake(model, drafter, costs, prompt, **kw):
        measured.append(costs.total_ms)
        return tc.Overhead(float(len(measured)), 2.0, 3.0)

    monkeypatch.setattr(tc, "measure_overhead", fake)
    dirs = []
    for k in (3, 2):  # two drafts of the same kind, different architectures
        d = tmp_path / f"medusa{k}"
        d.mkdir()
        (d / "draft.json").write_text(json.dumps({"kind": "medusa", "config": {"k": k}}))
        dirs.append(d)
    key = f"{tc.cost_key('tiny', 'fp32', model)}|{tc.drafter_key(drafter, dirs[0])}"
    first = tc.cached_overhead(model, drafter, costs, [1, 2, 3], key)
    assert first == tc.Overhead(1.0, 2.0, 3.0)
    assert tc.cached_overhead(model, drafter, costs, [4, 5], key) == first and len(measured) == 1  # cached
    other = f"{tc.cost_key('tiny', 'fp32', model)}|{tc.drafter_key(drafter, dirs[1])}"
    assert other != key and tc.cached_overhead(model, drafter, costs, [1], other).plain_ms == 2.0
    assert tc.drafter_key(LayerSkipDrafter(model, [1, 2]), dirs[0]) != tc.drafter_key(drafter, dirs[0])
    slower = tc.RowCosts(costs.rows, tuple(2 * t for t in costs.total_ms), costs.head_ms, 4)
    assert tc.cached_overhead(model, drafter, slower, [1], key).plain_ms == 3.0  # a new curve: measured again
    assert tc.cached_overhead(model, drafter, slower, [1], key).plain_ms == 3.0 and len(measured) == 3
    assert tc.cached_overhead(model, drafter, slower, [1], key, refresh=True).plain_ms == 4.0
    (tmp_path / "row_costs.json").write_text("[1, 2]")  # damaged (valid JSON, not a store): measured again
    assert tc.cached_overhead(model, drafter, slower, [1], key).plain_ms == 5.0
    assert tc.cached_overhead(model, drafter, slower, [1], key).plain_ms == 5.0 and len(measured) == 5
    (tmp_path / "row_costs.json").write_bytes(b"\xff\xfe\x00garbage")  # not even UTF-8: measured again
    assert tc.cached_overhead(model, drafter, slower, [1], key).plain_ms == 6.0
    (tmp_path / "row_costs.json").unlink()
    (tmp_path / "row_costs.json").mkdir()  # a cache that can be neither read nor written: measured, not fatal
    assert tc.cached_overhead(model, drafter, slower, [1], key).plain_ms == 7.0
    assert [p.name for p in tmp_path.iterdir() if "row_costs" in p.name] == ["row_costs.json"]  # no temp file


def test_a_curve_that_disagrees_with_a_plain_token_measured_now_is_measured_again(tmp_path, monkeypatch, capsys):
    """select_tree's auto: a cached curve that gives a one-row forward more than twice what a plain token took
    when the drafter's overhead was measured (a curve timed on a busy machine) is measured again, with the
    overhead, once, and the report says so; a curve that agrees is kept, and so is one just refreshed."""
    monkeypatch.setenv("MIDLAYER_CACHE", str(tmp_path))
    model = make_tiny(TINY, False)
    drafter = MedusaDrafter(model, MedusaHeads(D, 3))
    fast = tc.RowCosts(LINEAR.rows, LINEAR.total_ms, LINEAR.head_ms, 4)
    slow = tc.RowCosts(fast.rows, tuple(10 * t for t in fast.total_ms), fast.head_ms, 4)
    one = tc.forward_ms(fast, ([1] * 4, 1))  # 12 ms by hand: the whole curve's value at one row
    assert one == pytest.approx(12.0) and tc.forward_ms(slow, ([1] * 4, 1)) == pytest.approx(120.0)
    curves, overheads = [slow], []

    def measure_curve(model, **kw):
        return curves.pop(0)

    def measure_over(model, drafter, costs, prompt, **kw):  # a plain token takes 13 ms now, whatever the curve
        overheads.append(costs)
        return tc.Overhead(13.0 - tc.forward_ms(costs, ([1] * 4, 1)), 1.0, 0.5)

    monkeypatch.setattr(tc, "measure_row_costs", measure_curve)
    monkeypatch.setattr(tc, "measure_overhead", measure_over)
    kw = dict(model_name="tiny", weights="fp32", prompt_ids=[1, 2, 3], progress=True)
    curves.append(fast)
    tree, text = tc.select_tree(model, drafter, ACC, "auto", **kw)
    assert overheads == [slow, fast] and not curves  # the slow curve, then both measured again
    assert tc.curve_drift(slow, tc.Overhead(13.0 - 120.0)) == pytest.approx(13 / 120)
    assert text.startswith("the cached row-cost curve gave a one-row forward 9.2x what a plain token took now")
    assert "note: the cached row-cost curve" in capsys.readouterr().err
    assert "+1.00 ms a plain token" in text  # priced with the fresh pair
    assert tc.select_tree(model, drafter, ACC, "auto", **kw)[1] == text.split("\n", 1)[1]  # agrees: cached
    assert len(overheads) == 2
    curves.append(slow)  # --refresh-costs: measured as asked, not checked again (it is as fresh as it gets)
    assert "measured both again" not in tc.select_tree(model, drafter, ACC, "auto", refresh=True, **kw)[1]
    assert overheads == [slow, fast, slow] and not curves


def test_drafter_key_is_the_draft_architecture_not_its_values(tmp_path):
    """A retrained draft of the same shape (other weights, other metrics) shares the overhead entry; another
    draft vocabulary size or config does not."""
    from safetensors.torch import save_file

    model = make_tiny(TINY, False)
    drafter = MedusaDrafter(model, MedusaHeads(D, 3))

    def draft(name: str, vocab: int, seed: int, acc: float, k: int = 3):
        d = tmp_path / name
        d.mkdir()
        g = torch.Generator().manual_seed(seed)
        save_file({"w": torch.randn(4, D, generator=g), "vocab": torch.arange(vocab)}, str(d / "draft.safetensors"))
        (d / "draft.json").write_text(json.dumps({"kind": "medusa", "config": {"k": k}, "meta": {"top1": acc}}))
        return tc.drafter_key(drafter, d)

    a = draft("a", 16, 0, 0.3)
    assert draft("retrained", 16, 1, 0.4) == a
    assert draft("vocab", 24, 0, 0.3) != a and draft("k2", 16, 0, 0.3, k=2) != a


def test_a_static_tree_after_a_dynamic_one_is_static():
    """dynamic:N sets an EAGLE drafter's expansion width; a later chain or sparse tree is static again (the width
    was kept, and the chain asked for was verified as a width-4 dynamic tree)."""
    class Eagleish:
        dynamic_k = 0

        def draft_steps(self) -> None:
            return None

    d, acc = Eagleish(), [[0.6, 0.2], [0.5, 0.2], [0.4, 0.1]]
    kw = dict(model_name="m", weights="fp32", prompt_ids=[1, 2])
    assert len(tc.select_tree(None, d, acc, "dynamic:6", **kw)[0]) == 6 and d.dynamic_k == 4
    chain = tc.select_tree(None, d, acc, "chain", **kw)[0]
    assert chain.paths == tc.DraftTree.chain(3).paths and d.dynamic_k == 0
    tc.select_tree(None, d, acc, "dynamic:2", **kw)
    assert d.dynamic_k == 2 and len(tc.select_tree(None, d, acc, "sparse:3", **kw)[0]) == 3 and d.dynamic_k == 0


def test_tree_specs_on_the_command_line():
    from midlayer.commands.generation import tree_nodes as _tree_nodes

    assert _tree_nodes("sparse:5") == 5 and _tree_nodes("dynamic:12") == 12
    for bad in ("sparse:0", "dynamic:x", "sparse:-3", "dynamic:"):
        with pytest.raises(ValueError, match="positive integer"):
            _tree_nodes(bad)


def test_a_damaged_cached_curve_is_measured_again(tmp_path, monkeypatch):
    """A stored curve with a NaN, a negative or infinite time, a fractional or wrong block count was used as it
    was (silently arbitrary trees, or a TypeError after minutes of bench decode): each is measured again."""
    monkeypatch.setenv("MIDLAYER_CACHE", str(tmp_path))
    model = make_tiny(TINY, False)
    good = tc.RowCosts(LINEAR.rows, LINEAR.total_ms, LINEAR.head_ms, 4)
    measured = []
    monkeypatch.setattr(tc, "measure_row_costs", lambda model, **kw: measured.append(1) or good)
    key = tc.cost_key("tiny", "fp32", model)
    assert tc.row_costs(model, "tiny", "fp32") == good and len(measured) == 1
    assert tc.row_costs(model, "tiny", "fp32") == good and len(measured) == 1  # cached
    for field, value in (("total_ms", [12.0, float("nan"), 18.0, 26.0]), ("total_ms", [12.0, -1.0, 18.0, 26.0]),
                         ("head_ms", [float("inf")] * 4), ("n_layers", 4.5), ("n_layers", 2), ("rows", [1, 2.5, 4, 8])):
        tc._save_store(tc._cache_file(), key, {**dataclasses.asdict(good), field: value})
        n = len(measured)
        assert tc.row_costs(model, "tiny", "fp32") == good and len(measured) == n + 1, (field, value)

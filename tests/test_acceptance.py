"""A round's tree on the device: its greedy acceptance (midlayer/ops/acceptance.py), a dynamic tree's rows and layout
(midlayer/ops/tree_layout.py). Their PyTorch formulas worked by hand and against the host's layout, and their
Triton kernels against the formulas on random trees. (The rounds through them: tests/test_fused_rows.py's device
rounds and trace; their build for GPUs: tests/test_row_linear.py.) On a CPU the kernels run in Triton's
interpreter (tests/conftest.py); without Triton the kernels' tests skip."""

from __future__ import annotations

import random

import pytest
import torch

from midlayer.engine.decode_step import DecodeStep
from midlayer.ops import acceptance, tree_layout
from tiny_models import make_tiny

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DIMS = dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=16, max_seq_len=16, multiple_of=16)


_STEP = {}


def _tree(parents: list[int], N: int) -> tuple[torch.Tensor, ...]:
    """(parent, is_node, vis, depth, path) of the tree whose rows 1.. have these parent rows (row 0 the root),
    as the host lays it out for a round (DecodeStep.tree_tensors) in a bucket of N rows."""
    if not _STEP:
        _STEP["step"] = DecodeStep(make_tiny(DIMS, False), max_len=8, buckets=(8, 16, 32, 64, 128))
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    t = _STEP["step"].tree_tensors([p - 1 for p in parents], depth[1:])  # (nodes: row - 1; the root's -1)
    assert t.vis.shape[0] == N
    return t.parent, t.is_node, t.vis, t.depth, t.path


def test_the_formula_by_hand():
    """Root 0 (token 7), nodes 1 and 2 under it (tokens 10, 11), 3 under 1 (12), 4 under 2 (13). The base's
    argmax is 11 at the root, 12 at row 1, 13 at row 2, 9 at row 4: node 1 is bad, so node 3 (good at its
    parent) is not on a good path; 0 -> 2 -> 4 is accepted, a = 2, with the bonus 9 (the argmax at row 4).
    Rows padded to 8, slots from 20."""
    parent, is_node, vis, depth, path = _tree([0, 0, 1, 2], 8)
    tok, target = torch.tensor([7, 10, 11, 12, 13]), torch.tensor([11, 12, 13, 5, 9])
    slots, start = torch.arange(20, 28), torch.tensor(20)
    packed, rows, src, dst, keep, best = acceptance.reference(tok, target, parent, is_node, vis, depth, path,
                                                              slots, start)
    assert packed.tolist() == [2, 11, 13, 7, 7, 9]  # (a; the path's tokens, then the root's where none; the bonus)
    assert rows.tolist() == [0, 2, 4, -1, -1] and best.tolist() == [4]
    assert src.tolist() == [20, 22, 24, 20, 20] and dst.tolist() == [20, 21, 22, 23, 24]
    assert keep.tolist() == [True, True, True, False, False]
    target[0] = 10  # both depth-1 nodes bad but node 1 good now, and its child 3 good: 0 -> 1 -> 3
    assert acceptance.reference(tok, target, parent, is_node, vis, depth, path, slots, start)[0].tolist() == \
        [2, 10, 12, 7, 7, 5]
    target[:] = 0  # nothing accepted: the root alone and the bonus at the root
    packed, rows, *_, keep, best = acceptance.reference(tok, target, parent, is_node, vis, depth, path, slots, start)
    assert packed.tolist() == [0, 7, 7, 7, 7, 0] and rows.tolist() == [0, -1, -1, -1, -1] and best.tolist() == [0]


@pytest.mark.parametrize("T,N", [(5, 8), (25, 32), (65, 128)], ids=["5-rows", "25-rows", "65-rows"])
def test_the_kernel_is_the_formula(T, N):
    """The kernel gives the formula's very results on random trees (T rows, more than one block of columns
    and a padded power of two at 25 and 65), targets drawn so that paths of several depths are accepted, at
    ties between equally deep paths too (tokens of 6 values: siblings share them)."""
    pytest.importorskip("triton")
    if not acceptance.available(DEV):
        pytest.skip("the kernel does not run here")
    rng = random.Random(T)
    depths = set()
    for trial in range(12):
        parents = [rng.randrange(r) for r in range(1, T)]  # (row r's parent comes before it)
        parent, is_node, vis, depth, path = _tree(parents, N)
        tok = torch.tensor([rng.randrange(6) for _ in range(T)])
        target = torch.tensor([rng.randrange(6) for _ in range(T)])
        for r in range(T):  # (the base agrees with one of row r's children, often: deep paths are accepted)
            children = [c for c in range(1, T) if parents[c - 1] == r]
            if children and rng.random() < 0.7:
                target[r] = tok[rng.choice(children)]
        args = [t.to(DEV) for t in (tok, target, parent, is_node, vis, depth, path, torch.arange(40, 40 + N),
                                    torch.tensor(40))]
        got, want = acceptance.accept(*args), acceptance.reference(*args)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
        depths.add(int(want[0][0]))
    assert len(depths) >= 3  # (paths of several depths accepted)


def test_the_layout_formula_is_the_hosts_layout():
    """`tree_layout.reference` from the parents alone gives the vis and path that the host builds for the same
    tree (`_tree`: DecodeStep.tree_tensors' own layout), padding rows included; worked by hand for
    the tree of `test_the_formula_by_hand`: row 3 sees 0, 1, 3 (path 0, 1, 3), row 4 sees 0, 2, 4."""
    parent, _, vis, depth, path = _tree([0, 0, 1, 2], 8)
    real = torch.arange(8) < 5
    got_vis, got_path = tree_layout.reference(parent, depth, real, 3)
    assert torch.equal(got_vis, vis) and torch.equal(got_path, path)
    assert got_vis[3].nonzero().flatten().tolist() == [0, 1, 3] and got_path[4, :4].tolist() == [0, 2, 4, -1]
    parent, _, vis, depth, path = _tree([0, 0, 1, 2, 3, 3, 5, 6, 0], 16)  # (depth 5)
    assert [torch.equal(a, b) for a, b in zip(tree_layout.reference(parent, depth, torch.arange(16) < 10, 5),
                                              (vis, path))] == [True, True]


@pytest.mark.parametrize("n,N", [(6, 8), (30, 32), (60, 64)], ids=["8-rows", "32-rows", "64-rows"])
def test_the_layout_kernel_is_the_formula(n, N):
    """The layout kernel gives the formula's very vis and path on random trees of n rows (depth up to 4, as
    EAGLE-2's D levels), padded to N."""
    pytest.importorskip("triton")
    if not tree_layout.available(DEV):
        pytest.skip("the kernel does not run here")
    rng = random.Random(n)
    for _ in range(8):
        parents, depth = [], [0]
        for r in range(1, n):
            p = rng.choice([q for q in range(r) if depth[q] < 4])
            parents.append(p)
            depth.append(depth[p] + 1)
        parent, _, _, depth_t, _ = _tree(parents, N)
        args = [t.to(DEV) for t in (parent, depth_t, torch.arange(N) < n)]
        got, want = tree_layout.layout(*args, 4), tree_layout.reference(*args, 4)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert int((want[1] >= 0).sum(1).max()) == max(depth) + 1  # (the deepest row's path: root to itself)


def test_the_rows_formula_by_hand():
    """EAGLE-2's reranking (`tree_layout.reference_rows`), k = 2, two depths. Candidates 0, 1 at depth 1
    (scores -0.5, -1); 2, 3 under 0 (-0.7, -1); 4, 5 under 1 (-1.1, -inf). The 3 best in a stable sort: 0, 2,
    then 1 (ties with 3, and comes first). In candidate order they are rows 1, 2, 3: 0 and 1 under the root,
    2 under row 1. Padded to 8 rows."""
    score = torch.tensor([-0.5, -1.0, -0.7, -1.0, -1.1, float("-inf")])
    tok, par = torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 1, 1])
    cdepth = torch.tensor([1, 1, 2, 2, 2, 2])
    nodes, parent, depth = tree_layout.reference_rows(score, tok, par, cdepth, 3, 8)
    assert nodes.tolist() == [10, 11, 12]
    assert parent.tolist() == [0, 0, 0, 1, 0, 0, 0, 0] and depth.tolist() == [0, 1, 1, 2, 0, 0, 0, 0]
    nodes, parent, depth = tree_layout.reference_rows(score, tok, par, cdepth, 6, 8)  # all: -inf is the last
    assert nodes.tolist() == [10, 11, 12, 13, 14, 15] and parent.tolist() == [0, 0, 0, 1, 1, 2, 2, 0]
    score[3] = 0.0  # a child above its parents (not a sum of log-probabilities): 3 and 0 chosen, 3 in row 2
    nodes, parent, _ = tree_layout.reference_rows(score, tok, par, cdepth, 2, 4)
    assert nodes.tolist() == [10, 13] and parent.tolist() == [0, 0, 1, 0]
    score[0] = -2.0  # 3's parent not chosen: 3 hangs from the root
    nodes, parent, _ = tree_layout.reference_rows(score, tok, par, cdepth, 2, 4)
    assert nodes.tolist() == [12, 13] and parent.tolist() == [0, 0, 0, 0]
    score[1] = score[4] = float("nan")  # NaN ranks above all (torch.sort's order), the earlier first
    nodes, parent, _ = tree_layout.reference_rows(score, tok, par, cdepth, 3, 4)
    assert nodes.tolist() == [11, 13, 14] and parent.tolist() == [0, 0, 0, 1]


def _candidates(k: int, D: int, rng: random.Random, ties: bool) -> tuple[torch.Tensor, ...]:
    """EAGLE-2's candidates as `EagleRounds.draft` lays them out: depth 1's k, then per depth k x k, the children
    of the depth above's k best (a stable sort); each scored by its parent's score plus a log-probability <= 0
    (with `ties`: from a few values, so that scores tie), some -inf."""
    def lp(m: int) -> torch.Tensor:
        x = [-rng.choice([0.0, 0.25, 0.5]) if ties else -rng.expovariate(1.0) for _ in range(m)]
        return torch.tensor([v if rng.random() > 0.05 else float("-inf") for v in x])

    scores, parents, depth, base = [lp(k)], [torch.full((k,), -1)], [torch.ones(k, dtype=torch.long)], 0
    for d in range(2, D + 1):
        last = scores[-1]
        sel = torch.sort(last, descending=True, stable=True).indices[:k]
        scores.append((last[sel][:, None] + lp(k * k).view(k, k)).reshape(-1))
        parents.append((base + sel)[:, None].expand(k, k).reshape(-1))
        depth.append(torch.full((k * k,), d))
        base += last.shape[0]
    score = torch.cat(scores)
    return score, torch.randperm(score.shape[0]), torch.cat(parents), torch.cat(depth)


@pytest.mark.parametrize("k,D,n,N", [(2, 2, 3, 8), (4, 3, 24, 32), (8, 3, 60, 64), (10, 2, 110, 128),
                                     (8, 5, 48, 64)], ids=["6-candidates", "36", "136", "110-all", "264"])
def test_the_rows_kernel_is_the_formula(k, D, n, N):
    """The reranking kernel gives the formula's very rows on EAGLE-2's candidate sets, with and without ties
    and -inf scores, and on random scores where a chosen child's parent may be left out, or some are NaN (264
    candidates: 512 in the kernel's block, 8 columns a step)."""
    pytest.importorskip("triton")
    if not tree_layout.available(DEV):
        pytest.skip("the kernel does not run here")
    rng = random.Random(k * 100 + n)
    for trial in range(6):
        score, tok, par, cdepth = _candidates(k, D, rng, ties=trial % 2 == 0)
        if trial == 5:
            score = torch.randn(score.shape[0])
            score[torch.randperm(score.shape[0])[:3]] = float("nan")  # (NaN: above all, in candidate order)
        args = [t.to(DEV) for t in (score, tok, par, cdepth)]
        got, want = tree_layout.rows(*args, n, N), tree_layout.reference_rows(*args, n, N)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), trial
        if trial < 5:  # (sums of log-probabilities: every chosen row's parent is chosen, above it)
            rows = want[1][1:n + 1]
            assert bool((rows < torch.arange(1, n + 1, device=DEV)).all())
            assert torch.equal(want[2][1:n + 1], want[2][rows] + 1)
    # three NaN scores for n = 2: NaN ranks above all in candidate order, so candidates 0 and 1 are chosen and
    # not 2, the parent of 1, which then hangs from the root (row 0) (a mutant that broke NaN ties otherwise than
    # by candidate order survived the random trials; 59th session's review)
    nan = float("nan")
    few = [t.to(DEV) for t in (torch.tensor([nan, nan, nan, -1.0]), torch.tensor([10, 11, 12, 13]),
                               torch.tensor([-1, 2, -1, 0]), torch.tensor([1, 2, 1, 2]))]
    got, want = tree_layout.rows(*few, 2, 4), tree_layout.reference_rows(*few, 2, 4)
    assert want[0].tolist() == [10, 11] and want[1].tolist() == [0, 0, 0, 0]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="candidates in"):
        tree_layout.rows(*args, n, n)
    with pytest.raises(ValueError, match="at most 2048 candidates"):
        tree_layout.rows(*(torch.zeros(2049, dtype=t.dtype, device=DEV) for t in args), n, N)

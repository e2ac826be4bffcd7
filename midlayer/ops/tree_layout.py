"""A dynamic draft tree on the device (issue 42): its rows, chosen from scored candidates, and its layout, from
its rows' parents: which rows each row sees, and its path of rows by depth. EAGLE-2's dynamic tree changes
every round, so its device rounds build both inside the round (speculative/eagle.py, `EagleRounds.draft`),
where a static tree's layout is built once on the host (`DecodeStep.tree_tensors`, the same fields).

- `reference_rows` / `rows`: EAGLE-2's reranking (Li et al. 2024, arXiv 2406.16858, sec. 4.2): the n best of
  the C candidates by score, in candidate order, as tree rows 1..n, each with its parent's row. About 15
  small PyTorch ops; one Triton kernel.
- `reference` / `layout`: the layout. 3 small kernels per level of the tree and about 6 more; one kernel.

Each kernel runs where the static step runs its kernels, and its results are its formula's exactly
(tests/test_acceptance.py): integers, and float scores only compared.
"""

from __future__ import annotations

import torch

from . import triton_build
from .triton_build import NEEDS, pow2

tl = to_bf16 = None  # triton.language and triton_build's helper, set when a kernel is first made


def available(device: torch.device | None = None) -> bool:
    """Whether the kernel runs here (triton_build.runs_on)."""
    return triton_build.runs_on(KERNELS, device)


def _layout(parent, depth, real, vis, path, N, D, NN: tl.constexpr):
    """`reference` for row r; grid (N,). Its ancestors by D steps up the parents, then its path: at column j
    the row it sees at depth j (the largest such, as `reference`'s scatter has only one), else -1."""
    r = tl.program_id(0)
    c = tl.arange(0, NN)
    m = c < N
    seen = c == r
    cur = r.to(tl.int64)  # (as the parents: a loop's variable keeps one type)
    for _ in range(0, D):
        cur = tl.load(parent + cur)
        seen = seen | (c == cur)
    seen = tl.where(tl.load(real + r).to(tl.int32) != 0, seen, c == r) & m  # (padding: itself only)
    tl.store(vis + r * N + c, seen.to(tl.int1), mask=m)
    d = tl.load(depth + c, mask=m, other=-1)
    at = tl.where(seen[None, :] & (d[None, :] == c[:, None]), c[None, :], -1)  # [column j, row c]
    tl.store(path + r * N + c, tl.max(at, axis=1), mask=m)


def _rows(score, tok, par, cdepth, nodes, parent, depth, C, n, N, CC: tl.constexpr, BJ: tl.constexpr,
          NN: tl.constexpr):
    """`reference_rows`; grid (1,). A candidate's rank is the number of candidates ahead of it in a stable
    descending sort (a higher score, or an equal one earlier; NaN above all, as torch.sort puts it). The n of
    rank below n are chosen, exactly n, as the ranks are 0..C-1 (the stores are bounded to rows 1..n all the
    same). A chosen candidate's row is the number chosen up to it, and its parent's row the number chosen up
    to the parent (when the parent is chosen; else the root, 0, as the formula's). Two passes over column
    blocks of BJ candidates: the ranks, then the counts (each block's own ranks again: nothing is written and
    read back, so no barrier is needed)."""
    c = tl.arange(0, CC)
    mc = c < C
    s = tl.load(score + c, mask=mc, other=0.0)
    p = tl.load(par + c, mask=mc, other=-1)
    rank = tl.zeros([CC], dtype=tl.int32)
    for j0 in range(0, C, BJ):
        j = j0 + tl.arange(0, BJ)
        sj = tl.load(score + j, mask=j < C, other=0.0)
        before = ahead(sj[None, :], s[:, None], j[None, :] < c[:, None])  # [CC, BJ]: j ahead of c
        rank += tl.sum((before & (j < C)[None, :]).to(tl.int32), axis=1)
    chosen = (rank < n) & mc
    row = tl.zeros([CC], dtype=tl.int32)  # chosen candidates j <= c
    prow = tl.zeros([CC], dtype=tl.int32)  # chosen j <= the parent of c
    pin = tl.zeros([CC], dtype=tl.int32)  # whether the parent of c is chosen
    for j0 in range(0, C, BJ):
        j = j0 + tl.arange(0, BJ)
        mj = j < C
        sj = tl.load(score + j, mask=mj, other=0.0)
        behind = ahead(s[None, :], sj[:, None], c[None, :] < j[:, None])  # [BJ, CC]: c ahead of j
        cj = ((tl.sum((behind & mc[None, :]).to(tl.int32), axis=1) < n) & mj).to(tl.int32)  # [BJ]: j chosen
        row += tl.sum(tl.where(j[None, :] <= c[:, None], cj[None, :], 0), axis=1)
        prow += tl.sum(tl.where(j[None, :] <= p[:, None], cj[None, :], 0), axis=1)
        pin += tl.sum(tl.where(j[None, :] == p[:, None], cj[None, :], 0), axis=1)
    chosen = chosen & (row >= 1) & (row <= n)
    tl.store(nodes + row - 1, tl.load(tok + c, mask=chosen, other=0), mask=chosen)
    tl.store(parent + row, tl.where((p >= 0) & (pin > 0), prow, 0).to(tl.int64), mask=chosen)
    tl.store(depth + row, tl.load(cdepth + c, mask=chosen, other=0), mask=chosen)
    i = tl.arange(0, NN)
    rest = (i < N) & ((i == 0) | (i > n))  # the root and the padding (rows 1..n: the chosen, each once)
    tl.store(parent + i, tl.zeros([NN], dtype=tl.int64), mask=rest)
    tl.store(depth + i, tl.zeros([NN], dtype=tl.int64), mask=rest)


def ahead(x, y, first):
    """A device helper (`ahead`): whether score x comes before score y in a stable descending sort, as
    torch.sort orders them: NaN above all, then the higher; ties (NaN with NaN too) by `first`, x's candidate
    being the earlier."""
    nx, ny = x != x, y != y
    return tl.where(nx | ny, nx & ((ny == 0) | first), (x > y) | ((x == y) & first))


KERNELS = (_layout, _rows)
HELPERS = {"ahead": ahead}  # (bound by triton_build.kernel)
MAX_CANDIDATES = 2048  # `rows`' C: EAGLE-2's k + (D - 1) k^2 up to k = 16 at depth 8 (bench static's limits)


def columns(CC: int) -> int:
    """BJ: the candidates a step of `_rows`' loops compares with all, so that [CC, BJ] stays 4,096 in registers."""
    return max(2, min(16, 4096 // CC))


def layout(parent: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, D: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference` as one kernel: the same operands, the very same results."""
    N = parent.shape[0]
    if not available(parent.device):
        raise RuntimeError(NEEDS)
    if min(t.stride(0) for t in (parent, depth, real)) != 1:
        raise ValueError("layout needs parent, depth and real contiguous")
    vis = torch.empty(N, N, dtype=torch.bool, device=parent.device)
    path = torch.empty(N, N, dtype=torch.long, device=parent.device)
    triton_build.kernel(_layout)[(N,)](parent, depth, real, vis, path, N, D, NN=pow2(N))
    return vis, path


def reference(parent: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, D: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of N rows (`DecodeStep.tree_tensors`' vis and path) from parent [N] (long: each row's parent
    row; the root's and padding's 0), depth [N] (long) and real [N] (bool; False: padding), for trees of
    depth at most D. Returns (vis [N, N] bool: row i sees row j, its ancestors-or-self, padding itself only;
    path [N, N] long: path[i, depth[j]] = j for each row j that row i sees, -1 elsewhere)."""
    N = parent.shape[0]
    rows = torch.arange(N, device=parent.device)
    eye = rows[:, None] == rows[None, :]
    vis, cur = eye, rows
    for _ in range(D):  # ancestors-or-self by D steps up the parents
        cur = parent.index_select(0, cur)
        vis = vis | (cur[:, None] == rows[None, :])
    vis = torch.where(real[:, None], vis, eye)  # padding: itself only
    at = torch.where(vis, depth[None, :].expand(N, N), N)
    path = torch.full((N, N + 1), -1, dtype=torch.long, device=parent.device).scatter(1, at, rows[None, :].expand(N, N))
    return vis, path[:, :N]


def rows(score: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, cand_depth: torch.Tensor, n: int, N: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference_rows` as one kernel: the same operands, the very same results."""
    C = score.shape[0]
    if not available(score.device):
        raise RuntimeError(NEEDS)
    if not 0 < n <= C <= MAX_CANDIDATES or N <= n:
        raise ValueError(f"rows: {n} of {C} candidates in {N} rows (at most {MAX_CANDIDATES} candidates)")
    if min(t.stride(0) for t in (score, tok, par, cand_depth)) != 1:
        raise ValueError("rows needs score, tok, par and cand_depth contiguous")
    dev = score.device
    nodes = torch.empty(n, dtype=torch.long, device=dev)
    parent, depth = torch.empty(N, dtype=torch.long, device=dev), torch.empty(N, dtype=torch.long, device=dev)
    triton_build.kernel(_rows)[(1,)](score, tok, par, cand_depth, nodes, parent, depth, C, n, N, CC=pow2(C),
                                     BJ=columns(pow2(C)), NN=pow2(N))
    return nodes, parent, depth


def reference_rows(score: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, cand_depth: torch.Tensor, n: int,
                   N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree of the n best of C candidates (module docstring), in N rows. score [C] (float; a NaN ranks above
    all, as torch.sort's): each candidate's; tok [C], cand_depth [C] (long): its token and depth; par [C]
    (long): its parent candidate, -1 for the root. The n best (a stable sort: ties in candidate order) become
    rows 1..n in candidate order. Returns (nodes [n]: their tokens; parent [N]: each row's parent row, 0 for
    the root, for padding and where the parent was not chosen; depth [N]: 0 for the root and padding)."""
    C, dev = score.shape[0], score.device
    chosen = torch.sort(torch.sort(score, descending=True, stable=True).indices[:n]).values
    row_of = torch.zeros(C, dtype=torch.long, device=dev).index_copy(0, chosen, torch.arange(1, n + 1, device=dev))
    pc = par.index_select(0, chosen)
    zero, pad = torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(N - 1 - n, dtype=torch.long, device=dev)
    parent = torch.cat([zero, torch.where(pc >= 0, row_of.index_select(0, pc.clamp_min(0)), zero), pad])
    return tok.index_select(0, chosen), parent, torch.cat([zero, cand_depth.index_select(0, chosen), pad])


def compile_for(capability: int, dtype: torch.dtype | None = None) -> list:
    """The kernels compiled ahead of time for an NVIDIA GPU of compute capability `capability`, for up to 64
    rows and 256 candidates (triton_build.compile_for: no GPU needed; tests/test_row_linear.py). Integers and
    fp32 scores: the same kernels whatever the model's `dtype`."""
    kinds = {"parent": "*i64", "depth": "*i64", "real": "*i1", "vis": "*i1", "path": "*i64", "NN": "constexpr"}
    ranks = {"score": "*fp32", "tok": "*i64", "par": "*i64", "cdepth": "*i64", "nodes": "*i64", "parent": "*i64",
             "depth": "*i64", "CC": "constexpr", "BJ": "constexpr", "NN": "constexpr"}
    return [triton_build.compile_for(_layout, capability, kinds, dict(NN=64)),
            triton_build.compile_for(_rows, capability, ranks, dict(CC=256, BJ=columns(256), NN=64))]

"""A speculative round's greedy acceptance on the device (`DecodeStep.verify_round`, issue 42): which path of
the draft tree the base model accepts, and where its rows' K/V go. `reference` is the formula in PyTorch ops
(about 30 small kernels); `accept` is the same as one Triton kernel, where the static step runs its kernels.

The rule (SpecInfer's and Medusa's tree verification, greedy: Miao et al. 2023, arXiv 2305.09781; Cai et al.
2024, arXiv 2401.10774). Row 0 is the root, rows 1.. the nodes. A node is good when its token is the base's
argmax at its parent row. The accepted path is the deepest row whose ancestors-or-self are all good (or the
root), the first in row order among equals: score depth * (T + 1) + (T - row), one row's score each. The
round commits the root and the accepted nodes (a of them) and the base's argmax at the last (the bonus). The
kept rows' K/V move to slots start, start + 1, .. (compaction), and only the first a + 1 are held.

Why a kernel. A captured round pays per kernel (the H200 replayed about 4.9 us each, docs/results/
static-step.md); this is one program that reads the tree's T rows and T x T visibility in blocks of columns.
Integers only: its results are `reference`'s exactly (tests/test_acceptance.py).
"""

from __future__ import annotations

import torch

from . import triton_build
from .triton_build import NEEDS, pow2

tl = to_bf16 = None  # triton.language (and triton_build's helper), set when the kernel is first made
COLUMNS = 16  # BJ: the visibility's columns a step of the kernel's loop reads ([TT, BJ] in registers)


def available(device: torch.device | None = None) -> bool:
    """Whether the kernel runs here (triton_build.runs_on)."""
    return triton_build.runs_on(KERNELS, device)


def _accept(tok, target, parent, is_node, vis, depth, path, slots, start,
            packed, rows, src, dst, keep, best_out, T, svis, spath,
            TT: tl.constexpr, BJ: tl.constexpr):
    """`reference` for one round; grid (1,). Row i's bad ancestors: the sum over column blocks of
    vis[i, j] * (j is not good), each column's goodness read from its own token, parent and target."""
    i = tl.arange(0, TT)
    m = i < T
    bad = tl.zeros([TT], dtype=tl.int32)
    for j0 in range(0, T, BJ):
        j = j0 + tl.arange(0, BJ)
        mj = j < T
        pj = tl.load(parent + j, mask=mj, other=0)
        good = (tl.load(is_node + j, mask=mj, other=0).to(tl.int32) != 0) & \
            (tl.load(tok + j, mask=mj, other=0) == tl.load(target + pj, mask=mj, other=-1))
        bad_j = ((good | (j == 0)) == 0) & mj
        v = tl.load(vis + i[:, None] * svis + j[None, :], mask=m[:, None] & mj[None, :], other=0).to(tl.int32)
        bad += tl.sum(tl.where(bad_j[None, :], v, 0), axis=1)
    node = tl.load(is_node + i, mask=m, other=0).to(tl.int32) != 0
    d = tl.load(depth + i, mask=m, other=0)
    score = tl.where((node | (i == 0)) & (bad == 0) & m, d * (T + 1) + (T - i), -1)
    best = tl.argmax(score, axis=0)  # (the scores of candidate rows differ: no tie)
    a = tl.load(depth + best)
    r = tl.load(path + best * spath + i, mask=m, other=-1)  # the root, the accepted nodes by depth, then -1s
    kept = tl.maximum(r, 0)
    tl.store(rows + i, r, mask=m)
    tl.store(src + i, tl.load(slots + kept, mask=m, other=0), mask=m)
    tl.store(dst + i, tl.load(start) + i, mask=m)
    tl.store(keep + i, (i <= a).to(tl.int1), mask=m)
    tl.store(packed + i, tl.load(tok + kept, mask=m, other=0), mask=m & (i >= 1))
    tl.store(packed, a)
    tl.store(packed + T, tl.load(target + best))
    tl.store(best_out, best.to(tl.int64))


KERNELS = (_accept,)


def accept(tok: torch.Tensor, target: torch.Tensor, parent: torch.Tensor, is_node: torch.Tensor, vis: torch.Tensor,
           depth: torch.Tensor, path: torch.Tensor, slots: torch.Tensor, start: torch.Tensor
           ) -> tuple[torch.Tensor, ...]:
    """`reference` as one kernel: the same operands, the very same results."""
    T = tok.shape[0]
    if not available(tok.device):
        raise RuntimeError(NEEDS)
    if vis.stride(1) != 1 or path.stride(1) != 1 or min(t.stride(0) for t in (tok, target, parent, is_node, depth,
                                                                             slots)) != 1:
        raise ValueError("accept needs its vectors and the rows of vis and path contiguous")
    dev = tok.device
    packed = torch.empty(T + 1, dtype=torch.long, device=dev)
    rows, src, dst = (torch.empty(T, dtype=torch.long, device=dev) for _ in range(3))
    keep = torch.empty(T, dtype=torch.bool, device=dev)
    best = torch.empty(1, dtype=torch.long, device=dev)
    triton_build.kernel(_accept)[(1,)](tok, target, parent, is_node, vis, depth, path, slots, start, packed, rows,
                                       src, dst, keep, best, T, vis.stride(0), path.stride(0), TT=pow2(T),
                                       BJ=COLUMNS)
    return packed, rows, src, dst, keep, best


def reference(tok: torch.Tensor, target: torch.Tensor, parent: torch.Tensor, is_node: torch.Tensor,
              vis: torch.Tensor, depth: torch.Tensor, path: torch.Tensor, slots: torch.Tensor, start: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
    """The greedy acceptance of one round (module docstring) over its T tree rows, in PyTorch ops, no host read.

    tok [T] (long): the rows' tokens; target [T] (long): the base's argmax at each row; parent, is_node,
    depth [>= T]; vis, path [>= T, >= T] (DecodeStep.tree_tensors' fields: vis[i, j] row i sees row j; path[i]
    row i's ancestors-or-self, root first, then -1); slots [>= T] (long): each row's slot; start (a long
    scalar): the root's position. Returns (packed [T + 1]: the accepted count a, the path's tokens (T - 1, the
    first a real), the bonus; rows [T]: the root and the accepted rows, then -1; src, dst [T]: the compaction's
    slots, row rows[i]'s K/V (the root's past a) to slot start + i; keep [T] (bool): i <= a, the slots held
    after it; best [1]: the accepted path's last row)."""
    T = tok.shape[0]
    idx = torch.arange(T, device=tok.device)
    node = is_node[:T]
    ok_or_root = node & (tok == target[parent[:T]]) | (idx == 0)  # the root row is always on the path
    bad = torch.matmul(vis[:T, :T].to(torch.float32), (~ok_or_root).to(torch.float32))  # bad rows on each path
    score = torch.where((node | (idx == 0)) & (bad == 0), depth[:T] * (T + 1) + (T - idx), -1)
    best = score.argmax(0, keepdim=True)  # [1]: indexed by gather / index_select (a 0-d index is a host read)
    a = depth.gather(0, best)  # [1]
    rows = path[:T, :T].index_select(0, best)[0]
    kept = rows.clamp_min(0)
    packed = torch.cat([a, tok.index_select(0, kept[1:]), target.gather(0, best)])
    return packed, rows, slots.index_select(0, kept), start + idx, idx <= a, best


def compile_for(capability: int, dtype: torch.dtype | None = None) -> list:
    """The kernel compiled ahead of time for an NVIDIA GPU of compute capability `capability`, for a round of
    up to 128 tree rows (triton_build.compile_for: no GPU needed; tests/test_row_linear.py). Integers only:
    the same kernel whatever the model's `dtype`."""
    ptr = {n: "*i64" for n in ("tok", "target", "parent", "depth", "path", "slots", "start", "packed", "rows",
                               "src", "dst", "best_out")}
    kinds = {**ptr, "is_node": "*i1", "vis": "*i1", "keep": "*i1", "TT": "constexpr", "BJ": "constexpr"}
    return [triton_build.compile_for(_accept, capability, kinds, dict(TT=128, BJ=COLUMNS))]

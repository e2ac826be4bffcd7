"""A draft tree's layout on the device, from its rows' parents (issue 42): which rows each row sees, and its
path of rows by depth. EAGLE-2's dynamic tree changes every round, so its device rounds build this inside
the round (speculative/eagle.py, `EagleRounds.draft`), where a static tree's is built once on the host
(`DecodeStep.tree_tensors`, the same fields). `reference` is the formula in PyTorch ops (3 small kernels per
level of the tree and about 6 more); `layout` is the same as one Triton kernel, where the static step runs
its kernels. Integers only: its results are `reference`'s exactly (tests/test_acceptance.py).
"""

from __future__ import annotations

import torch

from . import triton_build
from .triton_build import NEEDS, pow2

tl = to_bf16 = None  # triton.language (and triton_build's helper), set when the kernel is first made


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


KERNELS = (_layout,)


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


def compile_for(capability: int, dtype: torch.dtype | None = None) -> list:
    """The kernel compiled ahead of time for an NVIDIA GPU of compute capability `capability`, for up to 64
    rows (triton_build.compile_for: no GPU needed; tests/test_row_linear.py). Integers only: the same kernel
    whatever the model's `dtype`."""
    kinds = {"parent": "*i64", "depth": "*i64", "real": "*i1", "vis": "*i1", "path": "*i64", "NN": "constexpr"}
    return [triton_build.compile_for(_layout, capability, kinds, dict(NN=64))]

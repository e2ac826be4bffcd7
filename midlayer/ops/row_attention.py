"""Row attention: the static decode step's attention (`DecodeStep.attend`) as one Triton kernel a layer.

Each program is one (row, kv head) of a forward. It reads the row's keys in POSITION order through the
position -> slot map `keys` [B, N, S] of the step, up to the row's own position, in blocks of BS positions,
and keeps an online softmax (running max, sum and weighted sum, all fp32; Milakov and Gimelshein 2018,
arXiv 1805.02867) for the `rep` query heads that share the kv head (GQA). A row's result then depends on
its query, its position and the keys it sees, and on no other row: not on how many rows share the forward
nor on where it sits among them, and not on where its keys sit in the cache (a tree node's ancestors
need not be adjacent). The same compiled kernel runs at every bucket size, so this holds by construction
on any GPU; the step's probe still measures it (`DecodeStep.row_invariant`).

Why. The PyTorch version of `attend` is about 14 kernels a layer (the scores' GEMM, their gather into
position order, the softmax, two more GEMMs, the window's gathers, the casts); on a GPU each small kernel
costs a few microseconds even inside a CUDA graph, where the recipe's SDPA is one. Exactness: blocks past
a row's position are not visited. A visited block whose keys are all masked adds exact zeros and rescales
by exp(0) = 1, so visiting more or fewer of them would not change a bit either.

Triton is optional (triton_build.py). On a CPU the same kernel source runs in Triton's interpreter (numpy, slow):
what the tests use to check it against the naive formula and the step's losslessness; `DecodeStep` tries this
attention on CUDA only.
"""

from __future__ import annotations

import math

import torch

from . import triton_build
from .triton_build import NEEDS, pow2

BLOCK_POSITIONS = 32  # BS: positions per step of a program's loop (a [rep, BS, d] product lives in registers)
tl = to_bf16 = None  # triton.language and triton_build's helper, set when the kernel is first made


def available(device: torch.device | None = None) -> bool:
    """Whether the kernel runs here: Triton imports, and for `device` (when given) it runs there (CUDA
    compiled; a CPU only under Triton's interpreter, TRITON_INTERPRET=1 before triton's import)."""
    return triton_build.runs_on(_attend_rows, device)


def _attend_rows(q, k, v, keys, kmask, last, out,
                 sqb, sqn, sqh, skb, skh, sks, svb, svh, svs, sxb, sxn, smb, smn, sob, son, soh,
                 N, rep, d, scale,
                 REP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BF16: tl.constexpr):
    """The kernel (module docstring); grid (B * N, Hk). (At module level: Triton resolves `tl` through the
    function's globals, and the interpreter swaps in its own there.)"""
    row = tl.program_id(0)  # b * N + n
    hk = tl.program_id(1)
    b = row // N
    n = row % N
    r = tl.arange(0, REP)
    dd = tl.arange(0, D)
    rm = r < rep
    dm = dd < d
    heads = hk * rep + r
    qv = tl.load(q + b * sqb + n * sqn + heads[:, None] * sqh + dd[None, :], mask=rm[:, None] & dm[None, :],
                 other=0.0).to(tl.float32)  # [REP, D]
    m = tl.full([REP], -1.0e30, tl.float32)  # (finite: a first block with no visible key gives no NaN)
    total = tl.zeros([REP], tl.float32)
    acc = tl.zeros([REP, D], tl.float32)
    hi = tl.load(last + row).to(tl.int32)  # the row's position: every later position is masked for it
    for j0 in range(0, hi + 1, BS):
        j = j0 + tl.arange(0, BS)
        jm = j <= hi
        slot = tl.load(keys + b * sxb + n * sxn + j, mask=jm, other=0)
        km = tl.load(kmask + b * smb + n * smn + j, mask=jm, other=float("-inf"))
        kd = tl.load(k + b * skb + hk * skh + slot[:, None] * sks + dd[None, :], mask=dm[None, :],
                     other=0.0).to(tl.float32)  # [BS, D]
        s = tl.sum(qv[:, None, :] * kd[None, :, :], axis=2) * scale + km[None, :]  # [REP, BS]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        vd = tl.load(v + b * svb + hk * svh + slot[:, None] * svs + dd[None, :], mask=dm[None, :],
                     other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vd[None, :, :], axis=1)
        m = m_new
    res = acc / total[:, None]
    if BF16:  # (the output in bf16, rounded once: the bits of the fp32 result cast by PyTorch)
        res = to_bf16(res)
    tl.store(out + b * sob + n * son + heads[:, None] * soh + dd[None, :], res, mask=rm[:, None] & dm[None, :])


def row_attention(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, keys: torch.Tensor, kmask: torch.Tensor,
                  positions: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v per row, over its keys in position order (module docstring).

    q [B, H, N, d] (any strides with d contiguous), kl, vl [B, Hk, S, d] the cache layer, keys [B, N, S]
    (long: the slot holding row i's key at position p), kmask [B, N, S] (fp32, 0 or -inf by position),
    positions [B, N] (long: each row's own). Returns [B, N, H, d] (`out` if given), computed in fp32 and
    stored in `dtype` (fp32 or bf16: the fp32 result rounded once, to nearest even)."""
    B, H, N, d = q.shape
    Hk = kl.shape[1]
    rep = H // Hk
    if out is None:
        out = torch.empty(B, N, H, d, device=q.device, dtype=dtype)
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"row_attention stores fp32 or bf16, not {out.dtype}")
    if not available(q.device):
        raise RuntimeError(NEEDS)
    kernel = triton_build.kernel(_attend_rows)
    sq, sk, sv, sx, sm, so = q.stride(), kl.stride(), vl.stride(), keys.stride(), kmask.stride(), out.stride()
    if min(sq[3], sk[3], sv[3], sx[2], sm[2], so[3]) != 1 or max(sq[3], sk[3], sv[3], sx[2], sm[2], so[3]) != 1:
        raise ValueError("row_attention needs the last dimension of every operand contiguous")
    kernel[(B * N, Hk)](q, kl, vl, keys, kmask, positions.reshape(B * N), out,
                        sq[0], sq[2], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sx[0], sx[1], sm[0], sm[1],
                        so[0], so[1], so[2], N, rep, d, 1.0 / math.sqrt(d),
                        REP=max(pow2(rep), 2), D=pow2(d), BS=BLOCK_POSITIONS, BF16=out.dtype == torch.bfloat16)
    return out


def self_check(device: torch.device, dtype: torch.dtype, H: int = 9, Hk: int = 3, d: int = 64, seed: int = 0
               ) -> float:
    """The kernel's largest difference from `reference` on `device` on a random forward (rows at other slots
    than their positions, padding, GQA): what the step's probe, which compares a row's bits across buckets
    and not its value, cannot see. A correct kernel is within fp32 rounding (about 1e-6 here)."""
    g = torch.Generator().manual_seed(seed)
    N, S = 8, 100
    q = torch.randn(1, N, H, d, generator=g).to(device, dtype).transpose(1, 2)
    kl, vl = (torch.randn(1, Hk, S, d, generator=g).to(device, dtype) for _ in range(2))
    pos = torch.tensor([[60, 61, 61, 62, 63, 0, 0, 0]], device=device)
    keys = torch.arange(S, device=device).expand(1, N, S).clone()
    keys[0, :5, 60:64] = torch.arange(80, 84, device=device)  # (the tree's rows at slots 80..)
    kmask = torch.where(torch.arange(S, device=device)[None, None] <= pos[..., None], 0.0, float("-inf"))
    out = row_attention(q, kl, vl, keys, kmask, pos)
    return float((out.double() - reference(q, kl, vl, keys, kmask)).abs().max())


def compile_for(capability: int, dtype: torch.dtype, rep: int = 3, d: int = 64):
    """The kernel compiled ahead of time for an NVIDIA GPU of compute capability `capability` with `dtype`
    operands and output (triton_build.compile_for: no GPU needed; tests/test_row_linear.py)."""
    t = triton_build.TYPES[dtype]
    kinds = dict(q=f"*{t}", k=f"*{t}", v=f"*{t}", keys="*i64", kmask="*fp32", last="*i64", out="*fp32",
                 scale="fp32", REP="constexpr", D="constexpr", BS="constexpr", BF16="constexpr")
    return triton_build.compile_for(_attend_rows, capability, kinds,
                                    dict(REP=max(pow2(rep), 2), D=pow2(d), BS=BLOCK_POSITIONS, BF16=dtype == torch.bfloat16))


def reference(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, keys: torch.Tensor, kmask: torch.Tensor
              ) -> torch.Tensor:
    """The naive formula the kernel computes, in fp64 (for tests): each row's keys and values gathered into
    position order, then softmax(q k^T / sqrt(d) + mask) v. Returns [B, N, H, d] fp64."""
    B, H, N, d = q.shape
    Hk, S = kl.shape[1], kl.shape[2]
    rep = H // Hk
    idx = keys[:, None, :, :, None].expand(B, Hk, N, S, d)
    kp = kl.double()[:, :, None].expand(B, Hk, N, S, d).gather(3, idx)  # [B, Hk, N, S, d]
    vp = vl.double()[:, :, None].expand(B, Hk, N, S, d).gather(3, idx)
    qg = q.double().view(B, Hk, rep, N, d)
    s = torch.einsum("bhrnd,bhnsd->bhrns", qg, kp) / math.sqrt(d) + kmask.double()[:, None, None]
    o = torch.einsum("bhrns,bhnsd->bhrnd", s.softmax(-1), vp)  # [B, Hk, rep, N, d]
    return o.reshape(B, H, N, d).transpose(1, 2)

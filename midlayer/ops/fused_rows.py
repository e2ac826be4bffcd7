"""The static decode step's row-wise kernels (Triton): RMSNorm (alone, or with the residual add before it),
SwiGLU's gate product, and RoPE with the K/V store, each one kernel where PyTorch's ops launch several (issue 42).

Why. A captured step pays per kernel it launches: the H200 replayed our bf16 step's 890 kernels in 4.32 ms,
about 4.9 us each, where transformers' compiled recipe takes 1.54 ms (docs/results/static-step.md). Counted
on the CPU (`benchmarks/step_kernels.py`'s op counter, SmolLM2 bf16, the row-attention kernel), a block
launched about 26 kernels on CUDA: each RMSNorm 4 (the input and the weight widened, the norm, the cast
back), RoPE 6 (neg, cat, two products, the sum, the cast) and its K/V store 2, SwiGLU's product 2. Here they
are 1 each: a block of 12.

Each is row-wise: a row's result reads that row alone, in a fixed order, so a row's bits do not depend on the
rows beside it (the step's row invariance holds by construction). The arithmetic is the PyTorch path's
formula in fp32, rounded once to the output's dtype (to nearest even, in integer ops: `triton_build.to_bf16`).
`active()` turns them on for a forward: `DecodeStep` runs its forwards inside it when it attends through the
row-attention kernel, and `RMSNorm`, `FeedForward` and `Attention` (through the step's view,
`StaticView.rope_attention`) take them where `applies`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch

from . import triton_build
from .triton_build import as_rows, pow2

tl = to_bf16 = swiglu = rope = None  # triton.language and triton_build's helpers, set when a kernel is first made
_ACTIVE = False
PROLOGUES = False  # inside `active(linear=True)`: read first by the model's hot paths (no call)


@contextlib.contextmanager
def active(linear: bool = False) -> Iterator[None]:
    """Within it, `applies` says yes to tensors on a device where the kernels run (inference only). linear: the
    forward's linears run the row-linear kernel too (`DecodeStep(linear="triton")`), so SwiGLU's product and
    the norms before a projection are that kernel's prologue (`fuses_linear`), not kernels of their own."""
    global _ACTIVE, PROLOGUES
    before = _ACTIVE, PROLOGUES
    _ACTIVE, PROLOGUES = True, linear
    try:
        yield
    finally:
        _ACTIVE, PROLOGUES = before


def fuses_linear(x: torch.Tensor, linear: torch.nn.Module | None) -> bool:
    """Whether the op before `linear` (an nn.Linear without bias, in x's dtype) is the row-linear kernel's
    prologue, one kernel with it (row_linear.swiglu_linear, row_linear.norm_linear): inside
    `active(linear=True)`, where `applies(x)`."""
    return (PROLOGUES and isinstance(linear, torch.nn.Linear) and linear.bias is None and applies(x)
            and linear.weight.dtype == x.dtype)


def available(device: torch.device | None = None) -> bool:
    """Whether the kernels run here (triton_build.runs_on; all four made here, before any forward is traced)."""
    return triton_build.runs_on(KERNELS, device)


def applies(x: torch.Tensor) -> bool:
    """Whether a module's forward takes these kernels for x: inside `active()`, without autograd, for fp32 or
    bf16, where Triton runs on x's device."""
    return _ACTIVE and not torch.is_grad_enabled() and x.dtype in triton_build.TYPES and available(x.device)


def stores_into(x: torch.Tensor, kc: torch.Tensor) -> bool:
    """Whether `rope_store` takes the rows x into the cache layer kc (a cache view's `fuses_rope`): the kernels
    apply to x, the cache holds x's dtype, and the head size is even (rotate-half)."""
    return applies(x) and kc.dtype == x.dtype and kc.shape[-1] % 2 == 0


# ------------------------------------------------------------------------------------------------ kernels
def _rms_norm_rows(x, w, y, D, sx, sy, eps, BD: tl.constexpr, BF16: tl.constexpr):
    """y = (x * rsqrt(mean(x^2) + eps)) * w per row (layers.RMSNorm's formula, in fp32); grid (rows,)."""
    row = tl.program_id(0)
    d = tl.arange(0, BD)
    m = d < D
    xv = tl.load(x + row * sx + d, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / D + eps)
    out = xv * r * tl.load(w + d, mask=m, other=0.0).to(tl.float32)
    if BF16:
        out = to_bf16(out)
    tl.store(y + row * sy + d, out, mask=m)


def _add_rms_norm_rows(x, a, w, h, y, D, sx, sa, sh, sy, eps, BD: tl.constexpr, BF16: tl.constexpr):
    """h = x + a (the residual, rounded to its dtype as PyTorch's add rounds it), y = RMSNorm(h) as
    `_rms_norm_rows`; grid (rows,)."""
    row = tl.program_id(0)
    d = tl.arange(0, BD)
    m = d < D
    hv = tl.load(x + row * sx + d, mask=m, other=0.0).to(tl.float32) + tl.load(a + row * sa + d, mask=m,
                                                                               other=0.0).to(tl.float32)
    if BF16:
        hv = to_bf16(hv)
        tl.store(h + row * sh + d, hv, mask=m)
        hv = hv.to(tl.float32)
    else:
        tl.store(h + row * sh + d, hv, mask=m)
    r = 1.0 / tl.sqrt(tl.sum(hv * hv, axis=0) / D + eps)
    out = hv * r * tl.load(w + d, mask=m, other=0.0).to(tl.float32)
    if BF16:
        out = to_bf16(out)
    tl.store(y + row * sy + d, out, mask=m)


def _silu_mul_rows(ab, y, Hd, sab, sy, BH: tl.constexpr, BF16: tl.constexpr):
    """y = silu(a) * b for ab = [a | b] per row (FeedForward's SwiGLU, in fp32); grid (rows, cdiv(Hd, BH))."""
    row = tl.program_id(0)
    j = tl.program_id(1) * BH + tl.arange(0, BH)
    m = j < Hd
    a = tl.load(ab + row * sab + j, mask=m, other=0.0).to(tl.float32)
    b = tl.load(ab + row * sab + Hd + j, mask=m, other=0.0).to(tl.float32)
    out = swiglu(a, b)
    if BF16:
        out = to_bf16(out)
    tl.store(y + row * sy + j, out, mask=m)


def _rope_store_rows(qkv, cos, sin, q, kc, vc, slots, N, H, Hk, d,
                     sxb, sxn, scb, scn, sqb, sqn, sqh, skb, skh, sks, svb, svh, svs, ssb,
                     HH: tl.constexpr, D: tl.constexpr, BF16: tl.constexpr):
    """One row of the fused q|k|v projection [H + 2 Hk heads, d]: q and k rotated by RoPE (x cos +
    rotate_half(x) sin, rotate_half(x) = [-x2, x1]: attention.apply_rope), q to `q` [B, N, H, d], k and v to
    the cache layer kc, vc [B, Hk, S, d] at the row's slot; grid (B * N,)."""
    row = tl.program_id(0)
    b = row // N
    n = row % N
    h = tl.arange(0, HH)[:, None]
    dd = tl.arange(0, D)[None, :]
    half = d // 2
    ok = (h < H + 2 * Hk) & (dd < d)
    base = qkv + b * sxb + n * sxn + h * d
    x = tl.load(base + dd, mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(base + tl.where(dd < half, dd + half, dd - half), mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos + b * scb + n * scn + dd, mask=dd < d, other=0.0)
    s = tl.load(sin + b * scb + n * scn + dd, mask=dd < d, other=0.0)
    rot = rope(x, tl.where(dd < half, -partner, partner), c, s)
    out = tl.where(h < H + Hk, rot, x)  # (v is not rotated)
    if BF16:
        out = to_bf16(out)
    slot = tl.load(slots + b * ssb + n)
    tl.store(q + b * sqb + n * sqn + h * sqh + dd, out, mask=ok & (h < H))
    hk = h - H
    tl.store(kc + b * skb + hk * skh + slot * sks + dd, out, mask=ok & (h >= H) & (h < H + Hk))
    hv = h - H - Hk
    tl.store(vc + b * svb + hv * svh + slot * svs + dd, out, mask=ok & (h >= H + Hk))


KERNELS = (_rms_norm_rows, _add_rms_norm_rows, _silu_mul_rows, _rope_store_rows)


# ------------------------------------------------------------------------------------------------ launches
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm's formula over x's last dimension as one kernel; x's dtype out."""
    x2 = as_rows(x)
    y = torch.empty_like(x2)
    D = x2.shape[1]
    triton_build.kernel(_rms_norm_rows)[(x2.shape[0],)](x2, weight, y, D, x2.stride(0), y.stride(0), float(eps),
                                                      BD=pow2(D), BF16=x.dtype == torch.bfloat16)
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + a, RMSNorm(h)) as one kernel: a block's residual add and the norm after it (model.Block). h
    has the bits of PyTorch's x + a; the norm those of `rms_norm(h)`."""
    x2, a2 = as_rows(x), as_rows(a)
    h, y = torch.empty_like(x2), torch.empty_like(x2)
    D = x2.shape[1]
    triton_build.kernel(_add_rms_norm_rows)[(x2.shape[0],)](
        x2, a2, weight, h, y, D, x2.stride(0), a2.stride(0), h.stride(0), y.stride(0), float(eps), BD=pow2(D),
        BF16=x.dtype == torch.bfloat16)
    return h.view(x.shape), y.view(x.shape)


def silu_mul(ab: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for ab = [a | b] over the last dimension, as one kernel; ab's dtype out, [..., Hd]."""
    x2 = as_rows(ab)
    Hd = x2.shape[1] // 2
    y = torch.empty(x2.shape[0], Hd, device=ab.device, dtype=ab.dtype)
    BH = min(pow2(Hd), 1024)
    triton_build.kernel(_silu_mul_rows)[(x2.shape[0], triton_build.cdiv(Hd, BH))](
        x2, y, Hd, x2.stride(0), y.stride(0), BH=BH, BF16=ab.dtype == torch.bfloat16)
    return y.view(*ab.shape[:-1], Hd)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, kc: torch.Tensor,
               vc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k of qkv [B, N, H + 2 Hk, d] (cos, sin [B, N, d] fp32), k and v stored in the cache layer
    kc, vc [B, Hk, S, d] (qkv's dtype) at slots [B, N]; returns the rotated q [B, N, H, d] in qkv's dtype."""
    B, N, HH, d = qkv.shape
    Hk = kc.shape[1]
    if HH != n_heads + 2 * Hk or d % 2 or kc.dtype != qkv.dtype or vc.dtype != qkv.dtype:
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)} {qkv.dtype}, {n_heads} query heads, cache "
                         f"{tuple(kc.shape)} {kc.dtype}: want H + 2 Hk heads of an even size, the cache in qkv's dtype")
    q = torch.empty(B, N, n_heads, d, device=qkv.device, dtype=qkv.dtype)
    sx, sc, sq, sk, sv = qkv.stride(), cos.stride(), q.stride(), kc.stride(), vc.stride()
    if qkv.stride(3) != 1 or cos.stride(2) != 1 or sin.stride() != sc or kc.stride(3) != 1 or vc.stride(3) != 1:
        raise ValueError("rope_store needs the head dimension of qkv, cos, sin and the cache contiguous, and "
                         "cos and sin alike")
    triton_build.kernel(_rope_store_rows)[(B * N,)](
        qkv, cos, sin, q, kc, vc, slots, N, n_heads, Hk, d, sx[0], sx[1], sc[0], sc[1], sq[0], sq[1], sq[2],
        sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], slots.stride(0),
        HH=pow2(HH), D=pow2(d), BF16=qkv.dtype == torch.bfloat16)
    return q


# ------------------------------------------------------------------------------------------ references
class RopeStore(NamedTuple):
    """What `rope_store` takes beside q|k|v, for a kernel that makes q|k|v and rotates and stores it in one go
    (row_linear.norm_linear's epilogue): cos, sin [B, N, d] fp32, the query heads' count, the cache layer kc,
    vc [B, Hk, S, d] and the rows' slots [B, N] (a cache view's `rope_targets`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    n_heads: int
    kc: torch.Tensor
    vc: torch.Tensor
    slots: torch.Tensor


def reference_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, kc: torch.Tensor,
                         vc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`rope_store` in PyTorch ops, naively: attention.apply_rope's formula (the products and the sum in fp32,
    one rounding to qkv's dtype), then decode_step.StaticView's store. (For the self-check and the tests: the
    model's own apply_rope is checked against it there.)"""
    B, N = slots.shape
    Hk, d2 = kc.shape[1], qkv.shape[-1] // 2
    x = qkv[:, :, :n_heads + Hk]
    rotated = torch.cat([-x[..., d2:], x[..., :d2]], -1)
    qk = (x * cos[:, :, None] + rotated * sin[:, :, None]).to(qkv.dtype)
    rows = torch.arange(B, device=qkv.device)[:, None].expand(B, N)
    kc[rows, :, slots] = qk[:, :, n_heads:].to(kc.dtype)
    vc[rows, :, slots] = qkv[:, :, n_heads + Hk:].to(vc.dtype)
    return qk[:, :, :n_heads]


def self_check(device: torch.device, dtype: torch.dtype, seed: int = 0) -> float:
    """The kernels' largest difference from their PyTorch formulas on `device` (in fp64 from the same operands),
    relative to the output's scale: rows of an odd width, SmolLM2's 9 + 2 x 3 heads of 64, two rows at one
    slot (padding: which of them lands there does not matter, and it is not compared). Within one rounding of
    `dtype` when correct (the tolerance is decode_step.SELF_CHECKS)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    def off(got, want):
        return float((got.double() - want.double()).abs().max() / want.double().abs().max())

    x, w = rand(5, 70), rand(70)
    xd = x.double()
    worst = off(rms_norm(x, w, 1e-5), xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double())
    a = rand(5, 70)
    h, y = add_rms_norm(x, a, w, 1e-5)
    hd = (xd + a.double()).to(dtype).double()  # (the residual rounds as PyTorch's add)
    worst = max(worst, off(h, hd), off(y, hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()))
    ab = rand(5, 2 * 45)
    a, b = ab.double().chunk(2, -1)
    worst = max(worst, off(silu_mul(ab), torch.nn.functional.silu(a) * b))
    qkv, cos, sin = rand(1, 4, 15, 64), torch.randn(1, 4, 64, generator=g).to(device), \
        torch.randn(1, 4, 64, generator=g).to(device)
    kc, vc = rand(1, 3, 20, 64), rand(1, 3, 20, 64)
    slots = torch.tensor([[11, 5, 19, 19]], device=device)
    q = rope_store(qkv, cos, sin, 9, kc, vc, slots)
    kr, vr = kc.double().clone(), vc.double().clone()
    qr = reference_rope_store(qkv.double(), cos.double(), sin.double(), 9, kr, vr, slots)
    return max(worst, off(q, qr), off(kc[:, :, :19], kr[:, :, :19]), off(vc[:, :, :19], vr[:, :, :19]))


def compile_for(capability: int, dtype: torch.dtype) -> list:
    """The kernels compiled ahead of time for an NVIDIA GPU of compute capability `capability` with
    `dtype` rows at SmolLM2's shapes (triton_build.compile_for: no GPU needed; tests/test_fused_rows.py)."""
    t = triton_build.TYPES[dtype]
    bf = dtype == torch.bfloat16
    ptr = {n: f"*{t}" for n in ("x", "a", "h", "w", "y", "ab", "qkv", "q", "kc", "vc")}
    kinds = {**ptr, "eps": "fp32", "cos": "*fp32", "sin": "*fp32", "slots": "*i64"}
    return [triton_build.compile_for(fn, capability, {**kinds, **{n: "constexpr" for n in const}}, const)
            for fn, const in ((_rms_norm_rows, dict(BD=1024, BF16=bf)), (_add_rms_norm_rows, dict(BD=1024, BF16=bf)),
                              (_silu_mul_rows, dict(BH=1024, BF16=bf)),
                              (_rope_store_rows, dict(HH=16, D=64, BF16=bf)))]

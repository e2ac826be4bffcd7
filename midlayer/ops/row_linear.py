"""Row linear: y = x W^T (+ b) as one Triton kernel whose result for a row does not depend on how many rows share
the call, for the static decode step (issue 42).

Why. Speculative decoding is lossless only if a row's logits are the same bits in a verification round of
many rows as in plain decoding's one. cuBLAS chooses its GEMM by the row count M (tile shapes, split-K), and on
an H200 its fp32 GEMMs gave a row other bits at other M: the static step's probe then found no bucket set but
the single bucket of 256 rows, so fp32 plain decoding ran 256 rows a token (7.15 ms against the recipe's 3.51;
docs/results/static-step.md).

How. Every M runs the same program: tiles of BM x BN outputs, BM fixed, each reducing over K in blocks of BK in
increasing order, a row's outputs read from its own row of x alone. Which tile a row lands in, and how many
tiles there are, changes which program computes it, not how; M is not specialised on (`do_not_specialize`),
so M = 1 and M = 16 run one compiled program.
  * On a GPU, `tl.dot` with input_precision="ieee": in Triton's lowering for fp32 one FMA chain per output,
    over k in order (the PTX has fma.rn.f32 and no mma). The step's probe measures the compiled kernel's
    invariance on the device, as it measures cuBLAS's.
  * Under Triton's interpreter `tl.dot` is numpy's matmul, whose BLAS rounded a row by its place in the tile
    on this CPU, so there the kernel multiplies and sums explicitly (DOT false): the same formula,
    row-invariant in numpy, and what the CPU's tests check.

Arithmetic. fp32: IEEE fp32 products (no TF32, as PyTorch's default for fp32 matmuls), accumulated in fp32.
bf16: on a GPU, bf16 tensor-core MMAs accumulating in fp32, the arithmetic of cuBLAS's bf16 GEMMs (63rd session:
the 62nd session's bf16 step through this kernel with fp32 FMAs took 4.02 ms a token on the H200 against 1.24 with
cuBLAS's linears, and the kernel is the probe's fallback where cuBLAS's bf16 linear sums a lone row in another
order); the operand is bf16 already (each prologue rounds it), so nothing is rounded on the way in. A row's bits
stay its own: the tile is the same at every M, and each output's MMAs run over K in order. Under the interpreter
(which cannot multiply bf16) both dtypes are multiplied in fp32 and summed explicitly, the same products (bf16's
are exact in fp32). The result is rounded to bf16 once, to nearest even, as cuBLAS does. `RowLinears` routes a
forward's `F.linear` calls (every nn.Linear's) here; `DecodeStep(linear="triton")` runs its forwards under it.

Prologues and an epilogue. A captured step pays per kernel, so what comes before a projection is the kernel's
prologue where the model asks (`fused_rows.fuses_linear`): SwiGLU's product before the down projection
(`swiglu_linear`, the very bits of the SwiGLU kernel then this one), and a norm with the residual add before
it (`norm_linear`: the attention's q|k|v and the FFN's first projection). After q|k|v, RoPE and the K/V store
are its epilogue (`norm_linear(rope=)`, the very bits of fused_rows.rope_store after it): one program per
head keeps both halves of the head, so each column's partner in rotate_half is at hand. With the attention in
one launch (row_attention.py), a SmolLM2 step is 5 kernels a block, 168 in all, where it was 228 in the 47th
session and 318 with cuBLAS's linears (benchmarks/step_kernels.py --rounds both).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from . import fused_rows, triton_build
from .triton_build import NEEDS, as_rows, pow2

BM = 16  # the tile's rows (tl.dot's least)
BN, BK = 32, 64  # the default tile's outputs a program (BN) and its blocks over K (BK): `tile`
# per weight shape (N, K), a tile (BN, BK) other than the default: a choice measured on the device
# (benchmarks/triton_kernels.py --tiles), given as MIDLAYER_ROW_TILES="NxK=BNxBK,...", set here, or `MEASURED`'s
TILES: dict[tuple[int, int], tuple[int, int]] = {}
tl = to_bf16 = swiglu = rope = None  # triton.language and the kernels' helpers, set when first made


def parse_tiles(spec: str) -> dict[tuple[int, int], tuple[int, int]]:
    """MIDLAYER_ROW_TILES's form, "NxK=BNxBK,...", as {(N, K): (BN, BK)}; BN and BK powers of two of at least 16
    (tl.dot's least). A clear error for anything else."""
    tiles = {}
    for item in filter(None, (i.strip() for i in spec.split(","))):
        try:
            shape, t = item.split("=")
            (n, k), (bn, bk) = (tuple(int(v) for v in side.split("x")) for side in (shape, t))
        except ValueError:
            raise ValueError(f"row tiles: {item!r} is not NxK=BNxBK (e.g. 576x1536=16x128)") from None
        if min(n, k) < 1 or any(v < 16 or v & (v - 1) for v in (bn, bk)):
            raise ValueError(f"row tiles: {item!r}: N and K positive, BN and BK powers of two of at least 16")
        tiles[(n, k)] = (bn, bk)
    return tiles


def format_tiles(tiles: dict[tuple[int, int], tuple[int, int]]) -> str:
    """{(N, K): (BN, BK)} in MIDLAYER_ROW_TILES's form, what `parse_tiles` reads back."""
    return ",".join(f"{n}x{k}={bn}x{bk}" for (n, k), (bn, bk) in tiles.items())


# a malformed MIDLAYER_ROW_TILES is refused by the first launch (`tile`), not at import, which every command does
_TILES_ERROR = ""
try:
    TILES.update(parse_tiles(os.environ.get("MIDLAYER_ROW_TILES", "")))
except ValueError as e:
    _TILES_ERROR = f"MIDLAYER_ROW_TILES: {e}"
# Tiles measured on a GPU, by its compute capability: what `available` fills TILES with for a shape that
# MIDLAYER_ROW_TILES leaves out. (9, 0): the H200's sweep of SmolLM2's shapes (62nd session, docs/results/
# static-step-h200/run5/kernels.txt; H100 and H200 alike have 132 SMs): q|k|v at 0.58 of the default's time,
# the head at 0.55, wo 0.81, w2 0.83, w1|w3 0.92. Without them SmolLM2's fp32 step there would take about 5.4 ms
# a token where it took 3.79 (the sweep's one-row times, summed over a step's linears), the recipe 3.53.
MEASURED: dict[tuple[int, int], dict[tuple[int, int], tuple[int, int]]] = {
    (9, 0): parse_tiles("960x576=16x64,576x576=16x64,3072x576=64x64,576x1536=16x128,49152x576=64x64")}
_measured_for: set = set()  # the CUDA devices whose MEASURED tiles are in TILES (once: a process's TILES is one)


def tile(N: int, K: int) -> tuple[int, int]:
    """The tile (BN, BK) of a weight [N, K]: `TILES`'s, else the default. Which tile changes which program
    computes an output and how the kernel walks K, never M's part: a row's bits stay its own at any tile
    (and on a GPU in fp32, whose tl.dot is one FMA chain per output over k in order, the product's bits are the
    same at every tile; bf16's MMAs may group the sum by the tile; the norm prologue's mean square is summed in
    blocks of BK). A malformed MIDLAYER_ROW_TILES is refused here, naming the variable."""
    if _TILES_ERROR:
        raise ValueError(_TILES_ERROR)
    return TILES.get((N, K), (BN, BK))


def available(device: torch.device | None = None) -> bool:
    """Whether the kernel runs here (triton_build.runs_on; made here, before any forward is traced). On a CUDA
    device seen the first time, `MEASURED`'s tiles for its compute capability join TILES where it has none for
    that shape (the step's construction asks first, outside any trace)."""
    ok = triton_build.runs_on(KERNELS, device)
    if ok and device is not None and device.type == "cuda" and device.index not in _measured_for:
        _measured_for.add(device.index)
        for shape, t in MEASURED.get(tuple(torch.cuda.get_device_capability(device)), {}).items():
            TILES.setdefault(shape, t)
    return ok


@triton_build.options(do_not_specialize=["M"])  # (one compiled program at every row count: module docstring)
def _linear_rows(x, w, b, y, a2, g, h, M, N, K, sxm, swn, sym, sam, shm, eps, HAS_BIAS: tl.constexpr,
                 BF16: tl.constexpr, DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SWIGLU: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr):
    """The kernel (module docstring); grid (cdiv(M, BM), cdiv(N, BN)). Its operand, by prologue:
    - SWIGLU: x's rows are [a | b], 2K wide, and the operand is SwiGLU's silu(a) * b, rounded to the dtype as
      fused_rows.silu_mul stores it (the FFN's down projection: `swiglu_linear`);
    - NORM: RMSNorm(x) with weight g and eps, in RMSNorm's formula (x * rsqrt(mean(x^2) + eps) * g, in fp32,
      rounded to the dtype); with ADD, of x + a2, the residual sum, which the programs of the first column of
      outputs also store to h (`norm_linear`). Each row's mean square is a first pass over its K in blocks of
      BK, in order: a row's bits still depend on that row alone.
    (At module level: Triton resolves `tl` through the function's globals.)"""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    r = 1.0
    if NORM:
        r = norm_scale(x, a2, h, rm, rk, tl.program_id(1), sxm, sam, shm, M, K, eps, ADD, BF16, BM, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        a = operand(x, a2, g, r, rm, k0 + rk, sxm, sam, M, K, NORM, ADD, SWIGLU, BF16)
        acc = accumulate(acc, a, w, rn, rn < N, k0 + rk, swn, K, DOT, BF16)
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = acc
    if BF16:
        out = to_bf16(acc)
    tl.store(y + rm[:, None] * sym + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton_build.options(do_not_specialize=["M"])
def _qkv_rope_rows(x, w, a2, g, h, cos, sin, q, kc, vc, slots, M, R, K, H, Hk, d, P, sxm, swn, sam, shm, eps,
                   scb, scn, sqm, sqh, skb, skh, sks, svb, svh, svs, ssb, BF16: tl.constexpr, DOT: tl.constexpr,
                   BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, ADD: tl.constexpr):
    """The NORM kernel above with RoPE and the K/V store as its epilogue (`norm_linear(rope=)`); grid
    (cdiv(M, BM), (H + 2 Hk) P): P programs per BM rows and head of the fused q|k|v projection W [(H + 2 Hk) d,
    K], each BH columns of the head's first half and the same columns of its second, in two accumulators, each
    output's sum the one of `_linear_rows` (the same helpers, the same order over K), so a column's partner in
    rotate_half is in the same program. Its epilogue is fused_rows.rope_store's: the projection rounded to the
    dtype, q and k rotated (the `rope` helper), q to `q` [M, H, d], k and v to the cache layer kc, vc
    [B, Hk, S, d] at the row's slot (row m = b R + n; slots [B, R])."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    hh = tl.program_id(1) // P  # the head: q heads first, then k's, then v's
    j = tl.program_id(1) % P * BH + tl.arange(0, BH)  # this program's columns of each half
    half = d // 2
    rk = tl.arange(0, BK)
    r = norm_scale(x, a2, h, rm, rk, tl.program_id(1), sxm, sam, shm, M, K, eps, ADD, BF16, BM, BK)
    lo = hh * d + j  # the first half's columns; the second's are half further
    acc1 = tl.zeros([BM, BH], tl.float32)
    acc2 = tl.zeros([BM, BH], tl.float32)
    for k0 in range(0, K, BK):
        a = operand(x, a2, g, r, rm, k0 + rk, sxm, sam, M, K, True, ADD, False, BF16)
        acc1 = accumulate(acc1, a, w, lo, j < half, k0 + rk, swn, K, DOT, BF16)
        acc2 = accumulate(acc2, a, w, lo + half, j < half, k0 + rk, swn, K, DOT, BF16)
    if BF16:  # (the projection's own rounding: what rope_store reads from the stored q|k|v)
        acc1 = to_bf16(acc1).to(tl.float32)
        acc2 = to_bf16(acc2).to(tl.float32)
    b = rm // R
    n = rm % R
    ok = (rm[:, None] < M) & (j[None, :] < half)
    at = b[:, None] * scb + n[:, None] * scn + j[None, :]
    c1 = tl.load(cos + at, mask=ok, other=0.0)
    c2 = tl.load(cos + at + half, mask=ok, other=0.0)
    s1 = tl.load(sin + at, mask=ok, other=0.0)
    s2 = tl.load(sin + at + half, mask=ok, other=0.0)
    head = tl.zeros([BM, BH], tl.int32) + hh  # (the head as a block: the interpreter's masks are blocks)
    turn = head < H + Hk  # (v is not rotated)
    out1 = tl.where(turn, rope(acc1, -acc2, c1, s1), acc1)
    out2 = tl.where(turn, rope(acc2, acc1, c2, s2), acc2)
    if BF16:
        out1 = to_bf16(out1)
        out2 = to_bf16(out2)
    slot = tl.load(slots + b * ssb + n, mask=rm < M, other=0)[:, None]
    qo = q + rm[:, None] * sqm + hh * sqh + j[None, :]
    ko = kc + b[:, None] * skb + (hh - H) * skh + slot * sks + j[None, :]
    vo = vc + b[:, None] * svb + (hh - H - Hk) * svh + slot * svs + j[None, :]
    tl.store(qo, out1, mask=ok & (head < H))
    tl.store(qo + half, out2, mask=ok & (head < H))
    tl.store(ko, out1, mask=ok & (head >= H) & turn)
    tl.store(ko + half, out2, mask=ok & (head >= H) & turn)
    tl.store(vo, out1, mask=ok & (head >= H + Hk))
    tl.store(vo + half, out2, mask=ok & (head >= H + Hk))


def norm_scale(x, a2, h, rm, rk, col, sxm, sam, shm, M, K, eps, ADD: tl.constexpr, BF16: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr):
    """A device helper (`norm_scale`): RMSNorm's 1 / sqrt(mean(v^2) + eps) for rows rm, v each row (x + a2 with
    ADD, rounded as `row_block`), summed over K in blocks of BK in order. With ADD the programs of column
    `col` 0 store v to h, the residual sum, once."""
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        v = row_block(x, a2, rm, kk, sxm, sam, M, K, ADD, BF16)
        if ADD:
            hv = v
            if BF16:
                hv = to_bf16(v)
            first = (tl.zeros([BM, BK], tl.int32) + col) == 0
            tl.store(h + rm[:, None] * shm + kk[None, :], hv, mask=(rm[:, None] < M) & (kk[None, :] < K) & first)
        ss += tl.sum(v * v, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


def operand(x, a2, g, r, rm, kk, sxm, sam, M, K, NORM: tl.constexpr, ADD: tl.constexpr, SWIGLU: tl.constexpr,
            BF16: tl.constexpr):
    """A device helper (`operand`): the kernel's operand at rows rm, columns kk, in fp32 (`_linear_rows`'s
    prologues): the norm of the rows (r: `norm_scale`) times g, SwiGLU's product, or the rows themselves."""
    if NORM:
        a = row_block(x, a2, rm, kk, sxm, sam, M, K, ADD, BF16) * r[:, None] * tl.load(
            g + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
        if BF16:
            a = to_bf16(a).to(tl.float32)
    elif SWIGLU:  # (a K tail: silu(0) * 0 = 0, an exact zero as the plain kernel's)
        mx = (rm[:, None] < M) & (kk[None, :] < K)
        a = swiglu(tl.load(x + rm[:, None] * sxm + kk[None, :], mask=mx, other=0.0).to(tl.float32),
                   tl.load(x + rm[:, None] * sxm + K + kk[None, :], mask=mx, other=0.0).to(tl.float32))
        if BF16:
            a = to_bf16(a).to(tl.float32)
    else:
        a = row_block(x, a2, rm, kk, sxm, sam, M, K, False, BF16)
    return a


def row_block(x, a2, rm, kk, sxm, sam, M, K, ADD: tl.constexpr, BF16: tl.constexpr):
    """A device helper (`row_block`): rows rm of x at columns kk, in fp32, zero outside [M, K]; with ADD, x + a2
    rounded to the dtype as PyTorch's add rounds it (the residual sum of Block.forward)."""
    mx = (rm[:, None] < M) & (kk[None, :] < K)
    v = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=mx, other=0.0).to(tl.float32)
    if ADD:
        v = v + tl.load(a2 + rm[:, None] * sam + kk[None, :], mask=mx, other=0.0).to(tl.float32)
        if BF16:
            v = to_bf16(v).to(tl.float32)
    return v


def accumulate(acc, a, w, rn, cm, kk, swn, K, DOT: tl.constexpr, BF16: tl.constexpr):
    """A device helper (`accumulate`): acc + a W[rn, kk]^T for the operand block a [BM, BK] (fp32 values, bf16
    ones where BF16), the columns rn where cm holds, a K tail's zeros exact: on a GPU one FMA chain per output
    over k in order, or with BF16 bf16 MMAs (module docstring); under the interpreter products and sums."""
    wt = tl.load(w + rn[None, :] * swn + kk[:, None], mask=cm[None, :] & (kk[:, None] < K), other=0.0)
    if DOT:
        if BF16:  # (the operand's values are bf16's: exact)
            return tl.dot(a.to(tl.bfloat16), wt.to(tl.bfloat16), acc)
        return tl.dot(a, wt.to(tl.float32), acc, input_precision="ieee")
    return acc + tl.sum(a[:, :, None] * wt.to(tl.float32)[None, :, :], axis=1)


KERNELS = (_linear_rows, _qkv_rope_rows)
HELPERS = {"row_block": row_block, "norm_scale": norm_scale, "operand": operand,
           "accumulate": accumulate}  # (bound by triton_build.kernel)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's bits independent of the others (module docstring): x [..., K],
    weight [N, K], bias [N] or None, one dtype; returns [..., N] in x's dtype."""
    return _launch(x, weight, bias)[0]


def swiglu_linear(ab: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """row_linear(fused_rows.silu_mul(ab), weight) as one kernel, the very same bits: SwiGLU's product of
    ab = [a | b] [..., 2K] as the prologue of the FFN's down projection, weight [N, K] (no bias). One launch a
    block fewer in the static step where its linears run this kernel (`fused_rows.fuses_linear`)."""
    return _launch(ab, weight, None, gated=True)[0]


def norm_linear(x: torch.Tensor, a: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, rope: fused_rows.RopeStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h) W^T) for h = x + a (x itself where a is None) as one kernel: a block's residual add, its
    norm and the projection after it (Block.forward, where `fused_rows.fuses_linear`). x, a [..., K],
    norm_weight [K], weight [N, K] (no bias), one dtype. h has the bits of PyTorch's x + a; the norm is
    RMSNorm's formula, its mean square summed in blocks of BK in order (so not always the bits of
    fused_rows.rms_norm, whose sum is one reduction): within the dtype's rounding of the formula.

    rope: the projection is the attention's q|k|v [B, N, (H + 2 Hk) d] for x [B, N, K], and the kernel goes on
    as fused_rows.rope_store with these operands (its epilogue, the same bits): q and k rotated, k and v stored
    in the cache layer. Returns (h, the rotated q [B, N, H, d]); one kernel where there were two."""
    if a is not None and (a.shape != x.shape or a.dtype != x.dtype):
        raise ValueError(f"norm_linear: a {tuple(a.shape)} {a.dtype} must be x's shape and dtype, "
                         f"{tuple(x.shape)} {x.dtype}")
    if norm_weight.shape != x.shape[-1:]:
        raise ValueError(f"norm_linear: norm weight {tuple(norm_weight.shape)}, want [{x.shape[-1]}]")
    if rope is not None:
        return _qkv_rope(x, a, norm_weight, eps, weight, rope)
    y, h = _launch(x, weight, None, norm=(a, norm_weight, eps))
    return (x if h is None else h.view(x.shape)), y


def _qkv_rope(x: torch.Tensor, a: torch.Tensor | None, g: torch.Tensor, eps: float, weight: torch.Tensor,
              rope: fused_rows.RopeStore) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear` with its RoPE epilogue: the kernel `_qkv_rope_rows` over x [B, R, K]; (h, q)."""
    cos, sin, H, kc, vc, slots = rope
    Hk, d = kc.shape[1], kc.shape[-1]
    B, R, K = x.shape if x.dim() == 3 else (0, 0, 0)
    if (x.dim() != 3 or weight.shape != ((H + 2 * Hk) * d, K) or d % 2 or weight.dtype != x.dtype
            or kc.dtype != x.dtype or vc.shape != kc.shape or vc.dtype != x.dtype or kc.shape[0] != B
            or cos.shape != (B, R, d) or sin.shape != cos.shape or slots.shape != (B, R)):
        raise ValueError(f"norm_linear(rope=): x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}, "
                         f"{H} query heads, cache {tuple(kc.shape)} {kc.dtype}, cos {tuple(cos.shape)}, slots "
                         f"{tuple(slots.shape)}: want x [B, R, K], weight [(H + 2 Hk) d, K] for an even d, the "
                         "cache [B, Hk, S, d] in x's dtype, cos and sin [B, R, d], slots [B, R]")
    if (cos.stride(2) != 1 or sin.stride() != cos.stride() or kc.stride(3) != 1 or vc.stride(3) != 1
            or slots.stride(1) != 1):
        raise ValueError("norm_linear(rope=) needs the head dimension of cos, sin and the cache contiguous, cos "
                         "and sin alike, and each row of slots contiguous")
    if not available(x.device):
        raise RuntimeError(NEEDS)
    x2, w, M = as_rows(x), weight if weight.stride(1) == 1 else weight.contiguous(), B * R
    a2 = x2 if a is None else as_rows(a)
    h = x2 if a is None else torch.empty(M, K, device=x.device, dtype=x.dtype)
    q = torch.empty(M, H, d, device=x.device, dtype=x.dtype)
    bn, bk = tile(*weight.shape)
    BH = min(bn, pow2(d // 2))  # (the tile's BN: a program's columns of each half)
    P = triton_build.cdiv(d // 2, BH)
    kernel = triton_build.kernel(_qkv_rope_rows)
    kernel[(triton_build.cdiv(M, BM), (H + 2 * Hk) * P)](
        x2, w, a2, g.contiguous(), h, cos, sin, q, kc, vc, slots, M, R, K, H, Hk, d, P, x2.stride(0), w.stride(0),
        a2.stride(0), h.stride(0), float(eps), cos.stride(0), cos.stride(1), q.stride(0), q.stride(1),
        *kc.stride()[:3], *vc.stride()[:3], slots.stride(0), BF16=x.dtype == torch.bfloat16,
        DOT=not triton_build.interpreted(_qkv_rope_rows), BM=BM, BH=BH, BK=bk, ADD=a is not None)
    return (x if a is None else h.view(x.shape)), q.view(B, R, H, d)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
            norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel over x's rows: (y, the residual sum h where `norm` = (a, g, eps) has an a, else None)."""
    K = x.shape[-1] // 2 if gated else x.shape[-1]
    N = weight.shape[0]
    if (weight.shape[1] != K or x.shape[-1] != (2 * K if gated else K) or weight.dtype != x.dtype
            or (bias is not None and bias.shape != (N,))):
        raise ValueError(f"row_linear: x [..., {x.shape[-1]}] {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"bias {None if bias is None else tuple(bias.shape)}: want weight [N, {K}] of x's dtype, "
                         f"bias [N]{' (x: [a | b], 2K wide)' if gated else ''}")
    if not available(x.device):
        raise RuntimeError(NEEDS)
    x2, w = as_rows(x), weight if weight.stride(1) == 1 else weight.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    a, g, eps = norm if norm is not None else (None, None, 0.0)
    a2 = None if a is None else as_rows(a)
    g = None if g is None else g.contiguous()
    h = None if a is None else torch.empty(M, K, device=x.device, dtype=x.dtype)
    bn, bk = tile(N, K)
    kernel = triton_build.kernel(_linear_rows)
    kernel[(triton_build.cdiv(M, BM), triton_build.cdiv(N, bn))](
        x2, w, w if bias is None else bias, y, x2 if a2 is None else a2, w if g is None else g, y if h is None else h,
        M, N, K, x2.stride(0), w.stride(0), y.stride(0), x2.stride(0) if a2 is None else a2.stride(0),
        y.stride(0) if h is None else h.stride(0), float(eps), HAS_BIAS=bias is not None,
        BF16=x.dtype == torch.bfloat16, DOT=not triton_build.interpreted(_linear_rows), BM=BM, BN=bn, BK=bk,
        SWIGLU=gated, NORM=norm is not None, ADD=a is not None)
    return y.view(*x.shape[:-1], N), h


def _takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `row_linear` takes these operands: one dtype it stores, on a device where the kernel runs."""
    return x.dtype == w.dtype and x.dtype in triton_build.TYPES and available(x.device)


class RowLinears(TorchFunctionMode):
    """Inside it, every F.linear (an nn.Linear's forward included) whose operands `takes` goes through `linear`
    (by default `row_linear`, where its kernel runs; the static step's linear="c" passes the CPU's C kernel,
    kernels.linear_rows and kernels.takes_linear). What `DecodeStep(linear=...)` runs its forwards under: the
    model's code is unchanged, and a captured graph records the kernel's launches."""

    def __init__(self, linear: Callable | None = None, takes: Callable = _takes) -> None:
        super().__init__()
        self.linear, self.takes = linear, takes  # (linear None: this module's row_linear, looked up at the call)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if self.takes(x, w):
                return (self.linear or row_linear)(x, w, b)
        return func(*args, **kwargs)


def self_check(device: torch.device, dtype: torch.dtype, seed: int = 0) -> float:
    """The kernel's largest difference from the fp64 product on `device`, relative to the product's largest
    magnitude, over shapes with a row tail, an output tail and a K tail, plain and with each prologue (its
    operand made in PyTorch: SwiGLU's product, the norm of the residual sum, each rounded to the dtype; and the
    sum itself), and the norm's with the RoPE epilogue (`_rope_off`): what the step's probe, which compares a
    row's bits across buckets and not its value, cannot see. A correct kernel is within its dtype's rounding
    (about 1e-7 in fp32, 4e-3 in bf16)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    def off(got: torch.Tensor, operand: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> float:
        ref = operand.double() @ w.double().T + (0 if b is None else b.double())
        return float((got.double() - ref).abs().max() / ref.abs().max())

    worst = 0.0
    for M, N, K in ((1, 40, 70), (19, 72, 130)):
        x, a, w, b, nw = rand(M, K), rand(M, K), rand(N, K), rand(N), 1 + 0.1 * rand(K)
        ab = torch.cat([rand(M, K), x], -1)
        glu = (torch.nn.functional.silu(ab[:, :K].float()) * ab[:, K:].float()).to(dtype)
        h, y = norm_linear(x, a, nw, 1e-5, w)
        normed = _normed(x, a, nw)
        worst = max(worst, off(row_linear(x, w, b), x, w, b), off(swiglu_linear(ab, w), glu, w), off(y, normed, w),
                    float((h.double() - (x + a).double()).abs().max()))
    return max(worst, _rope_off(rand, g, device))


def _rope_off(rand, g: torch.Generator, device: torch.device) -> float:
    """`self_check`'s RoPE epilogue: q and the stored k, v of `norm_linear(rope=)` against the norm's product
    (in PyTorch, as `self_check`'s) rotated and stored by fused_rows.reference_rope_store in fp64, relative to
    its largest magnitude; 20 rows of two sequences, 3 + 2 x 1 heads of 24."""
    B, R, K, H, d, S = 2, 10, 130, 3, 24, 12
    x, a, nw, w = rand(B, R, K), rand(B, R, K), 1 + 0.1 * rand(K), rand((H + 2) * d, K)
    cos, sin = (torch.randn(B, R, d, generator=g).to(device) for _ in range(2))
    slots = torch.randperm(S - 2, generator=g)[:R].to(device).expand(B, R)  # (two slots left as they were)
    kc, vc = rand(B, 1, S, d), rand(B, 1, S, d)
    kr, vr = kc.double(), vc.double()
    _, q = norm_linear(x, a, nw, 1e-5, w, rope=fused_rows.RopeStore(cos, sin, H, kc, vc, slots))
    qkv = (_normed(x, a, nw).double() @ w.double().T).view(B, R, H + 2, d)
    qr = fused_rows.reference_rope_store(qkv, cos.double(), sin.double(), H, kr, vr, slots)
    return max(float((got.double() - want).abs().max() / want.abs().max())
               for got, want in ((q, qr), (kc, kr), (vc, vr)))


def _normed(x: torch.Tensor, a: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """The self-checks' operand of a norm prologue, in PyTorch: RMSNorm(x + a) with weight nw and eps 1e-5, in
    fp32, rounded to x's dtype (as the kernel's prologue rounds it)."""
    hf = (x + a).float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()).to(x.dtype)


def compile_for(capability: int, dtype: torch.dtype) -> list:
    """The kernels compiled ahead of time for an NVIDIA GPU of compute capability `capability` with `dtype`
    operands: the plain kernel (with a bias) and each prologue, SwiGLU's, the norm's with the residual add and
    without; the norm kernel with its RoPE epilogue, with the add and without (triton_build.compile_for: no GPU
    needed; tests/test_row_linear.py)."""
    t = triton_build.TYPES[dtype]
    const = dict(BF16=dtype == torch.bfloat16, DOT=True, BM=BM, BK=BK)
    ptrs = {n: f"*{t}" for n in ("x", "w", "b", "y", "a2", "g", "h", "q", "kc", "vc")}
    kinds = dict(ptrs, eps="fp32", cos="*fp32", sin="*fp32", slots="*i64",
                 **{n: "constexpr" for n in (*const, "BN", "BH", "HAS_BIAS", "SWIGLU", "NORM", "ADD")})
    return [*(triton_build.compile_for(_linear_rows, capability, kinds, dict(const, BN=BN, HAS_BIAS=bias,
                                                                             SWIGLU=gated, NORM=normed, ADD=added))
              for bias, gated, normed, added in ((True, False, False, False), (False, True, False, False),
                                                 (False, False, True, True), (False, False, True, False))),
            *(triton_build.compile_for(_qkv_rope_rows, capability, kinds, dict(const, BH=32, ADD=added))
              for added in (True, False))]

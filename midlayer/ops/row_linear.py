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

Arithmetic. IEEE fp32 products (no TF32, as PyTorch's default for fp32 matmuls), accumulated in fp32. bf16
operands are widened to fp32 first (exact) and the result rounded to bf16 once, to nearest even, as cuBLAS
does; not bf16 tensor-core MMAs: on the H200 cuBLAS's bf16 GEMMs already gave a row the same bits at every M,
so the kernel is for fp32, and one arithmetic for both dtypes is the one the interpreter (which cannot
multiply bf16) checks. `RowLinears` routes a forward's `F.linear` calls (every nn.Linear's) here;
`DecodeStep(linear="triton")` runs its forwards under it.

Prologues. A captured step pays per kernel, so what comes before a projection is the kernel's prologue where
the model asks (`fused_rows.fuses_linear`): SwiGLU's product before the down projection (`swiglu_linear`, the
very bits of the SwiGLU kernel then this one), and a norm with the residual add before it (`norm_linear`: the
attention's q|k|v and the FFN's first projection). A SmolLM2 step is then 7 kernels a block, 228 in all where
it was 318 (benchmarks/step_kernels.py --rounds both).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from . import triton_build
from .triton_build import NEEDS, as_rows

BM, BN, BK = 16, 32, 64  # the tile: BM rows (16: tl.dot's least) x BN outputs, over K in blocks of BK
tl = to_bf16 = swiglu = row_block = None  # triton.language and the kernels' helpers, set when first made


def available(device: torch.device | None = None) -> bool:
    """Whether the kernel runs here (triton_build.runs_on; made here, before any forward is traced)."""
    return triton_build.runs_on(KERNELS, device)


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
    if NORM:
        ss = tl.zeros([BM], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            v = row_block(x, a2, rm, kk, sxm, sam, M, K, ADD, BF16)
            if ADD:
                hv = v
                if BF16:
                    hv = to_bf16(v)
                first = (tl.zeros([BM, BK], tl.int32) + tl.program_id(1)) == 0  # (the first column of programs)
                tl.store(h + rm[:, None] * shm + kk[None, :], hv, mask=(rm[:, None] < M) & (kk[None, :] < K) & first)
            ss += tl.sum(v * v, axis=1)
        r = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
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
        wt = tl.load(w + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                     other=0.0).to(tl.float32)
        if DOT:  # (a K tail's zeros add exact zeros)
            acc = tl.dot(a, wt, acc, input_precision="ieee")
        else:
            acc += tl.sum(a[:, :, None] * wt[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = acc
    if BF16:
        out = to_bf16(acc)
    tl.store(y + rm[:, None] * sym + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _row_block(x, a2, rm, kk, sxm, sam, M, K, ADD: tl.constexpr, BF16: tl.constexpr):
    """A device helper (`row_block`): rows rm of x at columns kk, in fp32, zero outside [M, K]; with ADD, x + a2
    rounded to the dtype as PyTorch's add rounds it (the residual sum of Block.forward)."""
    mx = (rm[:, None] < M) & (kk[None, :] < K)
    v = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=mx, other=0.0).to(tl.float32)
    if ADD:
        v = v + tl.load(a2 + rm[:, None] * sam + kk[None, :], mask=mx, other=0.0).to(tl.float32)
        if BF16:
            v = to_bf16(v).to(tl.float32)
    return v


KERNELS = (_linear_rows,)
HELPERS = {"row_block": _row_block}  # (bound by triton_build.kernel)


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
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h) W^T) for h = x + a (x itself where a is None) as one kernel: a block's residual add, its
    norm and the projection after it (Block.forward, where `fused_rows.fuses_linear`). x, a [..., K],
    norm_weight [K], weight [N, K] (no bias), one dtype. h has the bits of PyTorch's x + a; the norm is
    RMSNorm's formula, its mean square summed in blocks of BK in order (so not always the bits of
    fused_rows.rms_norm, whose sum is one reduction): within the dtype's rounding of the formula."""
    if a is not None and (a.shape != x.shape or a.dtype != x.dtype):
        raise ValueError(f"norm_linear: a {tuple(a.shape)} {a.dtype} must be x's shape and dtype, "
                         f"{tuple(x.shape)} {x.dtype}")
    if norm_weight.shape != x.shape[-1:]:
        raise ValueError(f"norm_linear: norm weight {tuple(norm_weight.shape)}, want [{x.shape[-1]}]")
    y, h = _launch(x, weight, None, norm=(a, norm_weight, eps))
    return (x if h is None else h.view(x.shape)), y


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
    kernel = triton_build.kernel(_linear_rows)
    kernel[(triton_build.cdiv(M, BM), triton_build.cdiv(N, BN))](
        x2, w, w if bias is None else bias, y, x2 if a2 is None else a2, w if g is None else g, y if h is None else h,
        M, N, K, x2.stride(0), w.stride(0), y.stride(0), x2.stride(0) if a2 is None else a2.stride(0),
        y.stride(0) if h is None else h.stride(0), float(eps), HAS_BIAS=bias is not None,
        BF16=x.dtype == torch.bfloat16, DOT=not triton_build.interpreted(kernel), BM=BM, BN=BN, BK=BK, SWIGLU=gated,
        NORM=norm is not None, ADD=a is not None)
    return y.view(*x.shape[:-1], N), h


class RowLinears(TorchFunctionMode):
    """Inside it, every F.linear (an nn.Linear's forward included) of a floating x on a device where the kernel
    runs goes through `row_linear`. What `DecodeStep(linear="triton")` runs its forwards under: the model's
    code is unchanged, and a captured graph records the kernel's launches."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dtype == w.dtype and x.dtype in triton_build.TYPES and available(x.device):
                return row_linear(x, w, b)
        return func(*args, **kwargs)


def self_check(device: torch.device, dtype: torch.dtype, seed: int = 0) -> float:
    """The kernel's largest difference from the fp64 product on `device`, relative to the product's largest
    magnitude, over shapes with a row tail, an output tail and a K tail, plain and with each prologue (its
    operand made in PyTorch: SwiGLU's product, the norm of the residual sum, each rounded to the dtype; and the
    sum itself): what the step's probe, which compares a row's bits across buckets and not its value, cannot
    see. A correct kernel is within its dtype's rounding (about 1e-7 in fp32, 4e-3 in bf16)."""
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
        hf = (x + a).float()
        normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()).to(dtype)
        worst = max(worst, off(row_linear(x, w, b), x, w, b), off(swiglu_linear(ab, w), glu, w), off(y, normed, w),
                    float((h.double() - (x + a).double()).abs().max()))
    return worst


def compile_for(capability: int, dtype: torch.dtype) -> list:
    """The kernel compiled ahead of time for an NVIDIA GPU of compute capability `capability` with `dtype`
    operands, plain (with a bias) and with each prologue: SwiGLU's, the norm's with the residual add and
    without (triton_build.compile_for: no GPU needed; tests/test_row_linear.py)."""
    t = triton_build.TYPES[dtype]
    const = dict(BF16=dtype == torch.bfloat16, DOT=True, BM=BM, BN=BN, BK=BK)
    kinds = dict(x=f"*{t}", w=f"*{t}", b=f"*{t}", y=f"*{t}", a2=f"*{t}", g=f"*{t}", h=f"*{t}", eps="fp32",
                 **{n: "constexpr" for n in (*const, "HAS_BIAS", "SWIGLU", "NORM", "ADD")})
    return [triton_build.compile_for(_linear_rows, capability, kinds, dict(const, HAS_BIAS=bias, SWIGLU=gated,
                                                                          NORM=normed, ADD=added))
            for bias, gated, normed, added in ((True, False, False, False), (False, True, False, False),
                                               (False, False, True, True), (False, False, True, False))]

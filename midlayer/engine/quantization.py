"""Weight-only compression of a model's linear layers for inference: `bf16` and group-wise `int4`.

Batch-1 decoding reads every weight once per token, so its speed is set by the bytes of the weights, not
by FLOPs (MACHINE.md: fp32 GEMV streams ~23 GB/s here). Weight-only formats keep activations, the residual
stream, norms, softmax and the KV cache in the model's dtype (fp32) and store only the linear weights
compactly; each linear casts its input to bf16, multiplies, and returns in the input's dtype. The
residual stays fp32 because SmolLM2's reaches |h| ~ 25,000 in its middle blocks, where bf16's spacing is
128.

Formats (`weights=` setting of `midlayer generate` / `bench generate`):
  * `fp32`: unchanged (the exact mode: equals transformers' fp32 forward to ~1e-4).
  * `bf16`: weights rounded to bf16 (8-bit mantissa), matmuls on AMX-BF16 where the CPU has it.
  * `int4`: every block linear as 4-bit codes in groups of 32 input columns with an fp scale and offset
    per group, w = d * q + m, q in 0..15 -- the layout of llama.cpp's Q4_1. Quantising a tensor that came
    from a Q4_1 GGUF (each group's minimum and maximum are codes 0 and 15) recovers the file's codes
    exactly; only the scale d and the kernel's offset m + 8d are rounded to bf16, as the CPU kernel
    takes them.
The LM head stays fp32 in every format: bf16 *outputs* round logits of ~25 to steps of 0.125, which
flips near-ties (SmolLM2's first answer token to "What is the capital of France?" leads its runner-up by
0.08), and CPU matmuls have no bf16-in/fp32-out kernel.

  * `q4`: llama.cpp's arithmetic through our own batch-invariant kernels (kernels.py): block linears in
    Q4_1 (4-bit codes, fp16 scale and minimum per group of 32), the LM head in Q8_0 (8-bit codes, fp16
    scale per 32: the layout SmolLM2's GGUF stores its tied embedding in), activations quantised per row
    and group to int8 inside the kernel, attention through the row-invariant kernel. The one format whose
    rows do not depend on how many rows share a forward: the default for speculative decoding.

The head (`head=` setting): `fp32` (the reference, default except for q4) or `q8` (Q8_0, int32 block sums
scaled in fp32). Compressing also fuses q|k|v into one `attention.wqkv` and w1|w3 into one
`feed_forward.w13` (one matmul instead of three and two; one activation quantisation): an inference-only
rewrite, so checkpoints keep their per-projection names.

Fast path of `int4`: PyTorch's CPU kernel `aten._weight_int4pack_mm_for_cpu` (AVX-512). Where it is missing (older
torch, non-CPU devices) the layer dequantises and uses a plain matmul: the same numbers, slower.
`Int4Linear.reference` is that naive path, and the tests check the kernel against it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from midlayer.model.layers import FeedForward, RMSNorm
from midlayer.ops import kernels

WeightFormat = Literal["fp32", "bf16", "int4", "q4"]
WEIGHT_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int4", "q4")
HEAD_FORMATS: tuple[str, ...] = ("fp32", "q8")
KV_FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}  # what a KV cache holds
# Formats in which a row's logits are bit-identical whatever else shares its forward (SPEC section 9), so
# speculative output equals plain output token for token. fp32 (MKL), bf16 and int4 use PyTorch matmuls
# and SDPA, which are not row-invariant on CPU (tests/test_kernels.py shows where).
LOSSLESS_FORMATS: tuple[str, ...] = ("q4",)
GROUP_SIZE = 32  # Q4_1's block size


def _has_int4_cpu_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class BF16Linear(nn.Module):
    """y = x W^T (+ b) with W stored in bf16; x and y keep their dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def quantize_q4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of `group_size` input columns (Q4_1 style).

    w [N, K] -> (q [N, K] int32 in 0..15, d [N, K/g], m [N, K/g]) with w ~ d * q + m; d = (max-min)/15,
    m = min, so a group's minimum and maximum are represented exactly (up to float rounding)."""
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4: in_features {K} is not a multiple of the group size {group_size}")
    g = w.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), d, lo


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit weight-only linear (w = d * q + m per group of 32 inputs)."""

    def __init__(self, linear: nn.Linear, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        q, d, m = quantize_q4(linear.weight, group_size)
        # The kernel's convention is w = (q - 8) * scale + zero: scale = d, zero = m + 8 d. Stored as
        # [K/g, N, 2] in bf16, the dtype of the activations it multiplies.
        sz = torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("scales_zeros", sz)
        self.register_buffer("codes", q.to(torch.uint8))  # kept for the reference path and for export
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.packed: torch.Tensor | None = None
        if _has_int4_cpu_kernel() and linear.weight.device.type == "cpu" and self.out_features % 32 == 0:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] the codes and bf16 scales/offsets represent, in fp32."""
        sz = self.scales_zeros.float()  # [K/g, N, 2]
        d, z = sz[..., 0].t(), sz[..., 1].t()  # [N, K/g]
        N, K = self.out_features, self.in_features
        q = self.codes.float().reshape(N, K // self.group_size, self.group_size)
        return ((q - 8) * d[..., None] + z[..., None]).reshape(N, K)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # What the kernel computes: bf16-rounded activations times the represented weight, its result rounded to
        # bf16 as the kernel's is (unrounded, the two differed by up to 1.04 in SmolLM2's logits)
        y = F.linear(x.to(torch.bfloat16).float(), self.dequantized()).to(torch.bfloat16).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.device.type != "cpu":
            return self.reference(x)
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed,
                                                        self.group_size, self.scales_zeros)
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class BlockQuantLinear(nn.Module):
    """A linear whose weight is block-quantised codes + fp16 scales, multiplied by a batch-invariant kernel
    (kernels.py). Subclasses name the layout: its quantiser, dequantiser and GEMM. The layouts interleave
    the outputs by groups of 8 (padded with zero weights), so the buffers hold ceil(N/8) groups and the
    dequantiser and GEMM are told the real N."""

    quantize = dequantize = gemm = staticmethod(lambda *a: None)  # set by the subclasses
    select = None  # (codes, scales, rows, n) -> the rows' codes and scales, where they copy row by row

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._hold(linear.in_features, linear.out_features, *type(self).quantize(linear.weight),
                   None if linear.bias is None else linear.bias.detach().float().clone())

    def _hold(self, in_features: int, out_features: int, codes: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    def dequantized(self) -> torch.Tensor:
        """The weight [out_features, in_features] fp32 the codes and scales represent."""
        return type(self).dequantize(self.codes, self.scales, self.out_features)

    def select_rows(self, rows: torch.Tensor) -> "BlockQuantLinear":
        """The layer restricted to the outputs `rows`, in that order (a draft vocabulary's sub-head). Formats
        whose codes can be copied row by row (`select`) copy them; others requantise the dequantised rows."""
        rows = rows.to(self.codes.device)
        bias = None if self.bias is None else self.bias.index_select(0, rows)
        if type(self).select is None:
            w = self.dequantized().index_select(0, rows)
            return type(self)(SimpleNamespace(weight=w, bias=bias, in_features=w.shape[1], out_features=w.shape[0]))
        sub = type(self).__new__(type(self))
        nn.Module.__init__(sub)
        sub._hold(self.in_features, int(rows.numel()),
                  *type(self).select(self.codes, self.scales, rows, self.out_features), bias)
        return sub

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = type(self).gemm(x.reshape(-1, self.in_features), self.codes, self.scales, self.out_features)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Q4Linear(BlockQuantLinear):
    """Q4_1 weights (codes packed two per byte) x Q8 activations: the q4 format's block linears."""

    quantize, dequantize, gemm = (staticmethod(kernels.quantize_q4_1), staticmethod(kernels.dequantize_q4_1),
                                  staticmethod(kernels.gemm_q4_1))


class Q8Linear(BlockQuantLinear):
    """Q8_0 weights x Q8 activations: the compressed LM head."""

    quantize, dequantize, gemm = (staticmethod(kernels.quantize_q8_0), staticmethod(kernels.dequantize_q8_0),
                                  staticmethod(kernels.gemm_q8_0))
    select = staticmethod(kernels.select_rows_q8_0)


def _convert(linear: nn.Linear, fmt: str) -> nn.Module:
    if fmt == "fp32":
        return linear
    if fmt == "bf16":
        return BF16Linear(linear)
    if fmt == "int4":
        return Int4Linear(linear)
    return Q4Linear(linear)


def compress_block(block: nn.Module, fmt: str) -> nn.Module:
    """One block's linears to weight format `fmt`, in place (compress_weights' per-block rule, also used for
    a drafter's own layer that has a base block's shape: eagle.EagleDrafter). Fuses q|k|v and w1|w3 first;
    q4 also switches its cached attention to the row-invariant kernel."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    att, ffs = _fuse_block(block)
    if att is not None:
        att.wqkv = _convert(att.wqkv, fmt)
        att.wo = _convert(att.wo, fmt)
        att.row_invariant = fmt == "q4"
    for ff in ffs:
        if ff.w13 is not None:  # a GLU: w1|w3 fused
            ff.w13 = _convert(ff.w13, fmt)
        else:  # a plain MLP: w1 alone
            ff.w1 = _convert(ff.w1, fmt)
        ff.w2 = _convert(ff.w2, fmt)
    _fast_norms(block)
    if hasattr(block, "fused_q4"):
        ff = block.feed_forward
        block.fused_q4 = kernels.BlockQ4(
            tuple(None if n is None else n.weight.detach() for n in _block_norms(block)), block.attention_norm.eps,
            ((att.wqkv.codes, att.wqkv.scales), (att.wo.codes, att.wo.scales), (ff.w13.codes, ff.w13.scales),
             (ff.w2.codes, ff.w2.scales)), att.n_heads) if fuses_q4(block) else None
    return block


def _fuse_block(block: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """Join a block's q|k|v and w1|w3 into one projection each (inference); returns its attention (None for a
    state-space mixer, which stays fp32) and its feed-forwards (every expert of a mixture; its router stays
    fp32: it decides, like skip routers)."""
    att = getattr(block, "attention", None)
    if att is not None:
        att.fuse()
    ffs = list(getattr(block.feed_forward, "experts", [block.feed_forward]))
    for ff in ffs:
        ff.fuse()
    return att, ffs


def fuse_projections(model: nn.Module) -> nn.Module:
    """`compress_weights`' inference preparation without its change of weight format, in place: every block's
    q|k|v and w1|w3 joined (one GEMM where there were three and two; RoPE then rotates q and k in one go)
    and the norms' fast path. What the static step's benchmarks run at each dtype, as `generate` runs a
    compressed model: a CUDA-graph replay pays per kernel (issue 42)."""
    for block in model.layers:
        _fuse_block(block)
    _fast_norms(model)
    return model


def _fast_norms(module: nn.Module) -> None:
    """Inference: every RMSNorm of `module` takes the C kernel where it applies (layers.RMSNorm.fast)."""

    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.fast = True


def _block_norms(block: nn.Module) -> tuple:
    """attention_norm, ffn_norm and the sandwich's output norms (None in a pre-norm block)."""
    return (block.attention_norm, block.ffn_norm, getattr(block, "attention_out_norm", None),
            getattr(block, "ffn_out_norm", None))


def fuses_q4(block: nn.Module) -> bool:
    """Whether a compressed block runs over the KV cache as one C call (kernels.block_q4): a q4 attention
    block with pre-norm or sandwich RMSNorms of one eps, a SwiGLU FFN, no biases, no QK-norm, no dropout,
    kernels built.
    Every other block runs module by module (the reference the fused call equals bit for bit). The call
    holds the block's weight tensors as they are at compression (`Block.fused_q4`): weights loaded in place
    later are seen, modules replaced later are not -- set `block.fused_q4 = None` then."""

    att, ff = getattr(block, "attention", None), block.feed_forward
    if att is None or getattr(block, "mixer", None) is not None or not att.row_invariant or not kernels.available():
        return False  # (row_invariant first: a format other than q4 never builds the C library)
    norms = [n for n in _block_norms(block) if n is not None]
    linears = (att.wqkv, att.wo, getattr(ff, "w13", None), getattr(ff, "w2", None))
    # (a block with a RoPE base of its own reads half of the position tables: Attention.forward's rope_half)
    return (block.placement in ("pre", "sandwich") and block.drop is None and att.q_norm is None
            and att.rope_half is None
            and att.row_invariant and type(ff) is FeedForward and ff.kind == "swiglu"
            and all(type(n) is RMSNorm and n.eps == norms[0].eps for n in norms)
            and all(type(m) is Q4Linear and m.bias is None for m in linears)
            and att.head_dim * att.n_heads == att.wo.in_features)


def compress_weights(model: nn.Module, fmt: str, head: str | None = None, kv: str | None = None) -> nn.Module:
    """Prepare a model for inference in weight format `fmt`, in place (see the module docstring).

    Fuses q|k|v and w1|w3, then converts the block linears to `fmt` and the LM head to `head` (default: q8
    for q4, fp32 otherwise). The embedding and the routers of gated models stay as they are (routers are
    tiny and decide which blocks run). The q4 format also switches cached attention to the row-invariant
    kernel. `kv`: what the KV cache holds (KV_FORMATS; default: fp16 for q4, as llama.cpp keeps it, else the
    weights' dtype): fp16 halves the cache and the bytes attention reads, with attention still in fp32 over the
    exactly widened values. Returns the model, with `weight_format`, `head_format`, `kv_dtype` and
    `batch_invariant` attributes."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    if kv is not None and kv not in KV_FORMATS:
        raise ValueError(f"kv must be one of {', '.join(KV_FORMATS)}, got {kv!r}")
    head = head or ("q8" if fmt == "q4" else "fp32")
    if head not in HEAD_FORMATS:
        raise ValueError(f"head must be one of {', '.join(HEAD_FORMATS)}, got {head!r}")
    if getattr(model, "weight_format", None) is not None:
        raise ValueError(f"this model was already compressed to {model.weight_format}")
    dev = next(model.parameters()).device
    if fmt == "q4" and dev.type != "cpu":
        # The q4 format is our C kernels (row-invariant, llama.cpp's arithmetic) and runs on the CPU only: on
        # another device every linear would be copied to the host and back (issue 42).
        raise ValueError(f"--weights q4 runs on the CPU only (its kernels are C); on {dev.type} use --weights fp32 or "
                         "bf16")
    for block in model.layers:
        compress_block(block, fmt)
    _fast_norms(model)
    if head == "q8":
        model.output = Q8Linear(model.output)  # unties: the embedding keeps its fp32 copy for lookups
    model.weight_format = fmt
    model.head_format = head
    # None: the weights' dtype (kv_cache.kv_dtype)
    model.kv_dtype = KV_FORMATS[kv] if kv is not None else torch.float16 if fmt == "q4" else None
    # Gated models: the routers stay fp32 and compute a row-invariant dot product at inference (gating.py),
    # so gates, and which blocks a token skips, do not depend on the rows sharing a forward either.
    model.batch_invariant = fmt in LOSSLESS_FORMATS and head != "fp32" and kernels.batch_invariant()
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes read per decode step: every linear weight (and a head) once; the embedding contributes one row.
    Block-quantised layouts count their stored bytes (codes and fp16 scales, padding to 8 outputs included)."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
        elif isinstance(mod, BF16Linear):
            total += mod.weight.numel() * 2
        elif isinstance(mod, Int4Linear):
            total += mod.codes.numel() // 2 + mod.scales_zeros.numel() * 2
        elif isinstance(mod, BlockQuantLinear):
            total += mod.codes.numel() * mod.codes.element_size() + mod.scales.numel() * 2
    return total

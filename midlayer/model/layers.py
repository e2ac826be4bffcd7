"""The layers a block is built from, beside attention: the norms (RMSNorm, LayerNorm), the feed-forward
variants (GLU and plain MLPs) and the mixture of experts, and the one projection fusion the CPU inference
path uses (`fuse_linears`).
"""

from __future__ import annotations

import functools


import torch
import torch.nn.functional as F
from torch import nn

from midlayer.config import ModelConfig
from midlayer.ops import fused_rows, kernels, row_linear


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, computed in fp32. `fast` (set by
    quantization.compress_weights, which prepares a model for inference): on the CPU in fp32 without autograd,
    one C call (kernels.rmsnorm) instead of six ops. A model that is trained or evaluated in training never
    sets it, so those commands never build or load the C library (issue 43)."""

    fast = False
    # Devices where inference calls aten's rms_norm, the same formula in fp32 as one fused kernel (CUDA's
    # _fused_rms_norm) instead of six launches: a CUDA-graph replay of the static decode step pays per kernel
    # (issue 42). Training keeps the six ops.
    FUSED_DEVICES: tuple[str, ...] = ("cuda",)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_rows.applies(x):  # the static step's row kernels (Triton): one launch instead of four on CUDA
            return fused_rows.rms_norm(x, self.weight, self.eps)
        if self.fast and not torch.is_grad_enabled() and x.dtype == torch.float32:
            y = kernels.rmsnorm(x, self.weight, self.eps)  # inference on CPU: one C call instead of six ops
            if y is not None:
                return y
        if x.device.type in self.FUSED_DEVICES and not torch.is_grad_enabled():
            return F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps).to(x.dtype)
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al. 2016): (x - mean) / sqrt(var + eps) * weight (+ bias), computed in fp32."""

    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), b, self.eps).to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The model's normalisation (`norm_type`) over `dim` features (default cfg.dim)."""
    dim = cfg.dim if dim is None else dim
    if cfg.norm_type == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return LayerNorm(dim, cfg.norm_eps, bias=cfg.norm_type == "layernorm")


def fuse_linears(parts: list[nn.Module]) -> nn.Linear:
    """One frozen nn.Linear computing the concatenation of the parts' outputs (inference: one matmul)."""
    out = sum(p.out_features for p in parts)
    has_bias = any(p.bias is not None for p in parts)
    w = parts[0].weight
    # built on the meta device, so no random init is drawn only to be overwritten (on the CPU that draw was
    # about a third of compressing SmolLM2 to q4): every value is assigned below
    fused = nn.Linear(parts[0].in_features, out, bias=has_bias, device="meta", dtype=w.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts], 0), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([p.bias if p.bias is not None else w.new_zeros(p.out_features)
                                                 for p in parts]), requires_grad=False)
    return fused.requires_grad_(False)


_ACTIVATIONS = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": functools.partial(F.gelu, approximate="tanh"),
                "reglu": F.relu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class FeedForward(nn.Module):
    """The FFN (`ffn_type`). GLU variants (Shazeer 2020, "GLU Variants Improve Transformer"):
    w2(act(w1 x) * w3 x) with act = SiLU (SwiGLU), GELU (GeGLU) or ReLU (ReGLU); plain MLPs (Vaswani et al.
    2017: ReLU; GPT-2: GELU): w2 act(w1 x). `fuse()` (inference) joins a GLU's w1|w3 into one `w13`."""

    def __init__(self, dim: int, hidden: int, kind: str = "swiglu") -> None:
        super().__init__()
        self.kind, self.act = kind, _ACTIVATIONS[kind]
        self.glu = kind in ("swiglu", "geglu", "geglu_tanh", "reglu")
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        if self.glu:
            self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w13: nn.Module | None = None

    def fuse(self) -> None:
        """GLU: replace w1, w3 by one projection w13 = [w1; w3] (inference only; checkpoints keep w1/w3)."""
        if self.glu and self.w13 is None:
            self.w13 = fuse_linears([self.w1, self.w3])
            del self.w1, self.w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            return self.down(self.w13(x))
        if self.glu:
            return self.w2(self.act(self.w1(x)) * self.w3(x))
        return self.w2(self.act(self.w1(x)))

    def down(self, ab: torch.Tensor) -> torch.Tensor:
        """The rest of a fused GLU after w13: w2(act(a) * b) for ab = [a | b] (Block.forward calls it where the
        static step's kernel makes ab with the norm before it)."""
        if self.kind == "swiglu" and fused_rows.applies(ab):  # the static step's row kernels (Triton)
            if fused_rows.fuses_linear(ab, self.w2):  # (the product as the down projection's prologue)
                return row_linear.swiglu_linear(ab, self.w2.weight)
            return self.w2(fused_rows.silu_mul(ab))
        if self.kind == "swiglu" and not torch.is_grad_enabled():
            y = kernels.silu_mul(ab)  # inference on CPU: one C call, the fused q4 block's own (Block.forward)
            if y is not None:
                return self.w2(y)
        a, b = ab.chunk(2, -1)
        return self.w2(self.act(a) * b)


class MoEFeedForward(nn.Module):
    """A mixture of E experts (each a `FeedForward` of the model's ffn_type) with top-k routing, dropless:
    every token is processed by its k experts, none is dropped for capacity (Mixtral; Jiang et al. 2024):

        p = softmax(W_r x),   S = the k largest p_e,   y = sum_{e in S} (p_e / sum_{j in S} p_j) FFN_e(x)
    for k > 1 (Mixtral), y = p_e FFN_e(x) for k = 1 (Switch Transformer: the router then still learns
    from the language-model loss).

    A token's experts and weights depend on that token alone, so routing does not depend on the batch.
    `aux` (set by each forward): the Switch Transformer load-balancing loss (Fedus et al. 2022, eq. 4),
    E * sum_e f_e P_e, with f_e the share of the (token, choice) assignments that went to expert e and P_e
    the mean router probability of e: 1 when the load is uniform, E when one expert takes everything.
    `load`: f_e (detached), for logging."""

    def __init__(self, dim: int, hidden: int, kind: str, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList([FeedForward(dim, hidden, kind) for _ in range(n_experts)])
        self.aux: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def fuse(self) -> None:
        for e in self.experts:
            e.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        with torch.autocast(x.device.type, enabled=False):  # routing decisions from fp32 logits
            probs = F.softmax(F.linear(xf.float(), self.router.weight.float()), -1)  # [N, E]
        top_p, top_i = probs.topk(self.top_k, -1)
        # k > 1: the k probabilities renormalised (Mixtral); k = 1: the raw probability (Switch), so the
        # language-model loss still reaches the router (a renormalised single weight would be 1, gradient 0)
        weights = (top_p / top_p.sum(-1, keepdim=True) if self.top_k > 1 else top_p).to(x.dtype)
        out = torch.zeros_like(xf)
        for e, expert in enumerate(self.experts):  # in expert order: every token sums its experts alike
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(xf[rows]) * weights[rows, slot, None])
        E = self.n_experts
        f = torch.bincount(top_i.reshape(-1), minlength=E).float() / max(top_i.numel(), 1)  # share per expert
        self.aux = E * (f * probs.mean(0)).sum()
        self.load = f.detach()
        return out.reshape(shape)

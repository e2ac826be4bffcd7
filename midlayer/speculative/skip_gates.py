"""Skip-middle gates for a pretrained dense model (issue 15), and the gated model as a self-drafter.

The paper (Lawson & Aitchison 2025, arXiv 2506.21103) trains gated models from scratch. Here the routers of
eqs. 1-2 -- and, as a setting, low-rank adapters on each block's output projections -- are *added* to a
frozen pretrained model and trained by self-distillation: the loss is the forward KL from the dense model's
own next-token distribution to the gated model's (Wu et al. 2024 sec. 3.3, the loss of every drafter in
draft_training.py) plus the sparsity controller's term (eqs. 4-6, sparsity.py) on the gates of the counted
(response) positions.

Starting dense, and why it still learns. Routers initialised to w = 0, b = 0 give s = ReLU(0) = 0 at every
block, S = 0, g = 1 - clamp(0, 0, 1) = 1 exactly (eq. 2): the gated model computes the dense model's logits
bit for bit without autograd (Block: a * 1.0 == a; eq. 3's key bias ln(max(1, eps)) = 0); while autograd
records, to float rounding (the key bias, kept for its gradient, takes SDPA's masked kernel, not the causal
one: 1.2e-7 on a tiny model). But ReLU'(0) = 0, so eq. 2 passes
no gradient to a router whose score is exactly 0 -- the routers would never move. Training therefore uses
the straight-through gate gradient (gating.straight_through, `ModelConfig.gate_grad = "straight_through"`):
the same forward values, with the gradient of 1 - sum(w.h + b) -- non-zero from the first step. The
adapters start with B = 0 (Hu et al. 2021, LoRA), so they too leave the dense function unchanged.

Router scale. A pretrained residual stream is large (its L1 norm over d = 576 dimensions runs to thousands
in SmolLM2's middle blocks), and Adam moves every weight by about the learning rate per step whatever the
gradient's size: a step changes w.h by ~ lr ||h||_1, so at lr 1e-2 a few steps of noise (the KL and its
gradient are ~0 at the dense start: only the fp16 rounding of the cached teacher states) closed the middle gates of SmolLM2 outright (gate means ~0.01, KL 49, measured).
Each router's weight is therefore w_l = v_l c_l (`ScaledRouter`; c_l in `router_scale`), c_l = 1 / the mean
L1 norm of the residual entering block l on the first training batch (`calibrate`, once, saved with the
weights): an Adam step then moves a score by about lr, on any model. Eq. 1 is unchanged (w_l is a weight).
But one scale per block does not fit every token: a pretrained model's first token (its attention sink,
Xiao et al. 2023) carries "massive activations" (Sun et al. 2024, arXiv 2402.17762), an L1 norm ~3.7x the
median in SmolLM2's block 4 (measured), so the same step moves its score ~3.7x as far. Trained with hard
gates, that token closed first -- at block 7, hiding it as a key from every later token in blocks 7-22 --
and the held-out KL went to 2.1 within 50 steps (`gates/smollm2-135m/`, docs/results/pretrained-skipping-
cpu.md). `router_norm` makes eq. 1 read h / ||h||_1 per token instead: a step then moves every token's score
by at most lr, whatever its norm, and the routing decision depends on the residual's direction alone.

`SkipGates` holds everything trained (routers, adapters) and the controller's coefficients (buffers, so
they are saved and resumed with the weights); `gated_twin(model, gates)` is the gated model: a Transformer
that *shares* every weight of the dense one (nothing is copied) with the routers attached, `gating=True`
and the adapters wrapped around the shared projections. The twin runs everywhere a gated model runs --
training forward, real skipping in the KV-cache engine (generate.py), FLOPs accounting -- through the one
block loop (`Transformer.run_blocks`).

Self-drafting (`GatedDrafter`): the twin drafts autoregressively over the dense model's KV cache (the
context's keys and values are the dense model's: the twin only adds draft rows, as Draft & Verify's layer
skipping does, Zhang et al. 2023), with real skipping of the blocks its gates close; the dense model
verifies. Verification decides every committed token, so the output equals plain greedy decoding whatever
the gates are (speculative.py).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
from torch import nn

import torch.nn.functional as F

from midlayer.config import GATE_VALUES, SparsityConfig
from midlayer.model.gating import GateStats, router_input, Routers
from midlayer.model.sparsity import ADAPTIVE_KINDS, SparsityController
from midlayer.model.transformer import Transformer
from .drafting import gather_counted, kl_to_base
from .layer_skip import LayerSkipDrafter


class LowRankLinear(nn.Module):
    """y = base(x) + (alpha / r) (x A^T) B^T: a frozen projection plus a trainable rank-r update (LoRA,
    Hu et al. 2021, eq. 3). A and B are owned by `SkipGates`; this wrapper only borrows them. Its matmul is
    PyTorch's, not row-invariant like the q4 kernels: with adapters, a token's residual -- and so its gates --
    may differ in the last bits between a one-row step and a many-row forward (self-drafting stays lossless:
    the dense model verifies)."""

    def __init__(self, base: nn.Module, a: nn.Parameter, b: nn.Parameter, scale: float) -> None:
        super().__init__()
        self.base, self.a, self.b, self.scale = base, a, b, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        up = (x.to(self.a.dtype) @ self.a.t()) @ self.b.t()
        return y + (self.scale * up).to(y.dtype)


class SkipGates(nn.Module):
    """Routers (+ optional adapters, + controller state) for a dense model of `n_layers` blocks.

    Adapters (`lora_rank` > 0) update each block's attention output projection (`attention.wo`,
    `attn_in` -> dim) and FFN down projection (`feed_forward.w2`, `ffn_hidden` -> dim): the two matrices that
    write into the residual stream, which is where a skipped span's missing contribution shows up.
    The controller (`sparsity_config()`) targets mean gates linearly from `mu0` at block 0 to `mu_final` at
    block L/2 - 1, mirrored (sparsity.mean_targets).
    """

    KIND = "skip-gates"

    def __init__(self, dim: int, n_layers: int, lora_rank: int = 0, attn_in: int = 0, ffn_hidden: int = 0,
                 lora_alpha: float = 16.0, mu0: float = 1.0, mu_final: float = 0.5, gamma: float = 1e-2,
                 delta: float = 1e-2, kp: float = 0.0, controller: str = "proportional",
                 gate_values: str = "soft", router_norm: bool = False, beta_max: float = 0.0) -> None:
        super().__init__()
        if n_layers < 2 or n_layers % 2:
            raise ValueError(f"skip gates need an even number of blocks >= 2 (block l mirrors L-1-l), got {n_layers}")
        if lora_rank < 0 or (lora_rank and (attn_in < 1 or ffn_hidden < 1)):
            raise ValueError("lora_rank must be >= 0, and adapters need attn_in and ffn_hidden >= 1")
        if gate_values not in GATE_VALUES:
            raise ValueError(f"gate_values must be one of {GATE_VALUES}, got {gate_values!r}")
        self.dim, self.n_layers, self.lora_rank, self.gate_values = dim, n_layers, lora_rank, gate_values
        self.router_norm = bool(router_norm)
        self.attn_in, self.ffn_hidden, self.lora_alpha = attn_in, ffn_hidden, lora_alpha
        if controller not in ADAPTIVE_KINDS:
            # the coefficients live in buffers that start at 0 (eq. 6: "initialised to zero"); a fixed-coefficient
            # controller would keep them there and do nothing
            raise ValueError(f"skip gates need an adaptive controller ({', '.join(ADAPTIVE_KINDS)}), got {controller!r}")
        self._sparsity = dict(mu0=mu0, mu_final=mu_final, gamma=gamma, delta=delta, kp=kp, controller=controller,
                              beta_max=beta_max)
        self.sparsity_config()  # validate now
        self.routers = Routers(dim, n_layers)
        self.register_buffer("router_scale", torch.ones(n_layers // 2))  # c_l (module docstring)
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))
        for layer in range(n_layers // 2):  # v = 0, b = 0: gates exactly 1, the dense model (module docstring)
            self.routers[layer] = ScaledRouter(dim, self, layer)
        self.lora = nn.ParameterDict()
        for layer in range(n_layers if lora_rank else 0):
            for name, d_in in (("wo", attn_in), ("w2", ffn_hidden)):
                a = torch.empty(lora_rank, d_in)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # LoRA's A init; B = 0 keeps the start dense
                self.lora[f"{layer}_{name}_a"] = nn.Parameter(a)
                self.lora[f"{layer}_{name}_b"] = nn.Parameter(torch.zeros(dim, lora_rank))
        for name in ("alpha", "beta", "err_mean", "err_var"):  # the controller's state (eq. 6), resumed with us
            self.register_buffer(f"ctrl_{name}", torch.zeros(n_layers))
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        object.__setattr__(self, "_twins", {})  # not submodules: the twin shares the base, it is not ours

    @classmethod
    def for_model(cls, model: Transformer, **kw: Any) -> "SkipGates":
        cfg = model.cfg
        if cfg.gating:
            raise ValueError("skip gates are added to a dense model; this one is gated already")
        if kw.get("lora_rank") and cfg.moe_experts:
            raise ValueError("adapters need a dense FFN (feed_forward.w2); this model has experts")
        gates = cls(cfg.dim, cfg.n_layers, attn_in=cfg.n_heads * cfg.head_dim, ffn_hidden=cfg.ffn_hidden_dim, **kw)
        return gates.to(model.tok_embeddings.weight.device)

    def config(self) -> dict[str, Any]:
        return dict(dim=self.dim, n_layers=self.n_layers, lora_rank=self.lora_rank, attn_in=self.attn_in,
                    ffn_hidden=self.ffn_hidden, lora_alpha=self.lora_alpha, gate_values=self.gate_values,
                    router_norm=self.router_norm, **self._sparsity)

    def sparsity_config(self) -> SparsityConfig:
        s = self._sparsity
        # the twin trained by `gate_loss` has straight-through gates already, so the controller's term
        # differentiates those (what reg_grad = straight_through would select): no separate setting
        return SparsityConfig(controller=s["controller"], mu0=s["mu0"], mu_final=s["mu_final"], gamma=s["gamma"],
                              delta=s["delta"], kp=s["kp"], beta_max=s["beta_max"])

    def controller(self) -> SparsityController:
        """The controller, its coefficients bound to this module's buffers (updates land in them)."""
        c = SparsityController(self.sparsity_config(), self.n_layers)
        c.to(self.ctrl_alpha.device)
        c.alpha, c.beta, c.err_mean, c.err_var = self.ctrl_alpha, self.ctrl_beta, self.ctrl_err_mean, self.ctrl_err_var
        return c

    @torch.no_grad()
    def calibrate(self, model: Transformer, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Set c_l = 1 / mean_t ||h(t, l)||_1 from the dense model's residuals on `tokens`, over the counted
        positions `mask` (all when None or empty) -- once, on the first training batch. Routers still at
        v = 0 stay at w = 0: the start is dense whatever c_l is."""
        if bool(self.calibrated):
            return
        if self.router_norm:  # the routers read h / ||h||_1: the scale is 1 by construction (ScaledRouter)
            self.router_scale.fill_(1.0)
            self.calibrated.fill_(True)
            return
        hs = model(tokens, return_logits=False, output_hidden_states=True).hidden_states
        keep = mask if mask is not None and bool(mask.any()) else torch.ones(tokens.shape, dtype=torch.bool,
                                                                               device=tokens.device)
        for layer in range(self.n_layers // 2):
            self.router_scale[layer] = 1.0 / hs[layer][keep].float().abs().sum(-1).mean().clamp_min(1e-6)
        self.calibrated.fill_(True)

    def record(self, mean: torch.Tensor, var: torch.Tensor) -> None:
        """The gate statistics of this step's loss, for `after_step` (eq. 6 updates after the optimiser)."""
        self._last = (mean.detach(), var.detach())

    @torch.no_grad()
    def after_step(self) -> None:
        """Eq. 6: move the controller's coefficients by this step's gate statistics (called by the training
        loop after the optimiser step: updating before backward would change the loss's constants)."""
        if self._last is not None:
            self.controller().update(*self._last)
            self._last = None

    def twin(self, model: Transformer, gate_grad: str = "exact") -> Transformer:
        """`gated_twin(model, self)`, built once per (model, gate_grad)."""
        key = (id(model), gate_grad)
        got = self._twins.get(key)
        if got is None or got[0] is not model:
            got = self._twins[key] = (model, gated_twin(model, self, gate_grad))
        return got[1]


class ScaledRouter(nn.Module):
    """Router l of eq. 1 with weight w = v c_l (module docstring, "Router scale"): trains v, exposes `weight`
    and `bias` as an `nn.Linear(dim, 1)` does, so the gate code (gating.Routers.step) reads it unchanged.
    Inference reuses w until v or c_l changes (the decode step reads it once per block and token)."""

    def __init__(self, dim: int, owner: "SkipGates", layer: int) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.zeros(1, dim))
        self.bias = nn.Parameter(torch.zeros(1))
        # c_l is read from the owner's buffer at every use (not held): `.to()` replaces buffers by new tensors
        object.__setattr__(self, "owner", owner)  # not a submodule: the owner holds us
        self.layer = layer
        self._memo: tuple | None = None

    @property
    def weight(self) -> torch.Tensor:
        c = self.owner.router_scale
        if torch.is_grad_enabled():
            return self.v * c[self.layer]
        key = (self.v.data_ptr(), self.v._version, c.data_ptr(), c._version)
        if self._memo is None or self._memo[0] != key:
            self._memo = (key, self.v * c[self.layer])
        return self._memo[1]

    @property
    def normalise_input(self) -> bool:
        """Whether eq. 1 reads h / ||h||_1 per token (SkipGates.router_norm; gating.inference_score too)."""
        return self.owner.router_norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = router_input(self, h)
        return F.linear(h, self.weight.to(h.dtype), self.bias.to(h.dtype))


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing every parameter, buffer and submodule of `module`; its own submodule
    table, so that replacing a child in the copy leaves the original untouched."""
    out = copy.copy(module)
    out._modules = dict(module._modules)  # noqa: SLF001 -- the point of a shallow module copy
    return out


# The twin's floor on g before ln(g) (eq. 3; config.gate_eps, 1e-6 for models trained gated). A pretrained
# model's first token is an attention sink, its logit ~14+ above the others: closed, the 1e-6 floor still gave
# it a weight of 1e-6 e^14 or more, where real skipping gives it none (SmolLM2's logits 3.5-5.6 apart, the
# greedy tokens split at the 10th). At 1e-30 (e^-69) training, --no-skip and real skipping compute one thing.
TWIN_GATE_EPS = 1e-30


def gated_twin(model: Transformer, gates: SkipGates, gate_grad: str = "exact") -> Transformer:
    """The gated model: `model`'s weights (shared, not copied) with `gates`' routers (and adapters); its gates'
    floor `TWIN_GATE_EPS`."""
    cfg = model.cfg
    if cfg.gating:
        raise ValueError("gated_twin takes the dense model; this one is gated already")
    if (gates.dim, gates.n_layers) != (cfg.dim, cfg.n_layers):
        raise ValueError(f"skip gates for dim {gates.dim} and {gates.n_layers} blocks, the model has dim "
                         f"{cfg.dim} and {cfg.n_layers} blocks")
    twin = _shallow(model)
    twin.cfg = dataclasses.replace(cfg, gating=True, gate_grad=gate_grad, gate_values=gates.gate_values,
                                   gate_eps=TWIN_GATE_EPS)
    twin.routers = gates.routers
    if gates.lora_rank:
        scale = gates.lora_alpha / gates.lora_rank
        blocks = []
        for layer, block in enumerate(model.layers):
            b = _shallow(block)
            att, ffn = _shallow(block.attention), _shallow(block.feed_forward)
            att.wo = LowRankLinear(block.attention.wo, gates.lora[f"{layer}_wo_a"], gates.lora[f"{layer}_wo_b"], scale)
            ffn.w2 = LowRankLinear(block.feed_forward.w2, gates.lora[f"{layer}_w2_a"], gates.lora[f"{layer}_w2_b"],
                                   scale)
            b.attention, b.feed_forward = att, ffn
            blocks.append(b)
        twin.layers = nn.ModuleList(blocks)
    return twin


def gate_loss(model: Transformer, gates: SkipGates, tokens: torch.Tensor, teacher: torch.Tensor,
              mask: torch.Tensor | None = None, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, list[float]]:
    """KL(p_dense || p_gated) over the counted positions + the controller's term (eq. 5) on their gates.

    teacher [B, T, V]: the dense model's logits (FrozenStates' final residual through the head). Returns
    (loss, [kl, regulariser]); the step's gate statistics are recorded for `SkipGates.after_step`.
    `generator`: where "sampled" gates draw their thresholds (gating.MirroredGates; None: the global RNG).
    """
    gates.calibrate(model, tokens, mask)
    twin = gates.twin(model, "straight_through")
    twin.gate_generator = generator
    try:
        out = twin(tokens, return_logits=False, output_hidden_states=True)
    finally:
        twin.gate_generator = None
    h, t, valid = gather_counted(out.hidden_states[-1], teacher, mask)
    kl = kl_to_base(t, twin.output(twin.norm(h)), valid)
    if mask is not None and not bool(mask.any()):
        # no counted position (a batch of prompts only): eq. 4's statistics are undefined, so neither the
        # controller's term nor its update takes part in this step (a zero with a graph keeps backward valid)
        reg = out.gates.sum() * 0.0
    else:
        mean, var = counted_stats(out.gates, mask, gates.n_layers)
        reg = gates.controller().loss(mean, var)
        if torch.is_grad_enabled():  # a training step (not a held-out evaluation): eq. 6 updates on it
            gates.record(mean, var)
    return kl + reg, [float(kl.detach()), float(reg.detach())]


def counted_stats(first_half: torch.Tensor, mask: torch.Tensor | None, n_layers: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4's per-block mean and variance of the gates [L/2, B, T] over the counted positions (all when
    `mask` is None), mirrored to [L] (block l >= L/2 has the gate of L-1-l)."""
    stats = GateStats.from_gates(list(first_half if mask is None else first_half[:, mask]), n_layers)
    return stats.mean, stats.var


class GatedDrafter(LayerSkipDrafter):
    """Self-speculation with learned per-token skipping: layer-skip drafting (Draft & Verify) where the
    drafting model is the gated twin and what it skips is decided per token by its gates, with real
    skipping of closed blocks; greedy, autoregressive, over the dense model's cache; the dense model
    verifies (lossless). The draft cost model (tree_cost) prices it as a layer-skip draft that skips
    nothing: an upper bound, since how much the gates skip is not known before drafting."""

    real_skip = True
    static_step = False  # (its drafting model, the gated twin, is not the static step's: real skipping)

    def __init__(self, model: Transformer, gates: SkipGates) -> None:
        super().__init__(gates.twin(model))
        self.gates = gates


__all__ = ["SkipGates", "LowRankLinear", "gated_twin", "gate_loss", "counted_stats", "GatedDrafter"]

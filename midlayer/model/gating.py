"""Skip-middle gating (Lawson & Aitchison 2025, section 2.1, eqs. 1-2) and per-block gate statistics.

For each first-half block l < L/2 a router reads the residual stream h(i, l) *entering* block l:

    s(i, l) = ReLU(w_l . h(i, l) + b_l)              (eq. 1)
    S(i, l) = sum_{l' <= l} s(i, l')                 (cumulative, non-decreasing)
    g(i, l) = 1 - clamp(S(i, l), 0, 1)   for l < L/2  (eq. 2)
    g(i, l) = g(i, L-1-l)                for l >= L/2 (block l mirrors block L-1-l)

Once S >= 1 at block l the token skips the symmetric middle span [l, L-1-l] and resumes at block L-l.
All-zero routers give g = 1 everywhere, i.e. the dense model; but ReLU'(0) = 0 passes no gradient, so for
training from scratch the dense baseline is an explicit mode (`ModelConfig.gating = False`), never a
zero-initialised router. (Routers added to a pretrained model do start at zero, and train through the
straight-through gradient: skip_gates.py.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import nn

from midlayer.config import GATE_GRADS, GATE_VALUES, REG_GRADS
from .sparsity import gate_stats


def mirror_index(layer: int, n_layers: int) -> int:
    """The first-half block whose gate block `layer` uses: l for l < L/2, else L-1-l (eq. 2)."""
    return layer if layer < n_layers // 2 else n_layers - 1 - layer


def router_input(router: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """What router l of eq. 1 reads: h, or h / ||h||_1 per row for a router with `normalise_input`
    (skip_gates.ScaledRouter). One rule for the training, inference and module paths, which must not differ:
    the training branch once read the raw h, so `--router-norm` trained other gates than those that run."""
    if getattr(router, "normalise_input", False):
        return h / h.abs().sum(-1, keepdim=True).clamp_min(1e-30)
    return h


def inference_score(router: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """w.h + b of eq. 1 at inference, [B, M], as a per-row product and sum over d. PyTorch reduces each row
    in the same order however many rows share the call, so a token's gate -- and which blocks it skips -- is
    the same bits in a decode step, a verification forward or a prefill (batch invariance; the MKL
    matrix-vector product behind nn.Linear is not: tests/test_kernels.py). One expression for the tensor
    and the one-row paths of `MirroredGates`, so that they cannot drift apart. A router with
    `normalise_input` (skip_gates.ScaledRouter) reads h / ||h||_1, per row as well (`router_input`)."""
    h = router_input(router, h)
    return (h * router.weight[0].to(h.dtype)).sum(-1) + router.bias[0].to(h.dtype)


class Routers(nn.ModuleList):
    """One `nn.Linear(dim, 1)` per first-half block, and the cumulative gate of eqs. 1-2."""

    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__([nn.Linear(dim, 1) for _ in range(n_layers // 2)])

    @staticmethod
    def step(router: nn.Linear, h: torch.Tensor, cum: torch.Tensor | None,
             lin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One first-half block: (gate g [B, T], new cumulative S [B, T], new linear sum) from h [B, T, d].

        `lin` is the running sum of the raw scores w.h + b (no ReLU, no clamp), kept only while autograd
        records: it carries the straight-through gradient of `straight_through`. Inference passes None.
        """
        if torch.is_grad_enabled():  # in fp32 under autocast too: in bf16 the trained gates were off by up to 0.07
            with torch.autocast(h.device.type, enabled=False):  # from the ones evaluation and inference compute
                score = nn.functional.linear(router_input(router, h.float()), router.weight.float(),
                                             None if router.bias is None else router.bias.float()).squeeze(-1)
        else:
            score = inference_score(router, h).float()
        s = torch.relu(score)
        cum = s if cum is None else cum + s
        if torch.is_grad_enabled():
            lin = score if lin is None else lin + score
        return 1.0 - cum.clamp(0.0, 1.0), cum, lin


def straight_through(gate: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
    """The gate's value with the gradient of 1 - sum_{l' <= l} (w_l'.h + b_l'): ReLU and clamp of eqs. 1-2
    taken as the identity in the backward pass (a straight-through estimator, Bengio et al. 2013).

    Why: eq. 2 passes no gradient to a token whose gate is saturated -- S >= 1 (gate exactly 0: the clamp)
    or every score so far <= 0 (gate exactly 1: the ReLU). A loss on the gate statistics then acts only
    through the unsaturated tokens, and the saturated ones move only as a side effect of shared router
    weights (issue 14: the controller missed its targets, the uncontrolled model kept its sparsity). The
    value is exactly the gate's (x - x.detach() is exactly 0), so the forward pass is unchanged; the gradient
    is the linear one alone (eq. 2's own path is detached).
    """
    return gate.detach() - (lin - lin.detach())


class _InwardStraightThrough(torch.autograd.Function):
    """Value: the gate. Backward: the gate's own (eq. 2) gradient for every token, and in addition the
    straight-through one (d g / d lin = -1) for a saturated token whose incoming gradient points back into
    (0, 1): a closed gate (g = 0) the loss would open, or an open one (g = 1) it would close."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate.detach())
        return gate.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (g,) = ctx.saved_tensors
        # descent moves g by -grad: up (opening) where grad < 0, down (closing) where grad > 0
        inward = ((g <= 0) & (grad < 0)) | ((g >= 1) & (grad > 0))
        return grad, torch.where(inward, -grad, torch.zeros_like(grad))


def inward_straight_through(gate: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
    """The gate's value with eq. 2's gradient, plus the straight-through gradient of `straight_through` only
    for saturated tokens the incoming gradient would move back into (0, 1).

    Why (issue 14, docs/results/controller-cpu.md items 9-11): the straight-through regulariser meets every
    block's target but costs validation CE, and half of that cost enters through the routers' inputs h. It
    also pushes tokens that are saturated on the side the loss wants -- with a target of 1.0, ~99% of block
    0's gates already sit at exactly 1 and are pushed further open, into every one of their residual streams,
    for no change in any gate. Here only the gates that the loss wants to leave saturation feel it."""
    return _InwardStraightThrough.apply(gate, lin)


class MirroredGates:
    """Gives each block's gate in order, for one forward pass: routers on the first half (cumulative,
    eqs. 1-2), the mirror of block L-1-l on the second. Must be called with layer = 0, 1, ..., L-1 in order
    (the cumulative sum S of eq. 2 needs every lower block): any other call is refused, so that a partial
    forward cannot silently start a gated model mid-network with S = 0.

    `gate_grad` (ModelConfig): "exact" gives the model eq. 2's gates; "straight_through" the same values
    with the straight-through gradient (`straight_through`). While autograd records, `gate_lin` holds each
    first-half block's eq. 2 gate and running score sum, and `router_reads` its router and input, whatever
    `gate_grad` is: GateStats derives from them, on demand, the twins a controller loss may differentiate
    (SparsityConfig.reg_grad).

    `gate_values` (ModelConfig): "soft" gives eq. 2's g; "hard" rounds it, g = 1 while S < 1/2 and 0 from
    there on, so a block either runs undamped or is skipped. Why (issue 15): trained on a pretrained model,
    soft gates settled at uniform fractions (0.6-0.8 for every token) that skip nothing and still cost the
    multiply; with hard gates the sparsity the controller asks for is real skipping, and the KL it costs is
    measured on the computation the engine runs. The rounding's gradient is 0 almost everywhere, so hard
    gates train through the straight-through gradient (the same linear one as for soft gates).

    "sampled" is "hard" with a random threshold while autograd records: g = 1 while S < u, with one
    u ~ U(0, 1] per token and forward (from `generator`, else the global RNG), so that P(g = 1) = 1 - clamp(S)
    = eq. 2's soft gate, and g stays 0 once it closes (S never decreases). Why: trained from the dense start,
    hard gates oscillate -- at g = 1 the KL to the dense model is at its minimum, so its gradient says nothing
    about which tokens could close until many cross S = 1/2 at once. With sampled thresholds a token with
    S = 0.2 runs closed on a fifth of its steps, and the KL of those closed runs reaches its router (straight
    through) before it closes for good. Without autograd (evaluation, generation) u = 1/2: the hard gates
    the engine runs, which are the sampled ones' median."""

    def __init__(self, routers: Routers, n_layers: int, gate_grad: str = "exact", gate_values: str = "soft",
                 generator: torch.Generator | None = None) -> None:
        if gate_grad not in GATE_GRADS:
            raise ValueError(f"gate_grad must be one of {GATE_GRADS}, got {gate_grad!r}")
        if gate_values not in GATE_VALUES:
            raise ValueError(f"gate_values must be one of {GATE_VALUES}, got {gate_values!r}")
        self.routers, self.n_layers, self.gate_grad = routers, n_layers, gate_grad
        self.hard = gate_values in ("hard", "sampled")
        self.sampled, self.generator = gate_values == "sampled", generator
        self.threshold: torch.Tensor | None = None  # "sampled" in training: u per token, drawn at block 0
        self.closed_at = 0.5 if self.hard else 1.0  # S at and beyond which g = 0 (S never decreases)
        self.first_half: list[torch.Tensor] = []
        self.router_reads: list[tuple[nn.Module, torch.Tensor]] = []  # (router l, h entering l), autograd only
        self.gate_lin: list[tuple[torch.Tensor, torch.Tensor]] = []  # (eq. 2's gate, running score sum), autograd
        self.cum: torch.Tensor | None = None
        self.lin: torch.Tensor | None = None
        self.next_layer = 0
        # inference only: whether every gate of the last block asked for is exactly 1 (None while autograd
        # records); `Transformer.run_blocks` then runs the block as a dense one. Kept per first-half block for
        # the mirrored second half.
        self.open: bool | None = None
        self.first_open: list[bool | None] = []
        self._cum1: np.float32 | None = None  # one-row inference: S as a float32 scalar

    def _one_row(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """`Routers.step` for a single row at inference (the batch-1 decode step), with eq. 1-2's scalar
        arithmetic on the host in float32 (numpy): the same bits as the tensor path -- the score is the same
        per-row product and sum, then ReLU, the running sum and the clamp are single IEEE float32
        operations -- at a fraction of the cost of six tiny tensor ops."""
        score = inference_score(self.routers[layer], h)
        s = np.float32(max(float(score.float()), 0.0))  # ReLU (float32 -> float64 -> float32 is exact)
        cum = s if self._cum1 is None else np.float32(self._cum1 + s)
        self._cum1 = cum
        self.cum = None  # the tensor S is not kept in this mode (only `_cum1` is read)
        if self.hard:
            return torch.full((1, 1), 1.0 if cum < self.closed_at else 0.0, device=h.device)
        return torch.full((1, 1), float(np.float32(1.0) - np.float32(min(max(cum, 0.0), 1.0))), device=h.device)

    def __call__(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if layer != self.next_layer:
            raise ValueError(f"gates: block {layer} asked for out of order (expected block {self.next_layer}); a "
                             "gated model's gates need every block from 0 up, in order (eqs. 1-2)")
        self.next_layer += 1
        if layer >= self.n_layers // 2:
            self.open = self.first_open[self.n_layers - 1 - layer]
            return self.first_half[self.n_layers - 1 - layer]  # eq. 2: mirror of block L-1-l
        infer = not torch.is_grad_enabled()
        if infer and ((self._cum1 is not None and self._cum1 >= self.closed_at)
                      or (self.cum is not None and bool((self.cum >= self.closed_at).all()))):
            # inference, every row already closed (S >= 1; hard gates: S >= 1/2): S never decreases (ReLU
            # scores), so g = 0 here
            # whatever this router says -- skip computing it (the rows skip this block anyway)
            gate, self.open = torch.zeros(h.shape[:2], device=h.device), False
        elif infer and h.shape[0] * h.shape[1] == 1 and self.cum is None:
            gate = self._one_row(layer, h)
            self.open = float(gate) == 1.0
        else:
            gate, self.cum, self.lin = Routers.step(self.routers[layer], h, self.cum, self.lin)  # h entering l
            if self.hard:
                u = self.closed_at
                if self.sampled and not infer:
                    if self.threshold is None:  # u in (0, 1]: S = 0 never closes (class docstring)
                        r = torch.rand(self.cum.shape, generator=self.generator, device=self.cum.device)
                        self.threshold = 1.0 - r
                    u = self.threshold
                gate = (self.cum < u).to(gate.dtype)  # eq. 2's g rounded (class docstring)
            if self.lin is not None:
                self.router_reads.append((self.routers[layer], h))
                self.gate_lin.append((gate, self.lin))
                if self.gate_grad == "straight_through":
                    gate = straight_through(gate, self.lin)
            self.open = bool((gate == 1).all()) if infer else None
        self.first_half.append(gate)
        self.first_open.append(self.open)
        return gate


def mirrored_gate_stats(first_half: list[torch.Tensor], n_layers: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """eq. 4's (mean, var, zero fraction) per block [L] from the first-half gates (each [B, T]; block l >= L/2
    repeats its mirror L-1-l, eq. 2), and the number of token positions."""
    g = torch.stack([x.reshape(-1) for x in first_half])  # [L/2, N]
    mean, var, zero = gate_stats(g)
    idx = [mirror_index(layer, n_layers) for layer in range(n_layers)]
    return mean[idx], var[idx], zero[idx], g.shape[1]


@dataclass
class GateStats:
    """Per-block gate statistics over the token positions of one forward pass (eq. 4).

    `mean` and `var` ([L], differentiable) feed the controller's loss; `zero_frac` ([L]) is the paper's
    sparsity, the fraction of gates exactly 0. Second-half entries repeat their mirrored first-half block.
    `mean_st`, `var_st`: the same values computed from the straight-through gates (other gradient), present
    when the pass recorded autograd (SparsityConfig.reg_grad = "straight_through" differentiates them).
    `regulariser_inputs` picks the pair a controller's loss differentiates. Each is computed on first use, so
    a training step whose loss does not read it pays nothing for it.
    """

    mean: torch.Tensor
    var: torch.Tensor
    zero_frac: torch.Tensor
    n_tokens: int
    router_reads: list[tuple[nn.Module, torch.Tensor]] | None = field(default=None, repr=False)
    gate_lin: list[tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    @cached_property
    def _st(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        if not self.gate_lin:
            return None, None
        return mirrored_gate_stats([straight_through(gate, lin) for gate, lin in self.gate_lin], len(self.mean))[:2]

    @cached_property
    def _st_routers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The straight-through twins again, with the running sum of raw scores taken over w_l . h.detach() + b_l:
        the same values, and a gradient that reaches the routers' weights and biases but not h, hence not the
        residual stream, the blocks or the embedding. Why (issue 14, docs/results/controller-cpu.md item 9):
        through h the twins' gradient, alpha w per token, enters every token's residual stream, and the
        hypothesis under test is that this is what costs the straight-through regulariser its quality."""
        if not self.gate_lin or not self.router_reads:
            raise ValueError("straight_through_routers needs a forward pass that recorded autograd")
        lin, twins = None, []
        for (gate, _), (router, h) in zip(self.gate_lin, self.router_reads):
            score = router(h.detach()).squeeze(-1).float()  # Routers.step's training score, h detached
            lin = score if lin is None else lin + score
            twins.append(straight_through(gate, lin))
        return mirrored_gate_stats(twins, len(self.mean))[:2]

    @cached_property
    def _st_inward(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.gate_lin:
            raise ValueError("straight_through_inward needs a forward pass that recorded autograd")
        twins = [inward_straight_through(gate, lin) for gate, lin in self.gate_lin]
        return mirrored_gate_stats(twins, len(self.mean))[:2]

    def regulariser_inputs(self, reg_grad: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, var) per block for the controller's loss, differentiated as SparsityConfig.reg_grad says:
        "exact" the model's own gates, "straight_through" their twins, "straight_through_routers" the twins
        with the routers' inputs detached (`_st_routers`), "straight_through_inward" eq. 2's gates with the
        straight-through gradient added only where it leads a saturated gate back into (0, 1)
        (`inward_straight_through`). Same values in all four."""
        if reg_grad == "exact":
            return self.mean, self.var
        if reg_grad == "straight_through_inward":
            return self._st_inward
        if reg_grad == "straight_through":
            if self.mean_st is None:
                raise ValueError("straight_through needs a forward pass that recorded autograd")
            return self.mean_st, self.var_st
        if reg_grad == "straight_through_routers":
            return self._st_routers
        raise ValueError(f"reg_grad must be one of {REG_GRADS}, got {reg_grad!r}")

    @property
    def mean_st(self) -> torch.Tensor | None:
        return self._st[0]

    @property
    def var_st(self) -> torch.Tensor | None:
        return self._st[1]

    @staticmethod
    def from_gates(first_half: list[torch.Tensor], n_layers: int,
                   router_reads: list[tuple[nn.Module, torch.Tensor]] | None = None,
                   gate_lin: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> "GateStats":
        return GateStats(*mirrored_gate_stats(first_half, n_layers), router_reads or None, gate_lin or None)

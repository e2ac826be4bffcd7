"""Gate-sparsity control (paper section 2.4, eq. 4-6 and Table 1).

Lawson & Aitchison, *Learning to Skip the Middle Layers of Transformers* (arXiv 2506.21103). Without a
regulariser the cross-entropy alone pushes every gate towards 1 and the gated model drifts back to the
dense one (Figure 2), so a loss on the per-block gate statistics keeps the mean gate of block l near a
target mu*_l and its variance near sigma2*_l = mu*_l (1 - mu*_l).

Pieces:

- `mean_targets` / `var_targets`: the per-block targets (text above eq. 5).
- `SparsityController` (built by `make_controller`): the regularisation loss and the coefficient update of
  every Table 1 variant, selected by `SparsityConfig.controller`.
- `GateStatsAccumulator`: combines per-micro-batch statistics (and, under torch.distributed, per-rank
  statistics) into the statistics of all tokens of one optimizer step, which is what eq. 6 updates on.
- `gate_stats`: eq. 4 for a tensor of gates, for tests and tools (the model computes its own).

Indexing: blocks are 0-indexed, l = 0..L-1; the gate of block l >= L/2 is the gate of block L-1-l (eq. 2),
so every per-block tensor here is mirror-symmetric when it comes from the model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from midlayer.config import CONTROLLERS, SparsityConfig

# Controllers whose coefficients move after every optimizer step (Table 1, "update rule" column).
ADAPTIVE_KINDS = ("adaptive", "proportional")
# Controllers whose coefficients stay at the configured alpha, beta.
FIXED_KINDS = ("sparsity", "sparsity_variance", "sparsity_variance_l2")


def _check_layers(n_layers: int) -> None:
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers <= 0 or n_layers % 2:
        raise ValueError(f"n_layers must be a positive even int (block l mirrors L-1-l), got {n_layers!r}")


def mean_targets(cfg: SparsityConfig, n_layers: int, device: torch.device | str | None = None) -> Tensor:
    """Per-block mean-gate targets mu*_l, shape [n_layers] (paper 2.4, text above eq. 5).

    Linearly spaced from `cfg.mu0` at block 0 to `cfg.mu_final` at block L/2-1 (the innermost gated block),
    then mirrored so that block L-1-l gets the target of block l. With L = 2 the single gated block is also
    the innermost one and gets `mu_final`, the value the paper sweeps.
    """
    _check_layers(n_layers)
    half = n_layers // 2
    if half == 1:
        first = torch.tensor([cfg.mu_final], dtype=torch.float32, device=device)
    else:
        first = torch.linspace(cfg.mu0, cfg.mu_final, half, dtype=torch.float32, device=device)
    return torch.cat([first, first.flip(0)])


def var_targets(mu: Tensor) -> Tensor:
    """Variance targets sigma2*_l = mu*_l (1 - mu*_l): the variance of a Bernoulli(mu*_l) gate (paper 2.4)."""
    return mu * (1 - mu)


class SparsityController:
    """Regularisation loss and coefficient updates for one Table 1 controller.

    `kind` is one of `CONTROLLERS`:

    - ``none``: no loss (gates drift to dense, Figure 2 "no control").
    - ``sparsity``: (1/L) sum_l alpha_l gbar_l, fixed alpha.
    - ``sparsity_variance``: (1/L) sum_l (alpha_l gbar_l + beta_l s2_l), fixed alpha, beta.
    - ``adaptive``: eq. 5 with alpha += gamma sign(gbar - mu*) (Table 1).
    - ``proportional``: eq. 5 with alpha += gamma (gbar - mu*) (eq. 6; the paper's default).
    - ``sparsity_variance_l2``: (1/L) sum_l (alpha_l (gbar_l - mu*_l)^2 + beta_l (s2_l - sigma2*_l)^2),
      fixed alpha, beta.

    Coefficients are float32 tensors of shape [L]; adaptive kinds start at 0 (paper: "initialised to
    zero"), fixed kinds at `cfg.alpha`, `cfg.beta`. They live on the CPU unless moved with `to()`; `loss`
    casts them to the statistics' device and dtype, so no move is needed for correctness.
    """

    def __init__(self, cfg: SparsityConfig, n_layers: int) -> None:
        _check_layers(n_layers)
        if cfg.controller not in CONTROLLERS:
            raise ValueError(f"controller must be one of {CONTROLLERS}, got {cfg.controller!r}")
        self.kind: str = cfg.controller
        self.n_layers = n_layers
        self.gamma = float(cfg.gamma)
        self.delta = float(cfg.delta)
        self.mu = mean_targets(cfg, n_layers)
        self.sigma2 = var_targets(self.mu)
        if self.kind in FIXED_KINDS:
            a0, b0 = float(cfg.alpha), float(cfg.beta)
        else:
            a0 = b0 = 0.0
        self.alpha = torch.full((n_layers,), a0, dtype=torch.float32)
        self.beta = torch.full((n_layers,), b0, dtype=torch.float32)
        # Proportional term (beyond the paper, issue 14): the loss uses alpha + kp * e with e the last step's
        # error (gbar - mu*, s2 - sigma2*, dead band applied). The paper's update makes alpha the *integral*
        # of the error; with kp > 0 the coefficients also react to the error itself, which damps the
        # overshoot of an integral that wound up while the gates were saturated.
        self.kp = float(cfg.kp)  # SparsityConfig allows kp > 0 only for the adaptive kinds
        self.err_mean = torch.zeros(n_layers, dtype=torch.float32)
        self.err_var = torch.zeros(n_layers, dtype=torch.float32)
        # Anti-windup (beyond the paper, issue 14): |beta| <= beta_max when > 0. The variance target
        # mu (1 - mu) is the largest variance a [0, 1] gate can have at mean mu, reached only by 0/1 gates, so
        # with soft gates s2 < sigma2* for good and eq. 6 drives beta down without end; through eq. 5 that
        # ramp pushes on the gates, and the mean's integral term lags behind a ramp. Clamping the integrator
        # is the textbook fix.
        self.beta_max = float(cfg.beta_max)
        if self.kind == "sparsity":
            # Table 1: this variant has a mean term only.
            self.beta.zero_()

    def to(self, device: torch.device | str) -> "SparsityController":
        """Move coefficients and targets to `device` (saves a host-to-device copy per `loss` call)."""
        for name in ("mu", "sigma2", "alpha", "beta", "err_mean", "err_var"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def _check_stats(self, mean: Tensor, var: Tensor) -> None:
        shape = (self.n_layers,)
        if tuple(mean.shape) != shape or tuple(var.shape) != shape:
            raise ValueError(f"expected gate mean and var of shape {shape}, "
                             f"got {tuple(mean.shape)} and {tuple(var.shape)}")

    def loss(self, mean: Tensor, var: Tensor) -> Tensor:
        """Scalar regularisation loss (eq. 5 / Table 1) from per-block gate mean and variance (eq. 4).

        `mean` and `var` carry gradient; the coefficients and targets are constants.
        """
        self._check_stats(mean, var)
        if self.kind == "none":
            # A graph-connected zero, so `loss.backward()` and `ce + loss` work unchanged.
            return mean.sum() * 0
        like = dict(device=mean.device, dtype=mean.dtype)
        alpha, beta = self.alpha.to(**like), self.beta.to(**like)
        if self.kp:
            alpha = alpha + self.kp * self.err_mean.to(**like)
            beta = beta + self.kp * self.err_var.to(**like)
        if self.kind == "sparsity":
            per_block = alpha * mean
        elif self.kind == "sparsity_variance_l2":
            mu, sigma2 = self.mu.to(**like), self.sigma2.to(**like)
            per_block = alpha * (mean - mu).square() + beta * (var - sigma2).square()
        else:  # sparsity_variance, adaptive, proportional: eq. 5
            per_block = alpha * mean + beta * var
        return per_block.sum() / self.n_layers

    @torch.no_grad()
    def update(self, mean: Tensor, var: Tensor) -> None:
        """Update adaptive coefficients once per optimizer step (eq. 6 / Table 1).

        `mean`, `var` must be the statistics of all tokens of the step (see `GateStatsAccumulator`), so
        every data-parallel rank computes the same update and the coefficients stay in sync without a
        broadcast. Dead band: no change while |diff| <= delta. The printed eq. 6 has the one-sided
        condition diff > delta, under which a coefficient could only grow: once the gates overshoot to
        below their target (diff < -delta) the pressure would never relax. The authors' released code tests
        |diff| > delta; we follow it (two-sided), so coefficients move both ways.
        """
        self._check_stats(mean, var)
        if self.kind not in ADAPTIVE_KINDS:
            return
        like = dict(device=self.alpha.device, dtype=self.alpha.dtype)
        d_mean = mean.detach().to(**like) - self.mu
        d_var = var.detach().to(**like) - self.sigma2
        for coef, err, diff in ((self.alpha, self.err_mean, d_mean), (self.beta, self.err_var, d_var)):
            outside = diff.abs() > self.delta
            step = diff if self.kind == "proportional" else torch.sign(diff)
            coef.add_(self.gamma * torch.where(outside, step, torch.zeros_like(step)))
            err.copy_(torch.where(outside, diff, torch.zeros_like(diff)))
        if self.beta_max > 0:
            self.beta.clamp_(-self.beta_max, self.beta_max)

    def metrics(self) -> dict[str, float]:
        """Per-block coefficients and targets as flat floats, for logging."""
        out: dict[str, float] = {}
        for name in ("alpha", "beta", "mu", "sigma2"):
            for l, v in enumerate(getattr(self, name).tolist()):
                out[f"{name}/{l}"] = float(v)
        return out

    def state_dict(self) -> dict[str, object]:
        """Coefficients and identity, for checkpoints (targets come from the config on load)."""
        return {"kind": self.kind, "n_layers": self.n_layers,
                "alpha": self.alpha.detach().cpu().clone(), "beta": self.beta.detach().cpu().clone(),
                "err_mean": self.err_mean.detach().cpu().clone(), "err_var": self.err_var.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore coefficients; refuse a state saved by another controller kind or layer count."""
        missing = {"kind", "n_layers", "alpha", "beta"} - set(state)
        if missing:
            raise ValueError(f"controller state is missing {sorted(missing)}")
        if state["kind"] != self.kind:
            raise ValueError(f"controller state is for kind {state['kind']!r}, this controller is {self.kind!r}")
        if state["n_layers"] != self.n_layers:
            raise ValueError(f"controller state is for {state['n_layers']} layers, this model has {self.n_layers}")
        for name in ("alpha", "beta"):
            value = torch.as_tensor(state[name])
            if tuple(value.shape) != (self.n_layers,):
                raise ValueError(f"controller state {name!r} has shape {tuple(value.shape)}, "
                                 f"expected ({self.n_layers},)")
            getattr(self, name).copy_(value)
        for name in ("err_mean", "err_var"):  # absent from checkpoints written before the kp term existed: 0
            value = torch.as_tensor(state.get(name, torch.zeros(self.n_layers)))
            getattr(self, name).copy_(value.reshape(self.n_layers))

    def __repr__(self) -> str:
        return (f"SparsityController(kind={self.kind!r}, n_layers={self.n_layers}, "
                f"gamma={self.gamma}, delta={self.delta})")


def make_controller(cfg: SparsityConfig, n_layers: int) -> SparsityController:
    """Build the controller selected by `cfg.controller` for a model with `n_layers` blocks."""
    return SparsityController(cfg, n_layers)


def gate_stats(gates: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 4 over token positions: per-block mean, population variance, fraction exactly 0.

    `gates` has shape [L, ...]: block first, every other dimension is a token position. Mean and variance
    keep the graph; the zero fraction (the paper's sparsity z_l, section 2.1) has no gradient.
    """
    flat = gates.reshape(gates.shape[0], -1)
    mean = flat.mean(dim=1)
    var = flat.var(dim=1, unbiased=False)  # eq. 4 divides by N, not N-1
    with torch.no_grad():
        zero = (flat == 0).float().mean(dim=1)
    return mean, var, zero


class GateStatsAccumulator:
    """Exact gate statistics over every token of an optimizer step, across micro-batches and ranks.

    Each `add` contributes N_k tokens with mean m_k, population variance v_k and zero fraction z_k. Because
    sum_i g_i = N_k m_k and sum_i g_i^2 = N_k (v_k + m_k^2), the sums S0 = sum N_k, S1 = sum N_k m_k,
    S2 = sum N_k (v_k + m_k^2), Z = sum N_k z_k determine the statistics of the concatenated tokens:
    mean = S1/S0, var = S2/S0 - mean^2, zero = Z/S0. Sums are float64 (S2/S0 - mean^2 cancels) and are
    all-reduced with one SUM collective when torch.distributed is initialised, so every rank gets the same
    result and the controller updates stay identical across ranks.

    Under DDP every rank must call `reduce` the same number of times (it is a collective); `reduce` does
    not modify the running sums, call `reset` to start the next step.
    """

    def __init__(self, n_layers: int, device: torch.device | str | None = None) -> None:
        if not isinstance(n_layers, int) or n_layers <= 0:
            raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
        self.n_layers = n_layers
        self.device = torch.device(device) if device is not None else None
        self._sums: Tensor | None = None  # [1 + 3L]: S0, S1[L], S2[L], Z[L]

    def reset(self) -> None:
        self._sums = None

    @property
    def n_tokens(self) -> int:
        """Tokens added on this rank since the last reset."""
        return 0 if self._sums is None else int(self._sums[0].item())

    @torch.no_grad()
    def add(self, mean: Tensor, var: Tensor, zero_frac: Tensor, n_tokens: int) -> None:
        L = self.n_layers
        for name, t in (("mean", mean), ("var", var), ("zero_frac", zero_frac)):
            if tuple(t.shape) != (L,):
                raise ValueError(f"{name} must have shape ({L},), got {tuple(t.shape)}")
        if int(n_tokens) != n_tokens or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
        if self._sums is None:
            dev = self.device if self.device is not None else mean.device
            self._sums = torch.zeros(1 + 3 * L, dtype=torch.float64, device=dev)
        like = dict(device=self._sums.device, dtype=torch.float64)
        m, v, z = (t.detach().to(**like) for t in (mean, var, zero_frac))
        n = float(n_tokens)
        self._sums[0] += n
        self._sums[1:1 + L] += n * m
        self._sums[1 + L:1 + 2 * L] += n * (v + m * m)
        self._sums[1 + 2 * L:] += n * z

    @torch.no_grad()
    def reduce(self) -> tuple[Tensor, Tensor, Tensor]:
        """(mean, var, zero_frac), float64 tensors of shape [L], over all tokens on all ranks."""
        L = self.n_layers
        if self._sums is None:
            # A rank with nothing to add must still join the collective.
            dev = self.device if self.device is not None else torch.device("cpu")
            sums = torch.zeros(1 + 3 * L, dtype=torch.float64, device=dev)
        else:
            sums = self._sums.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM)
        n = sums[0]
        if n.item() <= 0:
            raise ValueError("no gate statistics to reduce: add() was never called on any rank")
        mean = sums[1:1 + L] / n
        # Clamp: rounding can leave a tiny negative where all gates are equal.
        var = (sums[1 + L:1 + 2 * L] / n - mean * mean).clamp_min(0.0)
        zero = sums[1 + 2 * L:] / n
        return mean, var, zero


__all__ = ["mean_targets", "var_targets", "SparsityController", "make_controller", "gate_stats",
           "GateStatsAccumulator", "ADAPTIVE_KINDS", "FIXED_KINDS"]

"""Sparsity control (paper 2.4, eq. 4-6, Table 1) against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from midlayer.config import SparsityConfig
from midlayer.model.sparsity import GateStatsAccumulator, gate_stats, make_controller, mean_targets, var_targets


def _list(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.tolist()]


# --- targets ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_layers, mu_final, expected_mu, expected_var", [
    (4, 0.0, [1, 0, 0, 1], [0, 0, 0, 0]),
    (6, 0.0, [1, .5, 0, 0, .5, 1], [0, .25, 0, 0, .25, 0]),
    (8, 0.25, [1, .75, .5, .25, .25, .5, .75, 1], [0, .1875, .25, .1875, .1875, .25, .1875, 0]),
    # One gated block: it is the innermost one, so it gets the final target.
    (2, 0.5, [.5, .5], [.25, .25]),
])
def test_targets(n_layers: int, mu_final: float, expected_mu: list[float], expected_var: list[float]) -> None:
    mu = mean_targets(SparsityConfig(mu0=1.0, mu_final=mu_final), n_layers)
    assert _list(mu) == pytest.approx(expected_mu)
    assert _list(var_targets(mu)) == pytest.approx(expected_var)


@pytest.mark.parametrize("n_layers", [0, 3, -2])
def test_targets_refuse_odd_layers(n_layers: int) -> None:
    with pytest.raises(ValueError, match="even"):
        mean_targets(SparsityConfig(), n_layers)


# --- coefficient updates (eq. 6, Table 1) ------------------------------------------------------------------

# L = 6, mu0 = 1, mu_final = 0: mu* = [1, .5, 0, 0, .5, 1], sigma2* = [0, .25, 0, 0, .25, 0].
MEAN = torch.tensor([0.995, 0.505, 0.3, 0.0, 0.48, 1.0])
# mean - mu* = [-0.005, +0.005, +0.3, 0, -0.02, 0]
VAR = torch.tensor([0.001, 0.2, 0.5, 0.0, 0.25, 0.005])
# var - sigma2* = [+0.001, -0.05, +0.5, 0, 0, +0.005]


def _cfg(kind: str, **kw: float) -> SparsityConfig:
    return SparsityConfig(controller=kind, mu0=1.0, mu_final=0.0, gamma=1e-3, delta=1e-2, **kw)


def test_proportional_update_two_sided_dead_band() -> None:
    c = make_controller(_cfg("proportional"), 6)
    assert _list(c.alpha) == [0.0] * 6 and _list(c.beta) == [0.0] * 6
    c.update(MEAN, VAR)
    # |diff| <= 0.01 -> unchanged (both signs); -0.02 -> -1e-3 * 0.02; +0.3 -> +1e-3 * 0.3.
    assert _list(c.alpha) == pytest.approx([0, 0, 3e-4, 0, -2e-5, 0], abs=1e-9)
    # -0.05 -> -5e-5; +0.5 -> +5e-4; +0.001, +0.005 inside the band.
    assert _list(c.beta) == pytest.approx([0, -5e-5, 5e-4, 0, 0, 0], abs=1e-9)
    c.update(MEAN, VAR)  # coefficients accumulate step after step
    assert _list(c.alpha) == pytest.approx([0, 0, 6e-4, 0, -4e-5, 0], abs=1e-9)
    assert _list(c.beta) == pytest.approx([0, -1e-4, 1e-3, 0, 0, 0], abs=1e-9)



@pytest.mark.parametrize("kind", ["proportional", "adaptive"])
def test_the_dead_band_holds_a_difference_of_exactly_delta(kind: str) -> None:
    """|diff| <= delta changes nothing, on both sides, at the boundary itself (every number exact in fp32):
    delta 0.25, mean - mu* = [-.25, +.25, +.25, 0, -.25, +.25], var - sigma2* = [0, -.25, 0, 0, +.25, 0]; a
    difference of 0.5 moves the coefficient."""
    c = make_controller(SparsityConfig(controller=kind, mu0=1.0, mu_final=0.0, gamma=1e-3, delta=0.25), 6)
    c.update(torch.tensor([0.75, 0.75, 0.25, 0.0, 0.25, 1.25]), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.0]))
    assert _list(c.alpha) == [0.0] * 6 and _list(c.beta) == [0.0] * 6
    c.update(torch.tensor([1.0, 0.5, 0.0, 0.0, 0.5, 1.0]), torch.tensor([0.0, 0.75, 0.0, 0.0, 0.25, 0.0]))
    assert _list(c.alpha) == [0.0] * 6
    assert _list(c.beta) == pytest.approx([0, 5e-4 if kind == "proportional" else 1e-3, 0, 0, 0, 0], abs=1e-9)


def test_proportional_term_by_hand() -> None:
    """kp > 0 (beyond the paper): the loss coefficient is alpha + kp * e, with e the last update's error
    outside the dead band (0 inside it), so a step after an update the loss reacts to the error itself."""
    c = make_controller(_cfg("proportional", kp=0.5), 6)
    c.update(MEAN, VAR)
    # errors: mean [0, 0, .3, 0, -.02, 0], var [0, -.05, .5, 0, 0, 0] (|diff| <= 0.01 -> 0)
    assert _list(c.err_mean) == pytest.approx([0, 0, 0.3, 0, -0.02, 0], abs=1e-7)
    assert _list(c.err_var) == pytest.approx([0, -0.05, 0.5, 0, 0, 0], abs=1e-7)
    mean = torch.ones(6, requires_grad=True)
    var = torch.ones(6, requires_grad=True)
    c.loss(mean, var).backward()
    # d loss / d mean_l = (alpha_l + kp e_l) / L, alpha from test_proportional_update_two_sided_dead_band
    want = [(a + 0.5 * e) / 6 for a, e in zip([0, 0, 3e-4, 0, -2e-5, 0], [0, 0, 0.3, 0, -0.02, 0])]
    assert _list(mean.grad) == pytest.approx(want, abs=1e-8)
    want_v = [(b + 0.5 * e) / 6 for b, e in zip([0, -5e-5, 5e-4, 0, 0, 0], [0, -0.05, 0.5, 0, 0, 0])]
    assert _list(var.grad) == pytest.approx(want_v, abs=1e-8)
    # kp = 0 is the paper: the same update gives gradient alpha / L alone
    c0 = make_controller(_cfg("proportional"), 6)
    c0.update(MEAN, VAR)
    mean0 = torch.ones(6, requires_grad=True)
    c0.loss(mean0, torch.ones(6)).backward()
    assert _list(mean0.grad) == pytest.approx([a / 6 for a in [0, 0, 3e-4, 0, -2e-5, 0]], abs=1e-9)
    # the errors travel with the state (exact resume); a state saved before kp existed loads them as 0
    c2 = make_controller(_cfg("proportional", kp=0.5), 6)
    c2.load_state_dict(c.state_dict())
    assert torch.equal(c2.err_mean, c.err_mean) and torch.equal(c2.err_var, c.err_var)
    old = {k: v for k, v in c.state_dict().items() if not k.startswith("err_")}
    c2.load_state_dict(old)
    assert _list(c2.err_mean) == [0.0] * 6


def test_beta_max_clamps_the_variance_integrator_by_hand() -> None:
    """beta_max > 0 (anti-windup, beyond the paper): after each update |beta| <= beta_max; alpha is not bound.
    gamma 1e-3; block 2's var error +0.5 adds 5e-4 a step, block 1's -0.05 adds -5e-5: with beta_max 1.2e-3
    block 2 is held at 1.2e-3 from the third step, block 1 goes on (-1e-4, -1.5e-4, ...)."""
    c = make_controller(_cfg("proportional", beta_max=1.2e-3), 6)
    for _ in range(3):
        c.update(MEAN, VAR)
    assert _list(c.beta) == pytest.approx([0, -1.5e-4, 1.2e-3, 0, 0, 0], abs=1e-9)
    assert _list(c.alpha) == pytest.approx([0, 0, 9e-4, 0, -6e-5, 0], abs=1e-9)
    free = make_controller(_cfg("proportional"), 6)
    for _ in range(3):
        free.update(MEAN, VAR)
    assert float(free.beta[2]) == pytest.approx(1.5e-3)  # beta_max = 0: eq. 6 unbounded
    # the bound holds below zero too (the windup it prevents is downward: soft gates keep the variance under
    # its target): var - sigma2* = -0.25 at blocks 1 and 4 adds -2.5e-4 a step, held at -6e-4 from the third
    low = make_controller(_cfg("proportional", beta_max=6e-4), 6)
    for _ in range(3):
        low.update(torch.tensor([1.0, 0.5, 0.0, 0.0, 0.5, 1.0]), torch.zeros(6))
    assert _list(low.beta) == pytest.approx([0, -6e-4, 0, 0, -6e-4, 0], abs=1e-9)
    with pytest.raises(ValueError, match="beta_max"):
        SparsityConfig(beta_max=-1.0)
    with pytest.raises(ValueError, match="beta_max"):
        SparsityConfig(controller="sparsity_variance", beta_max=0.1)


def test_adaptive_update_uses_sign() -> None:
    c = make_controller(_cfg("adaptive"), 6)
    c.update(MEAN, VAR)
    assert _list(c.alpha) == pytest.approx([0, 0, 1e-3, 0, -1e-3, 0], abs=1e-9)
    assert _list(c.beta) == pytest.approx([0, -1e-3, 1e-3, 0, 0, 0], abs=1e-9)


@pytest.mark.parametrize("kind", ["none", "sparsity", "sparsity_variance", "sparsity_variance_l2"])
def test_fixed_kinds_never_change(kind: str) -> None:
    c = make_controller(_cfg(kind, alpha=0.1, beta=0.2), 6)
    before = (c.alpha.clone(), c.beta.clone())
    for _ in range(3):
        c.update(MEAN, VAR)
    assert torch.equal(c.alpha, before[0]) and torch.equal(c.beta, before[1])


def test_initial_coefficients() -> None:
    assert _list(make_controller(_cfg("sparsity_variance", alpha=0.1, beta=0.2), 4).alpha) == pytest.approx([0.1] * 4)
    assert _list(make_controller(_cfg("sparsity_variance", alpha=0.1, beta=0.2), 4).beta) == pytest.approx([0.2] * 4)
    # Adaptive kinds start at 0 whatever alpha/beta say (paper: "initialised to zero").
    assert _list(make_controller(_cfg("proportional", alpha=0.1, beta=0.2), 4).alpha) == [0.0] * 4


# --- losses (eq. 5, Table 1) -------------------------------------------------------------------------------

# L = 4, mu0 = 1, mu_final = 0.5: mu* = [1, .5, .5, 1], sigma2* = [0, .25, .25, 0].
LMEAN = [1.0, 0.5, 0.25, 0.75]
LVAR = [0.0, 0.25, 0.1, 0.2]


def _loss(kind: str, state: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = SparsityConfig(controller=kind, mu0=1.0, mu_final=0.5, alpha=0.1, beta=0.2)
    c = make_controller(cfg, 4)
    if state is not None:
        c.load_state_dict(state)
    mean = torch.tensor(LMEAN, requires_grad=True)
    var = torch.tensor(LVAR, requires_grad=True)
    loss = c.loss(mean, var)
    loss.backward()
    return loss.detach(), mean.grad, var.grad


def test_loss_values() -> None:
    # sparsity: 0.1 * (1 + .5 + .25 + .75) / 4
    assert _loss("sparsity")[0].item() == pytest.approx(0.0625)
    # sparsity_variance: (0.1 * 2.5 + 0.2 * (0 + .25 + .1 + .2)) / 4 = (0.25 + 0.11) / 4
    assert _loss("sparsity_variance")[0].item() == pytest.approx(0.09)
    # l2: mean - mu* = [0, 0, -.25, -.25] -> 0.125; var - sigma2* = [0, 0, -.15, .2] -> 0.0625
    #     (0.1 * 0.125 + 0.2 * 0.0625) / 4
    assert _loss("sparsity_variance_l2")[0].item() == pytest.approx(0.00625)
    # Adaptive kinds start at 0.
    assert _loss("proportional")[0].item() == 0.0
    state = {"n_layers": 4, "alpha": torch.tensor([1.0, 2.0, 3.0, 4.0]), "beta": torch.tensor([1.0, 1.0, 2.0, 2.0])}
    for kind in ("proportional", "adaptive"):
        loss, gmean, gvar = _loss(kind, {**state, "kind": kind})
        # (1 + 1 + .75 + 3 + 0 + .25 + .2 + .4) / 4
        assert loss.item() == pytest.approx(1.65)
        assert _list(gmean) == pytest.approx([0.25, 0.5, 0.75, 1.0])  # alpha / L
        assert _list(gvar) == pytest.approx([0.25, 0.25, 0.5, 0.5])  # beta / L


def test_none_loss_is_zero_and_backpropagates() -> None:
    loss, gmean, gvar = _loss("none")
    assert loss.item() == 0.0
    assert _list(gmean) == [0.0] * 4


def test_loss_rejects_wrong_shape() -> None:
    c = make_controller(SparsityConfig(), 4)
    with pytest.raises(ValueError, match="shape"):
        c.loss(torch.zeros(2), torch.zeros(2))


# --- checkpoint state --------------------------------------------------------------------------------------

def test_state_dict_round_trip_and_refusal() -> None:
    c = make_controller(_cfg("proportional"), 6)
    c.update(MEAN, VAR)
    state = c.state_dict()
    d = make_controller(_cfg("proportional"), 6)
    d.load_state_dict(state)
    assert torch.equal(d.alpha, c.alpha) and torch.equal(d.beta, c.beta)
    c.update(MEAN, VAR)  # the saved state is a copy
    assert not torch.equal(d.alpha, c.alpha)
    with pytest.raises(ValueError, match="kind"):
        make_controller(_cfg("adaptive"), 6).load_state_dict(state)
    with pytest.raises(ValueError, match="layers"):
        make_controller(_cfg("proportional"), 4).load_state_dict(state)


# --- statistics (eq. 4) across micro-batches -----------------------------------------------------------------

def test_gate_stats_hand() -> None:
    gates = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.0, 0.0]])
    mean, var, zero = gate_stats(gates)
    assert _list(mean) == pytest.approx([0.75, 0.25])
    assert _list(var) == pytest.approx([0.1875, 0.0625])  # population variance
    assert _list(zero) == pytest.approx([0.25, 0.5])


def test_accumulator_hand() -> None:
    # Block 0: micro-batch [0, 1] then [1, 1, 1, 0]; together [0, 1, 1, 1, 1, 0]:
    # mean 4/6, var 4/6 - (4/6)^2 = 2/9, zero 2/6. Block 1 is all 1.
    acc = GateStatsAccumulator(2)
    acc.add(torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.0]), torch.tensor([0.5, 0.0]), 2)
    acc.add(torch.tensor([0.75, 1.0]), torch.tensor([0.1875, 0.0]), torch.tensor([0.25, 0.0]), 4)
    assert acc.n_tokens == 6
    mean, var, zero = acc.reduce()
    assert _list(mean) == pytest.approx([2 / 3, 1.0])
    assert _list(var) == pytest.approx([2 / 9, 0.0])
    assert _list(zero) == pytest.approx([1 / 3, 0.0])
    acc.reset()
    with pytest.raises(ValueError, match="never called"):
        acc.reduce()


def test_accumulator_equals_concatenation() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.rand(4, 2, 3, generator=g).clamp_max(0.8) / 0.8  # some exact 1s
    b = (torch.rand(4, 5, 7, generator=g) - 0.3).clamp_min(0)  # some exact 0s
    acc = GateStatsAccumulator(4)
    for x in (a, b):
        m, v, z = gate_stats(x)
        acc.add(m, v, z, x[0].numel())
    mean, var, zero = acc.reduce()
    ref = gate_stats(torch.cat([a.reshape(4, -1), b.reshape(4, -1)], dim=1).double())
    for got, want in zip((mean, var, zero), ref):
        assert torch.allclose(got, want.double(), atol=1e-6)


def test_accumulator_rejects_bad_input() -> None:
    acc = GateStatsAccumulator(2)
    with pytest.raises(ValueError, match="n_tokens"):
        acc.add(torch.zeros(2), torch.zeros(2), torch.zeros(2), 0)
    with pytest.raises(ValueError, match="shape"):
        acc.add(torch.zeros(3), torch.zeros(2), torch.zeros(2), 1)

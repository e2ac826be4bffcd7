"""Straight-through gate gradients (issue 14): the same forward values as eq. 2, and by hand the gradient that
eq. 2 withholds from saturated tokens (S >= 1: gate 0; every score <= 0: gate 1)."""

from __future__ import annotations

import pytest
import torch

from midlayer.config import ModelConfig, SparsityConfig
from midlayer.model.gating import inward_straight_through, straight_through
from midlayer.model.transformer import Transformer

SMALL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=64, max_seq_len=32, multiple_of=16)


def _model(gate_grad: str, bias0: float = 0.0, scale: float = 0.5) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**SMALL, gate_grad=gate_grad))
    with torch.no_grad():
        for r in m.routers:
            r.weight.normal_(0, scale)
        m.routers[0].bias.fill_(bias0)
        m.routers[1].bias.fill_(0.2)
    return m


def test_straight_through_value_is_the_gate_and_gradient_is_linear():
    gate = torch.tensor([0.0, 0.3, 1.0])
    lin = torch.tensor([2.0, 0.7, -1.0], requires_grad=True)
    st = straight_through(gate, lin)
    assert torch.equal(st, gate)
    st.sum().backward()
    assert torch.equal(lin.grad, -torch.ones(3))  # d(1 - lin)/d lin, for every token


def test_forward_values_identical_and_stats_twins_equal():
    x = torch.randint(0, 64, (2, 16))
    out_e = _model("exact")(x, x)
    out_s = _model("straight_through")(x, x)
    assert torch.equal(out_e.logits, out_s.logits) and torch.equal(out_e.loss, out_s.loss)
    for out in (out_e, out_s):
        st = out.gate_stats
        assert torch.equal(st.mean, st.mean_st) and torch.equal(st.var, st.var_st)
    assert bool((out_e.gates == 0).any()) and bool(((out_e.gates > 0) & (out_e.gates < 1)).any())
    with torch.no_grad():  # inference builds no twins
        assert _model("exact")(x).gate_stats.mean_st is None


def test_mean_gate_gradient_by_hand():
    """Block 0: g = 1 - clamp(relu(w.h + b), 0, 1) with h the embedding. d mean(g)/d b is minus the fraction of
    tokens with 0 < w.h + b < 1 under eq. 2, and exactly -1 straight through. Block 1's straight-through mean
    has gradient -1 with respect to its own bias (g_1 = 1 - (score_0 + score_1) in the backward pass; b_0
    also reaches block 1 through the residual, so only b_1 has a hand value)."""
    x = torch.randint(0, 64, (2, 16))
    m = _model("exact")
    out = m(x, x)
    with torch.no_grad():
        score0 = m.routers[0](m.embed(x)).squeeze(-1)
    unsaturated = ((score0 > 0) & (score0 < 1)).float().mean()
    assert 0 < unsaturated < 1  # the test means something: some tokens saturated, some not
    (g_exact,) = torch.autograd.grad(out.gate_stats.mean[0], m.routers[0].bias, retain_graph=True)
    torch.testing.assert_close(g_exact, -unsaturated.reshape(1), rtol=1e-6, atol=1e-7)
    g_st = [torch.autograd.grad(out.gate_stats.mean_st[0], m.routers[0].bias, retain_graph=True)[0],
            torch.autograd.grad(out.gate_stats.mean_st[1], m.routers[1].bias)[0]]
    for g in g_st:
        torch.testing.assert_close(g, torch.tensor([-1.0]), rtol=1e-6, atol=1e-7)


def test_saturated_router_gets_gradient_only_straight_through():
    """Router 0's bias so large that every token has S >= 1 at block 0: every gate is 0, eq. 2 passes no
    gradient to any router; the straight-through model's cross-entropy reaches them."""
    x = torch.randint(0, 64, (2, 16))
    grads = {}
    for mode in ("exact", "straight_through"):
        m = _model(mode, bias0=50.0)
        out = m(x, x)
        assert bool((out.gates == 0).all())
        out.loss.backward()
        grads[mode] = m.routers[0].bias.grad
    assert grads["exact"] is None or float(grads["exact"].abs().max()) == 0.0
    assert float(grads["straight_through"].abs().max()) > 0


def test_bad_settings_refused():
    with pytest.raises(ValueError, match="gate_grad"):
        ModelConfig(**SMALL, gate_grad="soft")
    with pytest.raises(ValueError, match="reg_grad"):
        SparsityConfig(reg_grad="soft")


def test_router_only_regulariser_same_values_gradient_to_routers_alone():
    """reg_grad = "straight_through_routers": eq. 4's statistics with the same values as the other two; their
    gradient with respect to the routers' biases is the straight-through one by hand (d mean_1 / d b_1 = -1),
    with respect to router 0's weight exactly -mean(h_0) (h_0 = the embedding, a constant on this path), and
    no other parameter (embedding, blocks) receives any -- unlike "straight_through", whose gradient reaches
    them through each router's input."""
    x = torch.randint(0, 64, (2, 16))
    m = _model("exact")
    out = m(x, x)
    s = out.gate_stats
    for kind in ("exact", "straight_through", "straight_through_routers"):
        mean, var = s.regulariser_inputs(kind)
        assert torch.equal(mean, s.mean) and torch.equal(var, s.var)
    mean_r, _ = s.regulariser_inputs("straight_through_routers")
    (gb1,) = torch.autograd.grad(mean_r[1], m.routers[1].bias, retain_graph=True)
    torch.testing.assert_close(gb1, torch.tensor([-1.0]), rtol=1e-6, atol=1e-7)
    (gw0,) = torch.autograd.grad(mean_r[0], m.routers[0].weight, retain_graph=True)
    with torch.no_grad():
        h0 = m.embed(x)
    torch.testing.assert_close(gw0, -h0.reshape(-1, h0.shape[-1]).mean(0, keepdim=True), rtol=1e-5, atol=1e-6)
    others = [p for n, p in m.named_parameters() if not n.startswith("routers.")]
    for kind, reaches in (("straight_through_routers", False), ("straight_through", True)):
        grads = torch.autograd.grad(s.regulariser_inputs(kind)[0].sum(), others, retain_graph=True,
                                    allow_unused=True)
        moved = any(g is not None and bool(g.abs().max() > 0) for g in grads)
        assert moved is reaches, kind
    with pytest.raises(ValueError, match="reg_grad"):
        s.regulariser_inputs("soft")
    with torch.no_grad():
        with pytest.raises(ValueError, match="autograd"):
            m(x).gate_stats.regulariser_inputs("straight_through_routers")


def test_inward_straight_through_by_hand():
    """reg_grad = "straight_through_inward": eq. 2's gradient everywhere, plus the straight-through one (d g / d
    lin = -1) only for a saturated gate the incoming gradient would move back into (0, 1). Hand example,
    g = 1 - clamp(ReLU(lin)) = [0, 0.7, 1, 1, 0], loss = sum(w g), w = [-1, 2, 3, -4, 5] (descent moves g by -w):
      token 0: closed, opened by the loss -> straight-through: d/d lin = -w = +1
      token 1: unsaturated -> eq. 2's own gradient: -w = -2
      token 2: open, closed by the loss -> straight-through: -3
      token 3: open, pushed further open -> 0 (plain straight-through would give +4)
      token 4: closed, pushed further closed -> 0 (plain straight-through: -5)"""
    w = torch.tensor([-1.0, 2.0, 3.0, -4.0, 5.0])
    lin = torch.tensor([2.0, 0.3, -0.5, -1.0, 1.5], requires_grad=True)
    gate = 1.0 - torch.relu(lin).clamp(0.0, 1.0)
    twin = inward_straight_through(gate, lin)
    assert torch.equal(twin, gate)
    (twin * w).sum().backward()
    assert torch.equal(lin.grad, torch.tensor([1.0, -2.0, -3.0, 0.0, 0.0]))
    lin.grad = None
    (straight_through(gate.detach(), lin) * w).sum().backward()
    assert torch.equal(lin.grad, -w)


def test_inward_regulariser_leaves_gates_saturated_its_way_alone():
    """A model whose gates are all exactly 1 (router biases very negative) under a loss that wants them open
    (-mean, what a target of 1.0 asks): the inward variant passes no gradient to any parameter, where plain
    straight-through pushes every token's residual stream; under a loss that wants them closed (+mean) it
    passes the straight-through gradient (d mean_0 / d b_0 = -1, as plain straight-through). Same values as
    the other variants."""
    x = torch.randint(0, 64, (2, 16))
    m = _model("exact")
    with torch.no_grad():
        for r in m.routers:
            r.bias.fill_(-50.0)
    s = m(x, x).gate_stats
    assert bool((s.mean == 1).all())
    mean_i, var_i = s.regulariser_inputs("straight_through_inward")
    assert torch.equal(mean_i, s.mean) and torch.equal(var_i, s.var)
    params = [p for p in m.parameters() if p.requires_grad]
    grads = torch.autograd.grad(-mean_i.sum(), params, retain_graph=True, allow_unused=True)
    assert all(g is None or bool((g == 0).all()) for g in grads)
    grads = torch.autograd.grad(-s.regulariser_inputs("straight_through")[0].sum(), params, retain_graph=True,
                                allow_unused=True)
    assert any(g is not None and bool(g.abs().max() > 0) for g in grads)
    (gb0,) = torch.autograd.grad(mean_i[0], m.routers[0].bias, retain_graph=True)
    torch.testing.assert_close(gb0, torch.tensor([-1.0]), rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        with pytest.raises(ValueError, match="autograd"):
            m(x).gate_stats.regulariser_inputs("straight_through_inward")


def test_under_bf16_autocast_training_computes_the_gates_inference_does():
    """The routers' score in fp32 under autocast too: a bf16 score made the gates a training step sees differ
    from those evaluation and real skipping compute for the same hidden states, by up to 0.07 here."""
    from tiny_models import make_tiny

    model = make_tiny(dict(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64,
                           multiple_of=16), True, seed=0)
    tok = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = model(tok).gates.detach()  # autograd on: the training path
        with torch.no_grad():
            inferred = model(tok).gates
    assert (trained == 0).any() and (trained - inferred).abs().max() < 1e-5

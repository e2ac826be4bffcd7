"""Gated attention as a setting (issue 14): `gate_attention` key (eq. 3), query (the public reference code's
indexing) and none -- what each hides, and that the query variant computes what "none" computes."""

from __future__ import annotations

import pytest
import torch

from midlayer.model.attention import key_gate_bias, sdpa_attention
from midlayer.config import ModelConfig
from midlayer.engine.generate import GenerationConfig, generate, generate_naive
from midlayer.model.transformer import Transformer
from tiny_models import make_tiny

SMALL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=48, multiple_of=16)


def _attend(mode: str, v: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    return sdpa_attention(q, k, v, key_gate_bias(gates, 1e-6, mode))


def test_what_each_gating_hides():
    """Token 2 has gate 0. Changing its value vector: with key gating no later query moves (it is hidden as a
    key); with query gating or none, every query from position 2 on moves (it stays visible)."""
    torch.manual_seed(1)
    v = torch.randn(1, 2, 6, 8)
    v2 = v.clone()
    v2[:, :, 2] += 5.0
    gates = torch.tensor([[1.0, 0.7, 0.0, 1.0, 0.4, 1.0]])
    key_a, key_b = _attend("key", v, gates), _attend("key", v2, gates)
    others = [i for i in range(6) if i != 2]
    torch.testing.assert_close(key_a[:, :, others], key_b[:, :, others], atol=1e-4, rtol=0)
    for mode in ("query", "none"):
        a, b = _attend(mode, v, gates), _attend(mode, v2, gates)
        assert (a[:, :, 3:] - b[:, :, 3:]).abs().amax() > 0.1, mode  # token 2 still seen from 3 on
    # a row constant cancels in the softmax: query-indexed gating computes exactly what no gating does
    torch.testing.assert_close(_attend("query", v, gates), _attend("none", v, gates), atol=1e-6, rtol=1e-6)
    assert key_gate_bias(gates, 1e-6, "none") is None
    assert key_gate_bias(gates, 1e-6, "query").shape == (1, 1, 6, 1)
    assert key_gate_bias(gates, 1e-6, "key").shape == (1, 1, 1, 6)


def _gated(mode: str) -> Transformer:
    return make_tiny(SMALL, True, gate_attention=mode)  # routers that zero some gates


def test_model_level_query_gating_equals_none_and_key_differs():
    with pytest.warns(UserWarning, match="hides no token"):
        query = _gated("query")
    none, key = _gated("none"), _gated("key")
    x = torch.randint(0, 64, (2, 20))
    out = {name: m(x) for name, m in (("query", query), ("none", none), ("key", key))}
    assert bool((out["key"].gates == 0).any())  # some tokens skip some blocks
    torch.testing.assert_close(out["query"].logits, out["none"].logits, atol=1e-5, rtol=1e-5)
    assert (out["key"].logits - out["none"].logits).abs().amax() > 1e-3


@pytest.mark.parametrize("mode", ["query", "none", "key"])
def test_generation_follows_the_same_rule(mode):
    """Cached generation equals the full-forward reference in every mode; real skipping (which drops keys)
    is used only with key gating, where it is exact."""
    with pytest.warns(UserWarning) if mode == "query" else _nothing():
        m = _gated(mode)
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (9, 4)]
    cfg = GenerationConfig(max_new_tokens=12)
    assert generate(m, prompts, cfg) == generate_naive(m, prompts, cfg)
    with pytest.raises(ValueError, match="gate_attention"):
        ModelConfig(**SMALL, gate_attention="value")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

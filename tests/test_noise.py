"""Run-to-run comparison (issue 14): `compare_models` by hand on tiny models -- what a seed or a last-bit
perturbation changes, and the discrete gate flips through which a gated model amplifies it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from midlayer.data.shards import TokenWindows, write_shard
from midlayer.train.evaluate import _first_zero_block, compare_models
from tiny_models import make_tiny

DIMS = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, multiple_of=16)


@pytest.fixture
def windows(tmp_path):
    toks = np.random.default_rng(0).integers(0, 64, 2000)
    write_shard(tmp_path / "val.bin", toks)
    return TokenWindows([tmp_path / "val.bin"], 16)


def test_identical_models_compare_as_identical(windows):
    a, b = make_tiny(DIMS, True), make_tiny(DIMS, True)
    r = compare_models(a, b, windows, eval_tokens=256, batch_size=4)
    assert r["tokens"] == 256 and r["ce_a"] == r["ce_b"]
    assert r["kl"] == 0 and r["top1_agree"] == 1 and r["param_rel_dist"] == 0
    assert r["zero_flip"] == [0.0, 0.0] and r["span_differs"] == 0


def test_gate_flips_and_spans_by_hand(windows):
    """Raising router 1's bias turns more gates of block 1 to exactly 0: the flips are counted from the two
    models' own gates, block 0 is untouched (router 1 reads the residual entering block 1)."""
    a, b = make_tiny(DIMS, True), make_tiny(DIMS, True)
    with torch.no_grad():
        b.routers[1].bias += 0.5
    r = compare_models(a, b, windows, eval_tokens=256, batch_size=4)
    x, y = next(iter(windows.sequential(16, max_tokens=256)))
    with torch.no_grad():
        ga, gb = a(x).gates.reshape(2, -1), b(x).gates.reshape(2, -1)
    flips = ((ga == 0) != (gb == 0)).double().mean(1)
    assert flips[0] == 0 and flips[1] > 0
    assert r["zero_flip"] == pytest.approx(flips.tolist(), abs=1e-12)
    spans = (_first_zero_block(ga == 0) != _first_zero_block(gb == 0)).double().mean()
    assert r["span_differs"] == pytest.approx(float(spans), abs=1e-12)
    assert 0 < r["kl"] and r["top1_agree"] < 1 and r["param_rel_dist"] > 0


def test_first_zero_block():
    z = torch.tensor([[False, True, False, False], [True, True, False, False]])
    assert _first_zero_block(z).tolist() == [1, 0, 2, 2]


def test_different_configs_refused(windows):
    with pytest.raises(ValueError, match="different configs"):
        compare_models(make_tiny(DIMS, True), make_tiny(DIMS, False), windows, eval_tokens=64, batch_size=4)

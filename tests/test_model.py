"""Model core: skip-middle gating (eqs. 1-2), gated attention (eq. 3), modes, shapes and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from midlayer.model.attention import HAS_FLEX, flex_gated_attention, key_gate_bias, sdpa_attention
from midlayer.config import ModelConfig, get_preset
from midlayer.model.gating import mirror_index
from midlayer.model.transformer import Transformer

SMALL = dict(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, multiple_of=16)


def make(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**SMALL, **kw})).eval()


def set_constant_routers(model: Transformer, s_values) -> None:
    """Router l outputs the constant s_values[l] for every token (weight 0, bias s)."""
    with torch.no_grad():
        for r, s in zip(model.routers, s_values):
            r.weight.zero_()
            r.bias.fill_(s)


def force_gate_zero_for_token(model: Transformer, token_id: int) -> None:
    """Gate of `token_id` is 0 from block 0 on (router 0 reads a feature only that token has); others 1."""
    with torch.no_grad():
        emb = model.tok_embeddings.weight
        emb[:, 0] = 0.0
        emb[token_id, 0] = 5.0  # after the embedding RMSNorm this feature is large only for token_id
        set_constant_routers(model, [0.0] * len(model.routers))
        model.routers[0].weight[0, 0] = 10.0


def capture_wv_and_attention_output(model: Transformer, layer: int, pos: int, delta: torch.Tensor):
    """Hooks: add `delta` to the value vector of position `pos` at `layer`, record the attention output."""
    seen = {}
    attn = model.layers[layer].attention

    def perturb(mod, inp, out):
        out = out.clone()
        out[:, pos] += delta
        return out

    def record(mod, inp, out):
        seen["out"] = out.detach().clone()

    return [attn.wv.register_forward_hook(perturb), attn.register_forward_hook(record)], seen


# ------------------------------------------------------------------------------------ gated attention
@pytest.mark.parametrize("gated_token_gate_zero", [True, False])
def test_gated_key_is_invisible_to_later_tokens(gated_token_gate_zero):
    model = make()
    tok = 7
    if gated_token_gate_zero:
        force_gate_zero_for_token(model, tok)
    else:
        set_constant_routers(model, [0.0] * 3)  # every gate 1
    x = torch.tensor([[1, 2, tok, 3, 4, 5, 6, 8]])
    pos = 2
    outs = []
    for scale in (0.0, 1.0):
        delta = scale * torch.randn(SMALL["n_kv_heads"] * (SMALL["dim"] // SMALL["n_heads"]),
                                    generator=torch.Generator().manual_seed(1)) * 3
        hooks, seen = capture_wv_and_attention_output(model, 0, pos, delta)
        out = model(x)
        for h in hooks:
            h.remove()
        outs.append(seen["out"])
        if gated_token_gate_zero:
            assert out.gates[0, 0, pos] == 0 and (out.gates[0, 0, torch.arange(8) != pos] == 1).all()
    later = outs[1][:, pos + 1:] - outs[0][:, pos + 1:]
    earlier = outs[1][:, :pos] - outs[0][:, :pos]
    assert earlier.abs().max() == 0  # causality
    if gated_token_gate_zero:
        assert later.abs().max() < 1e-5
    else:
        assert later.abs().max() > 1e-2


def test_query_indexed_bias_would_fail_the_same_check():
    """The reference bug (bias on queries) leaves gated keys fully visible: our check catches it."""
    torch.manual_seed(0)
    B, H, T, d = 1, 2, 6, 8
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, H, T, d), torch.randn(B, H, T, d)
    g = torch.ones(B, T)
    g[0, 2] = 0.0
    v2 = v.clone()
    v2[:, :, 2] += 3.0
    bias = key_gate_bias(g, 1e-6)  # [B,1,1,T]
    ours = sdpa_attention(q, k, v2, bias) - sdpa_attention(q, k, v, bias)
    assert ours[:, :, 3:].abs().max() < 1e-5
    causal = torch.ones(T, T).tril().bool()
    wrong_mask = torch.zeros(T, T).masked_fill(~causal, float("-inf")) + bias[0, 0, 0][:, None]  # per query
    wrong = (F.scaled_dot_product_attention(q, k, v2, attn_mask=wrong_mask)
             - F.scaled_dot_product_attention(q, k, v, attn_mask=wrong_mask))
    assert wrong[:, :, 3:].abs().max() > 1e-2


def test_gated_attention_matches_eq3_by_hand():
    """o_i = sum_j g_j e^{q.k_j} v_j / sum_j g_j e^{q.k_j} (eq. 3), checked against an explicit loop."""
    torch.manual_seed(0)
    B, H, T, d = 2, 2, 5, 4
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, H, T, d), torch.randn(B, H, T, d)
    g = torch.rand(B, T)
    out = sdpa_attention(q, k, v, key_gate_bias(g, 1e-6))
    ref = torch.zeros_like(out)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                w = torch.stack([g[b, j] * torch.exp(q[b, h, i] @ k[b, h, j] / math.sqrt(d)) for j in range(i + 1)])
                ref[b, h, i] = (w[:, None] * v[b, h, : i + 1]).sum(0) / w.sum()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.skipif(not HAS_FLEX, reason="FlexAttention needs torch >= 2.5")
@pytest.mark.parametrize("n_kv", [2, 1])
def test_flex_score_mod_equals_sdpa_key_bias(n_kv):
    torch.manual_seed(0)
    B, H, T, d = 2, 2, 16, 8
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, n_kv, T, d), torch.randn(B, n_kv, T, d)
    g = torch.rand(B, T)
    g[0, 3] = 0.0
    bias = key_gate_bias(g, 1e-6)
    torch.testing.assert_close(flex_gated_attention(q, k, v, bias), sdpa_attention(q, k, v, bias),
                               atol=1e-5, rtol=1e-5)



@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.skipif(not HAS_FLEX, reason="FlexAttention needs torch >= 2.5")
@pytest.mark.parametrize("window", [1, 3, 5])
def test_flex_sliding_window_by_hand(window):
    """Flex's block mask with a window against the loop: query i sees keys j with i - window < j <= i, each
    weighted by its gate (eq. 3). On CUDA `auto` trains windowed blocks through Flex (`use_flex`), so a window
    one key too wide there would change every windowed layer."""
    torch.manual_seed(0)
    B, H, T, d = 2, 2, 12, 8
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, H, T, d), torch.randn(B, H, T, d)
    g = torch.rand(B, T) + 0.1
    out = flex_gated_attention(q, k, v, key_gate_bias(g, 1e-6), window=window)
    ref = torch.zeros_like(out)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                js = range(max(0, i - window + 1), i + 1)
                w = torch.stack([g[b, j] * torch.exp(q[b, h, i] @ k[b, h, j] / math.sqrt(d)) for j in js])
                ref[b, h, i] = (w[:, None] * v[b, h, js.start:i + 1]).sum(0) / w.sum()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa_attention(q, k, v, key_gate_bias(g, 1e-6), window=window), ref,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_model_flex_backend_equals_sdpa_backend():
    if not HAS_FLEX:
        pytest.skip("FlexAttention needs torch >= 2.5")
    x = torch.randint(0, 64, (2, 16))
    for window in (0, 4):  # (a window shorter than the sequence: the block mask's windowed rule)
        a = make(attn_backend="sdpa", sliding_window=window)
        b = make(attn_backend="flex", sliding_window=window)
        with torch.no_grad():  # FlexAttention has no backward on CPU; this checks the forward only
            torch.testing.assert_close(a(x).logits, b(x).logits, atol=1e-4, rtol=1e-4)


# -------------------------------------------------------------------------------------- skip-middle
def test_hand_built_gates_mirror_and_skip_span():
    """s = [0.3, 0.8, 0.5] -> S = [0.3, 1.1, 1.6] -> g = [0.7, 0, 0 | 0, 0, 0.7] for L = 6."""
    model = make()
    set_constant_routers(model, [0.3, 0.8, 0.5])
    out = model(torch.randint(0, 64, (2, 5)))
    expected_half = torch.tensor([0.7, 0.0, 0.0])
    torch.testing.assert_close(out.gates[:, 0, 0], expected_half)
    full = torch.tensor([0.7, 0.0, 0.0, 0.0, 0.0, 0.7])
    torch.testing.assert_close(out.gate_stats.mean, full)
    torch.testing.assert_close(out.gate_stats.var, torch.zeros(6))
    torch.testing.assert_close(out.gate_stats.zero_frac, torch.tensor([0.0, 1, 1, 1, 1, 0]))
    assert [mirror_index(i, 6) for i in range(6)] == [0, 1, 2, 2, 1, 0]
    # first zero at block 1: blocks 1..4 = [l, L-1-l] skipped (zero_frac above), resumed at 5


def test_gate_stats_mean_var_zero_over_tokens():
    model = make()
    out = model(torch.randint(0, 64, (3, 7)))
    g = out.gates.reshape(3, -1)
    torch.testing.assert_close(out.gate_stats.mean[:3], g.mean(1))
    torch.testing.assert_close(out.gate_stats.var[:3], g.var(1, unbiased=False))
    torch.testing.assert_close(out.gate_stats.zero_frac[:3], (g == 0).float().mean(1))
    assert out.gate_stats.n_tokens == 21


def test_zero_gate_leaves_residual_unchanged_through_the_skipped_span():
    """All tokens get S >= 1 at block 1: the residual is identical entering blocks 1..L-2 and leaving L-2."""
    model = make()
    set_constant_routers(model, [0.0, 1.5, 0.0])
    out = model(torch.randint(0, 64, (2, 9)), output_hidden_states=True)
    hs = out.hidden_states  # hs[l] enters block l; hs[L] leaves the last block
    for l in range(2, 6):
        assert torch.equal(hs[l], hs[1]), l
    assert not torch.allclose(hs[1], hs[0])  # block 0 ran
    assert not torch.allclose(hs[6], hs[5])  # block L-1 = 5 ran


def test_single_token_gated_at_block0_is_untouched_by_every_block():
    model = make()
    tok = 7
    force_gate_zero_for_token(model, tok)
    out = model(torch.tensor([[1, tok, 3, tok, 5]]), output_hidden_states=True)
    for h in out.hidden_states:
        torch.testing.assert_close(h[0, [1, 3]], out.hidden_states[0][0, [1, 3]], atol=0, rtol=0)
    assert not torch.allclose(out.hidden_states[-1][0, 0], out.hidden_states[0][0, 0])


@pytest.mark.parametrize("norm", ["pre", "sandwich"])
def test_zero_routers_equal_dense_and_dense_ignores_routers(norm):
    gated = make(norm_placement=norm)
    set_constant_routers(gated, [0.0, 0.0, 0.0])
    dense = Transformer(ModelConfig(**{**SMALL, "gating": False, "norm_placement": norm})).eval()
    missing, unexpected = dense.load_state_dict(gated.state_dict(), strict=False)
    assert not missing and all(k.startswith("routers.") for k in unexpected)
    x = torch.randint(0, 64, (2, 11))
    torch.testing.assert_close(gated(x).logits, dense(x).logits, atol=1e-5, rtol=1e-5)
    # With random routers the gated model differs, while the dense model cannot see them at all.
    gated.reset_parameters()
    assert not torch.allclose(gated(x).logits, dense(x).logits, atol=1e-3)
    assert dense.routers is None and dense(x).gate_stats is None


def test_router_parameter_count_and_names():
    model = make()
    assert len(model.routers) == 3
    assert sum(p.numel() for p in model.routers.parameters()) == (SMALL["dim"] + 1) * 3  # (d+1) L/2
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"tok_embeddings", "emb_norm", "layers", "norm", "output", "routers"}


def test_gradients_reach_every_router_while_gates_are_fractional():
    model = make().train()
    with torch.no_grad():
        for r in model.routers:
            r.weight.mul_(0.01)
            r.bias.fill_(0.1)  # S = 0.1, 0.2, 0.3 (+ small): strictly inside (0, 1)
    x = torch.randint(0, 64, (2, 8))
    out = model(x, x)
    assert ((out.gates > 0) & (out.gates < 1)).all()
    out.loss.backward()
    for r in model.routers:
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
        assert r.bias.grad.abs() > 0


# ---------------------------------------------------------------------------------- shapes, bad input
@pytest.mark.parametrize("gating", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (3, 16)])
def test_shapes_batch1_and_short_sequences(gating, shape):
    model = make(gating=gating)
    x = torch.randint(0, 64, shape)
    out = model(x, x)
    assert out.logits.shape == (*shape, 64) and torch.isfinite(out.loss)
    # A short sequence gives the same logits as the same prefix inside a longer one (causality).
    longer = torch.cat([x, torch.randint(0, 64, (shape[0], 16 - shape[1]))], dim=1)
    torch.testing.assert_close(model(longer).logits[:, : shape[1]], out.logits, atol=1e-5, rtol=1e-5)


def test_bad_inputs_give_clear_errors():
    model = make()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 64\)"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=r"ids must be in"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        model(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("kw,field", [
    (dict(dim=30, n_heads=4), "n_heads"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(n_layers=5), "n_layers"),
    (dict(norm_placement="post"), "norm_placement"),
    (dict(attn_backend="xformers"), "attn_backend"),
    (dict(dim=0), "dim"),
    (dict(gate_eps=0.0), "gate_eps"),
])
def test_invalid_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**SMALL, **kw})


def test_odd_layers_allowed_for_dense():
    assert ModelConfig(**{**SMALL, "n_layers": 5, "gating": False}).n_routers == 0


def test_presets():
    m, s, t = get_preset("paper-12l")
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size, m.ffn_hidden_dim) == (768, 12, 12, 12, 50257, 3072)
    assert (m.norm_eps, m.rope_theta, m.max_seq_len, m.init_std, m.gating) == (1e-5, 1e4, 1024, 0.02, True)
    assert (t.lr, t.beta1, t.beta2, t.adam_eps, t.weight_decay, t.batch_size) == (1e-3, 0.8, 0.95, 1e-10, 0.0, 512)
    assert s.controller == "proportional" and (s.gamma, s.delta) == (1e-3, 1e-2)
    for n in range(2, 13):
        m, _, t = get_preset(f"paper-dense-{n}")
        assert m.n_layers == n and not m.gating and t.out_dir == f"runs/paper-dense-{n}"
    from midlayer.config import PRESETS
    # every preset writes to its own runs/<preset> (paper-12l and paper-dense-N shared runs/default, so a second
    # one was refused as the first's resume)
    assert all(get_preset(name)[2].out_dir == f"runs/{name}" for name in PRESETS)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("paper-13l")


def test_gqa_matches_repeated_kv_heads():
    torch.manual_seed(0)
    B, H, T, d = 1, 4, 6, 8
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, 2, T, d), torch.randn(B, 2, T, d)
    bias = key_gate_bias(torch.rand(B, T), 1e-6)
    ref = sdpa_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), bias)
    torch.testing.assert_close(sdpa_attention(q, k, v, bias), ref)


def test_bf16_autocast_keeps_attention_close_to_fp32():
    model = make()
    x = torch.randint(0, 64, (2, 16))
    ref = model(x).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x).logits
    assert (out.float() - ref).abs().max() < 0.05


@pytest.mark.skipif(not HAS_FLEX, reason="torch without FlexAttention")
def test_auto_backend_takes_flex_only_for_a_bias_or_window():
    """attn_backend="auto" on CUDA (a stand-in with is_cuda=True: the rule reads nothing else): FlexAttention
    in training and where it replaces a materialised mask (the gate's key bias, a sliding window); SDPA's fused
    causal kernel for plain causal attention outside training (a frozen dense base such as SmolLM2, whose
    compiled Flex recompiled per length on an H100); never on CPU or with training-time attention dropout."""
    from types import SimpleNamespace

    from midlayer.model.attention import Attention
    from midlayer.config import ModelConfig

    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    small = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, multiple_of=16)
    bias = torch.zeros(1, 1, 1, 8)
    plain = Attention(ModelConfig(**small)).eval()
    assert not plain.use_flex(cuda) and plain.use_flex(cuda, bias) and not plain.use_flex(cpu, bias)
    assert plain.train().use_flex(cuda) and not plain.use_flex(cpu)  # training: one fixed shape, compiled once
    windowed = Attention(ModelConfig(**small, sliding_window=8)).eval()
    assert windowed.use_flex(cuda) and not windowed.use_flex(cpu)
    dropout = Attention(ModelConfig(**small, attn_dropout=0.1)).train()
    assert not dropout.use_flex(cuda, bias) and dropout.eval().use_flex(cuda, bias)
    forced = Attention(ModelConfig(**small, attn_backend="flex"))
    assert forced.use_flex(cpu) and forced.use_flex(cuda)
    # Heads narrower than 16 (the `debug` preset's 8): the compiled CUDA kernel has none (an H100 run failed
    # inside Inductor), so "auto" takes SDPA on CUDA and a forced "flex" says why; eager Flex on CPU still serves.
    narrow = dict(small, dim=32)
    assert Attention(ModelConfig(**narrow)).head_dim == 8
    assert not Attention(ModelConfig(**narrow)).train().use_flex(cuda, bias)
    forced_narrow = Attention(ModelConfig(**narrow, attn_backend="flex"))
    assert forced_narrow.use_flex(cpu)
    with pytest.raises(ValueError, match="head_dim >= 16 .* this model has 8"):
        forced_narrow.use_flex(cuda)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rmsnorm_fused_inference_path_is_the_same_formula(monkeypatch, dtype):
    """On CUDA, inference calls aten's rms_norm (one fused kernel: issue 42's CUDA-graph replays pay per
    kernel). Taken here on the CPU, it gives the six-op formula x / sqrt(mean(x^2) + eps) * weight in fp32:
    eps inside the root, the weight applied before the cast back. With grad enabled it is never taken."""
    from midlayer.model.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(3, 5, 64) * 1e-3).to(dtype)  # small values: eps matters at this scale
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), want)  # (the six ops on the CPU by default)
    monkeypatch.setattr(RMSNorm, "FUSED_DEVICES", ("cpu",))
    with torch.no_grad():
        torch.testing.assert_close(norm(x), want, atol=0, rtol=2e-6 if dtype == torch.float32 else 8e-3)
    calls = []
    monkeypatch.setattr(F, "rms_norm", lambda *a, **k: calls.append(1))
    norm(x)  # (grad enabled: training's six ops)
    assert calls == []

"""The Transformer's parts as settings (issue 13): each against a hand computation or a naive reference, and
every setting through training, cached generation (with gating and real skipping where it makes sense), the
cost model and a checkpoint round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from midlayer.config import ModelConfig, from_dict, to_dict
from midlayer.model.flops import param_count
from midlayer.engine.generate import GenerationConfig, forward_cached, generate, generate_naive
from midlayer.model.kv_cache import KVCache
from midlayer.model.layers import FeedForward, LayerNorm, RMSNorm
from midlayer.model.transformer import Block, Transformer
from tiny_models import make_tiny

SMALL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=48, multiple_of=16)

# every non-default part, one at a time (gating: whether it combines with skip-middle gating)
PARTS = {
    "layernorm": dict(norm_type="layernorm"),
    "layernorm_nobias": dict(norm_type="layernorm_nobias"),
    "post_ln": dict(norm_placement="post"),
    "pre_ln": dict(norm_placement="pre"),
    "qk_norm": dict(qk_norm=True),
    "qk_layernorm": dict(qk_norm=True, norm_type="layernorm"),
    "geglu": dict(ffn_type="geglu"),
    "reglu": dict(ffn_type="reglu"),
    "relu_mlp": dict(ffn_type="relu"),
    "gelu_mlp": dict(ffn_type="gelu"),
    "silu_mlp": dict(ffn_type="silu"),
    "scaled_init": dict(init_scheme="scaled_residual"),
    "dropouts": dict(dropout=0.1, attn_dropout=0.1, emb_dropout=0.1),
    "nope": dict(pos_encoding="none"),
    "sinusoidal": dict(pos_encoding="sinusoidal"),
    "sinusoidal_scaled": dict(pos_encoding="sinusoidal", scale_embeddings=True),
    "learned_pos": dict(pos_encoding="learned"),
    "rope_linear": dict(rope_scaling="linear", rope_scale=2.0),
    "rope_ntk": dict(rope_scaling="ntk", rope_scale=4.0),
    "sliding_window": dict(sliding_window=5),
    "alibi": dict(pos_encoding="alibi"),
    "t5_bias": dict(pos_encoding="t5", t5_buckets=8, t5_max_distance=20),
    "moe": dict(moe_experts=4, moe_top_k=2),
    "moe_top1_gelu": dict(moe_experts=3, moe_top_k=1, ffn_type="gelu"),
    "ssm_hybrid": dict(ssm_layers=(1, 2)),
    "wide_heads": dict(head_size=16, qk_norm=True),  # n_heads * head_size = 64 != dim = 32 (Qwen3-like)
}
GATED = {name for name, over in PARTS.items() if over.get("norm_placement") != "post" and "ssm_layers" not in over}


def model_with(over: dict, gating: bool, seed: int = 0) -> Transformer:
    """The shared tiny model (gated: routers that zero some gates and not others) with `over` set."""
    return make_tiny(SMALL, gating, seed, **over)


# ==================================================================================== hand computations
def test_sinusoidal_table_by_hand():
    from midlayer.model.transformer import sinusoidal_table

    pe = sinusoidal_table(3, 4)  # frequencies 10000^0 = 1 and 10000^(-2/4) = 0.01
    want = [[0.0, 1.0, 0.0, 1.0], [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)],
            [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)]]
    torch.testing.assert_close(pe, torch.tensor(want))


def test_rope_scaling_at_the_scaled_positions():
    """Linear interpolation by s: position t gets the angles of t / s (so t = 2 s has those of 2);
    NTK-aware: base theta * s^(d/(d-2)) -- the highest frequency (i = 0) is unchanged, the lowest
    (i = d/2 - 1) becomes exactly s times slower."""
    from midlayer.model.attention import rope_tables

    d, s = 8, 4.0
    cos, sin = rope_tables(d, 64, 10000.0)
    lc, ls = rope_tables(d, 64, 10000.0, scaling="linear", scale=s)
    torch.testing.assert_close(lc[8], cos[2])
    torch.testing.assert_close(ls[12], sin[3])
    nc, ns = rope_tables(d, 64, 10000.0, scaling="ntk", scale=s)
    t = 10
    angle = torch.atan2(ns[t], nc[t])  # first half of the head: one angle per frequency
    assert abs(float(angle[0]) - t * 1.0) < 1e-4 or abs(float(angle[0]) - (t - 4 * math.pi)) < 1e-4
    lowest = t * 10000.0 ** (-(d - 2) / d)
    assert abs(float(angle[d // 2 - 1]) - lowest / s) < 1e-6
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig(**SMALL, pos_encoding="none", rope_scaling="linear", rope_scale=2.0)
    with pytest.raises(ValueError, match="rope_scale"):
        ModelConfig(**SMALL, rope_scale=2.0)


def test_absolute_positions_enter_through_the_embedding():
    m = model_with(PARTS["learned_pos"], gating=False)
    x = torch.randint(0, 64, (1, 5))
    want = m.emb_norm(m.tok_embeddings(x) + m.pos_embeddings.weight[:5])
    torch.testing.assert_close(m.embed(x), want)
    torch.testing.assert_close(m.embed(x, torch.tensor([[3, 4, 5, 6, 7]])),
                               m.emb_norm(m.tok_embeddings(x) + m.pos_embeddings.weight[3:8]))
    assert torch.equal(m.rope_cos, torch.ones_like(m.rope_cos)) and not m.rope_sin.any()  # no RoPE


def test_scaled_embeddings_by_hand():
    """Vaswani et al. 2017 sec. 3.4: the token embedding x sqrt(d_model) (here sqrt(32)), then + PE[t]; the
    position table and the tied output head are not scaled."""
    from midlayer.model.transformer import sinusoidal_table

    m = model_with(dict(PARTS["sinusoidal_scaled"], tie_embeddings=True), gating=False)
    x = torch.tensor([[3, 0, 63, 3]])
    row = m.tok_embeddings.weight[x[0]]
    want = m.emb_norm(row * 32 ** 0.5 + sinusoidal_table(4, 32))
    torch.testing.assert_close(m.embed(x), want[None])
    assert torch.equal(m.output.weight, m.tok_embeddings.weight)  # the head reads the unscaled rows
    plain = model_with(PARTS["sinusoidal"], gating=False)
    torch.testing.assert_close(plain.embed(x), plain.emb_norm(plain.tok_embeddings.weight[x[0]]
                                                               + sinusoidal_table(4, 32))[None])


def test_sliding_window_equals_full_attention_with_the_windowed_mask():
    """The training path (SDPA with the window mask) against a naive softmax over a hand-built mask: query i
    sees keys i - W + 1 .. i."""
    from midlayer.model.attention import sdpa_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    W = 3
    allowed = torch.tensor([[0 <= i - j < W for j in range(9)] for i in range(9)])
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2)) / math.sqrt(8)
    ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv
    torch.testing.assert_close(sdpa_attention(q, k, v, window=W), ref, atol=1e-5, rtol=1e-5)
    # a window as long as the sequence is full causal attention
    torch.testing.assert_close(sdpa_attention(q, k, v, window=9), sdpa_attention(q, k, v), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("over", [{}, {"ssm_layers": (2,)}])
@pytest.mark.parametrize("gating", [False, True])
def test_sliding_window_generation_past_the_window_equals_the_naive_reference(gating, over, monkeypatch):
    """With a window W the generation cache is bounded (2W - 1 slots: W - 1 kept keys + a chunk of at most
    W new ones, the prompt going in in chunks) and the tokens equal the full-forward reference, for batched
    prompts of different lengths, gated (real skipping) or dense, with a state-space block or not."""
    if gating and over:
        pytest.skip("state-space mixers are refused with gating")
    W = 4
    m = model_with({"sliding_window": W, **over}, gating)
    full = model_with(over, gating)
    full.load_state_dict(m.state_dict())
    sizes = []
    real = KVCache.for_model

    def spy(cfg, batch, max_len=None, **kw):
        sizes.append(max_len)
        return real(cfg, batch, max_len, **kw)

    monkeypatch.setattr(KVCache, "for_model", staticmethod(spy))
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (11, 3, 7)]  # longer than the window from the start
    cfg = GenerationConfig(max_new_tokens=20)
    out = generate(m, prompts, cfg)
    assert sizes == [2 * W - 1]
    monkeypatch.setattr(KVCache, "for_model", staticmethod(real))
    assert out == generate_naive(m, prompts, cfg)
    x = torch.tensor([prompts[0] + out[0]])
    assert not torch.allclose(m(x).logits, full(x).logits)  # the window changes the model


def test_alibi_slopes_and_bias_by_hand():
    from midlayer.model.attention import PositionBias, alibi_slopes

    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]))
    # 6 heads: the 4 slopes of 4 heads, then every other slope of 8 heads (2^-1, 2^-3)
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]))
    pb = PositionBias(ModelConfig(**{**SMALL, "pos_encoding": "alibi"}))
    b = pb(torch.arange(3), torch.arange(3))  # [H, 3, 3]: -m_h (i - j) on and below the diagonal
    torch.testing.assert_close(b[0], -0.25 * torch.tensor([[0.0, 0, 0], [1, 0, 0], [2, 1, 0]]))


def test_t5_buckets_by_hand():
    from midlayer.model.attention import t5_bucket

    # 8 buckets, max distance 20: 0..3 exact; then 4 + floor(log(d / 4) / log(5) * 4), capped at 7
    d = torch.tensor([0, 1, 3, 4, 5, 9, 19, 20, 100])
    want = [0, 1, 3, 4] + [min(7, 4 + int(math.log(v / 4) / math.log(5) * 4)) for v in (5, 9, 19, 20, 100)]
    assert t5_bucket(d, 8, 20).tolist() == want
    assert want[-1] == 7 and want[4] == 4


def test_per_head_masks_in_the_row_invariant_kernel():
    """The C attention kernel reads a [B, H, T, S] mask (ALiBi / T5 in the q4 engine) like the reference."""
    from midlayer.ops import kernels

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    mask = torch.randn(2, 4, 3, 7)
    mask[..., 5:] = float("-inf")
    torch.testing.assert_close(kernels.attention(q, k, v, mask), kernels.attention_reference(q, k, v, mask),
                               atol=1e-5, rtol=1e-5)


def test_moe_with_one_expert_and_top1_is_the_dense_ffn():
    from midlayer.model.layers import MoEFeedForward

    torch.manual_seed(0)
    dense = FeedForward(8, 16, "swiglu")
    moe = MoEFeedForward(8, 16, "swiglu", n_experts=1, top_k=1)
    moe.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(moe(x), dense(x))
    assert moe.aux.item() == pytest.approx(1.0)  # one expert: f = P = 1


def test_moe_load_balancing_loss_by_hand():
    """E = 2, k = 1, router = identity on 2 features. Tokens [2, 0] x3 and [0, 2]: p(e0) = e^2 / (e^2 + 1) =
    0.8808 for the first three, 0.1192 for the last; assignments f = (3/4, 1/4); mean probabilities
    P = (0.6904, 0.3096); loss = 2 (0.75 * 0.6904 + 0.25 * 0.3096) = 1.1904."""
    from midlayer.model.layers import MoEFeedForward

    moe = MoEFeedForward(2, 4, "relu", n_experts=2, top_k=1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(2))
    moe(torch.tensor([[2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 2.0]]))
    p = math.exp(2) / (math.exp(2) + 1)
    P = ((3 * p + (1 - p)) / 4, (3 * (1 - p) + p) / 4)
    assert moe.aux.item() == pytest.approx(2 * (0.75 * P[0] + 0.25 * P[1]), rel=1e-5)
    assert moe.load.tolist() == [0.75, 0.25]


def test_moe_routing_does_not_depend_on_the_batch():
    from midlayer.model.layers import MoEFeedForward

    torch.manual_seed(1)
    moe = MoEFeedForward(8, 16, "swiglu", n_experts=4, top_k=2)
    x = torch.randn(6, 8)
    together = moe(x)
    alone = torch.cat([moe(x[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-6)


def test_moe_cost_model_counts_active_experts():
    from midlayer.model.flops import active_param_count, ffn_param_count, forward_flops

    dense = ModelConfig(**{**SMALL, "gating": False})
    moe = dataclasses.replace(dense, moe_experts=4, moe_top_k=2)
    per_ffn = ffn_param_count(dense)
    # per block: 3 more experts and a router of dim x E = 32 x 4
    assert param_count(moe) - param_count(dense) == SMALL["n_layers"] * (3 * per_ffn + 32 * 4)
    assert active_param_count(moe) == param_count(moe) - SMALL["n_layers"] * 2 * per_ffn  # 2 of 4 idle
    f_dense, f_moe = forward_flops(dense, 16), forward_flops(moe, 16)
    assert f_moe.ffn_proj > 2 * f_dense.ffn_proj  # two experts per token plus the router
    assert f_moe.ffn_proj < 2 * f_dense.ffn_proj * 1.1


def test_layernorm_equals_torch_layernorm():
    x = torch.randn(3, 5, 8)
    ln = LayerNorm(8, 1e-5, bias=True)
    ref = torch.nn.LayerNorm(8, eps=1e-5)
    with torch.no_grad():
        for p, q in ((ln.weight, ref.weight), (ln.bias, ref.bias)):
            v = torch.randn(8)
            p.copy_(v)
            q.copy_(v)
    torch.testing.assert_close(ln(x), ref(x))
    nb = LayerNorm(8, 1e-5, bias=False)
    assert nb.bias is None
    torch.testing.assert_close(nb(x), F.layer_norm(x, (8,), nb.weight, None, 1e-5))
    # by hand: [1, 3] has mean 2, variance 1 -> [-1, 1] (eps aside)
    torch.testing.assert_close(LayerNorm(2, 0.0)(torch.tensor([[1.0, 3.0]])), torch.tensor([[-1.0, 1.0]]))


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "reglu", "relu", "gelu", "silu"])
def test_ffn_variants_on_hand_inputs(kind):
    ff = FeedForward(2, 2, kind)
    with torch.no_grad():
        ff.w1.weight.copy_(torch.eye(2))
        ff.w2.weight.copy_(torch.eye(2))
        if ff.glu:
            ff.w3.weight.copy_(2 * torch.eye(2))
    x = torch.tensor([[1.0, -1.0]])
    act = {"swiglu": lambda a: a / (1 + math.exp(-a)), "silu": lambda a: a / (1 + math.exp(-a)),
           "geglu": lambda a: 0.5 * a * (1 + math.erf(a / math.sqrt(2))),
           "gelu": lambda a: 0.5 * a * (1 + math.erf(a / math.sqrt(2))),
           "reglu": lambda a: max(a, 0.0), "relu": lambda a: max(a, 0.0)}[kind]
    # GLU: w2(act(w1 x) * w3 x) = act(x_i) * 2 x_i; MLP: act(x_i)
    want = [act(v) * (2 * v if kind in ("swiglu", "geglu", "reglu") else 1.0) for v in (1.0, -1.0)]
    torch.testing.assert_close(ff(x), torch.tensor([want]))
    assert hasattr(ff, "w3") == (kind in ("swiglu", "geglu", "reglu"))
    if ff.glu:  # the inference fusion of w1|w3 computes the same
        ff.fuse()
        torch.testing.assert_close(ff(x), torch.tensor([want]))


def test_post_ln_block_by_hand():
    """With both branches zeroed (wo = w2 = 0) a pre-LN block is the identity and a post-LN block is
    N(N(x)) = N(x): for x = [3, 4], RMS = sqrt(12.5), so [3, 4] / 3.5355 = [0.8485, 1.1314]."""
    out = {}
    for placement in ("pre", "post"):
        cfg = ModelConfig(dim=2, n_layers=1, n_heads=1, n_kv_heads=1, vocab_size=4, max_seq_len=4, multiple_of=2,
                          gating=False, norm_placement=placement, norm_eps=1e-12)
        block = Block(cfg)
        with torch.no_grad():
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
        cos, sin = torch.ones(1, 2), torch.zeros(1, 2)
        out[placement] = block(torch.tensor([[[3.0, 4.0]]]), cos, sin)
    torch.testing.assert_close(out["pre"], torch.tensor([[[3.0, 4.0]]]))
    r = math.sqrt(12.5)
    torch.testing.assert_close(out["post"], torch.tensor([[[3.0 / r, 4.0 / r]]]))


def test_qk_norm_normalises_each_heads_query_and_key():
    m = model_with({"qk_norm": True}, gating=False)
    att = m.layers[0].attention
    seen = {}
    def hook(mod, inputs, out) -> None:  # returns None: the output is not replaced
        seen.setdefault("q", (inputs[0], out))

    att.q_norm.register_forward_hook(hook)
    m(torch.randint(0, 64, (1, 6)))
    q_in, q = seen["q"]  # [B, T, H, hd]: each head's query over head_dim, weight 1
    assert q.shape == (1, 6, m.cfg.n_heads, m.cfg.head_dim)
    torch.testing.assert_close(q, q_in * torch.rsqrt(q_in.pow(2).mean(-1, keepdim=True) + m.cfg.norm_eps))
    assert isinstance(att.q_norm, RMSNorm) and att.q_norm.weight.shape == (m.cfg.head_dim,)


def test_scaled_residual_init_shrinks_the_residual_writers():
    torch.manual_seed(0)
    big = ModelConfig(**{**SMALL, "dim": 128, "n_layers": 8, "gating": False})
    a = Transformer(big)
    b = Transformer(dataclasses.replace(big, init_scheme="scaled_residual"))
    want = 0.02 / math.sqrt(16)
    assert abs(b.layers[0].attention.wo.weight.std().item() - want) < 0.2 * want
    assert abs(b.layers[3].feed_forward.w2.weight.std().item() - want) < 0.2 * want
    assert abs(a.layers[0].attention.wo.weight.std().item() - 0.02) < 0.004
    assert abs(b.layers[0].attention.wq.weight.std().item() - 0.02) < 0.004  # the others unchanged


def test_dropout_acts_only_in_training():
    on = model_with(PARTS["dropouts"], gating=False)
    off = model_with({}, gating=False)
    off.load_state_dict(on.state_dict())
    x = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(on(x).logits, off(x).logits)  # eval: no dropout anywhere
    on.train()
    torch.manual_seed(1)
    a = on(x).logits
    torch.manual_seed(2)
    assert not torch.allclose(a, on(x).logits)


def test_settings_that_make_no_sense_are_refused():
    with pytest.raises(ValueError, match="norm_placement: post-LN"):
        ModelConfig(**SMALL, norm_placement="post", gating=True)
    with pytest.raises(ValueError, match="norm_type"):
        ModelConfig(**SMALL, norm_type="batchnorm")
    with pytest.raises(ValueError, match="ffn_type"):
        ModelConfig(**SMALL, ffn_type="swish")
    with pytest.raises(ValueError, match="dropout"):
        ModelConfig(**SMALL, dropout=1.0)
    with pytest.raises(ValueError, match="attn_dropout"):
        ModelConfig(**SMALL, attn_dropout=0.1, attn_backend="flex")
    from midlayer.engine.pretrained import hf_config_for

    for over, what in ((dict(norm_type="layernorm"), "norm_type"), (dict(ffn_type="gelu"), "ffn_type"),
                       (dict(qk_norm=True, qkv_bias=True), "qk_norm"), (dict(ssm_layers=(1,)), "ssm_layers"),
                       (dict(moe_experts=2), "moe_experts"), (dict(pos_encoding="alibi"), "pos_encoding"),
                       (dict(scale_embeddings=True), "scale_embeddings")):
        cfg = ModelConfig(**{**SMALL, "gating": False, "norm_placement": "pre", "embed_norm": False, **over})
        with pytest.raises(ValueError, match=what):
            hf_config_for(cfg)


# ============================================================================ every setting, end to end
@pytest.mark.parametrize("gating", [False, True])
@pytest.mark.parametrize("name", list(PARTS))
def test_every_part_trains_generates_counts_and_roundtrips(name, gating):
    if gating and name not in GATED:
        pytest.skip("refused with gating (tested above)")
    model = model_with(PARTS[name], gating)
    # training: one step with finite loss and gradients, parameters move
    model.train()
    x = torch.randint(0, 64, (2, 16))
    loss = model(x[:, :-1], x[:, 1:]).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    # the cost model counts exactly the parameters the module has
    assert param_count(model.cfg) == sum(p.numel() for p in model.parameters())
    # cached generation (real skipping for gated models) equals the full-forward reference
    prompt = torch.randint(0, 64, (9,)).tolist()
    cfg = GenerationConfig(max_new_tokens=12)
    assert generate(model, [prompt], cfg) == generate_naive(model, [prompt], cfg)
    ref = model(x).logits
    for skip in ([True, False] if gating else [False]):
        cache = KVCache.for_model(model.cfg, 2)
        pos = torch.arange(16)[None].expand(2, 16)
        got = [forward_cached(model, x[:, :9], cache, pos[:, :9], skip=skip)]
        got += [forward_cached(model, x[:, t:t + 1], cache, pos[:, t:t + 1], skip=skip) for t in range(9, 16)]
        torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-4, rtol=1e-4)
    # checkpoint round trip: config dict and weights rebuild the same model
    again = Transformer(from_dict(ModelConfig, to_dict(model.cfg))).eval()
    again.load_state_dict(model.state_dict())
    torch.testing.assert_close(again(x).logits, ref)


@pytest.mark.parametrize("name", ["relu_mlp", "gelu_mlp", "qk_norm", "layernorm", "post_ln"])
def test_parts_in_the_q4_engine(name):
    """compress_weights handles every FFN type and QK-norm; the q4 model stays close to fp32 and its cached
    decoding equals its own full forward (the engine path of these parts)."""
    from midlayer.engine.quantization import compress_weights

    model = model_with(PARTS[name], gating=False)
    x = torch.randint(0, 64, (1, 14))
    ref = model(x).logits
    q = compress_weights(model_with(PARTS[name], gating=False), "q4")
    got = q(x).logits
    cos = F.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert cos > 0.98
    cache = KVCache.for_model(q.cfg, 1)
    pos = torch.arange(14)[None]
    steps = [forward_cached(q, x[:, :6], cache, pos[:, :6])]
    steps += [forward_cached(q, x[:, t:t + 1], cache, pos[:, t:t + 1]) for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), got, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["sliding_window", "learned_pos", "qk_norm", "gelu_mlp", "alibi", "t5_bias",
                                  "wide_heads"])
def test_speculative_decoding_stays_lossless_with_the_parts(name):
    """Tree verification, hidden transfer's fused pass, EAGLE and early exit go through the same cached
    masks and embedding: with these parts the speculative output is still plain greedy's, in fp32 and q4."""
    from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
    from midlayer.speculative.eagle import EagleDrafter, EagleHead
    from midlayer.speculative.hidden_transfer import HiddenTransfer, HiddenTransferDrafter
    from midlayer.engine.quantization import compress_weights
    from midlayer.speculative.tree import DraftTree
    from midlayer.speculative.verify import speculative_generate

    tree = DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    for fmt in ("fp32", "q4"):
        model = model_with(PARTS[name], gating=False)
        if fmt == "q4":
            compress_weights(model, "q4")
        prompt = torch.randint(0, 64, (10,)).tolist()
        ref = generate(model, [prompt], GenerationConfig(max_new_tokens=16))[0]
        torch.manual_seed(3)
        ht = HiddenTransfer(model.cfg.dim, [1, 2, 2])
        with torch.no_grad():
            for mp in ht.maps:
                mp.weight.add_(0.2 * torch.randn_like(mp.weight))
        for drafter in (HiddenTransferDrafter(model, ht), EagleDrafter(model, EagleHead.for_model(model)),
                        EarlyExitDrafter(model, EarlyExitHead(model.cfg.dim, 2))):
            out, _ = speculative_generate(model, prompt, drafter, tree, 16)
            assert out == ref, (fmt, type(drafter).__name__)


def test_moe_training_adds_the_balancing_loss_and_resumes_exactly(tmp_path):
    """The training loop adds moe_aux_coef x the load-balancing loss, logs it, and a resumed MoE run ends
    with the weights of an uninterrupted one."""
    import json
    from pathlib import Path

    from midlayer.train.checkpoint import list_checkpoints, load_checkpoint
    from midlayer.train.loop import train
    from test_train import debug_configs

    m, s, t = debug_configs(tmp_path, steps=6, ckpt_every=2, keep_last=2, log_every=1)
    m.moe_experts, m.moe_top_k, m.gating = 3, 2, True
    full = dataclasses.replace(t, out_dir=str(tmp_path / "full"))
    train(m, s, full, progress=False)
    recs = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl") if '"moe_aux"' in line]
    assert len(recs) == 6 and all(1.0 <= r["moe_aux"] <= 3.0 for r in recs)  # between balanced and collapsed
    # it is in the loss: without it (coefficient 0) the same run ends with other router weights
    m0 = dataclasses.replace(m, moe_aux_coef=0.0)
    train(m0, s, dataclasses.replace(t, out_dir=str(tmp_path / "no-aux")), progress=False)
    a0 = load_checkpoint(list_checkpoints(tmp_path / "no-aux")[-1])["model"]
    a1 = load_checkpoint(list_checkpoints(tmp_path / "full")[-1])["model"]
    router = "layers.0.feed_forward.router.weight"
    assert not torch.equal(a0[router], a1[router])
    train(m, s, t, progress=False, stop_after=3)
    train(m, s, t, progress=False, resume=True)
    a = load_checkpoint(list_checkpoints(tmp_path / "full")[-1])["model"]
    b = load_checkpoint(list_checkpoints(Path(t.out_dir))[-1])["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)



# ===================================================================================== state-space mixer
def test_chunked_scan_equals_the_sequential_scan():
    from midlayer.model.ssm import scan_chunked, scan_sequential

    torch.manual_seed(0)
    Bt, T, D, N = 2, 37, 6, 4  # T not a multiple of the chunk; a nonzero initial state
    u, B, C = torch.randn(Bt, T, D), torch.randn(Bt, T, N), torch.randn(Bt, T, N)
    delta = F.softplus(torch.randn(Bt, T, D))
    A = -torch.rand(D, N) * 3
    h0 = torch.randn(Bt, D, N)
    y1, h1 = scan_sequential(u, delta, A, B, C, h0)
    for chunk in (1, 5, 16, 64):
        y2, h2 = scan_chunked(u, delta, A, B, C, h0, chunk=chunk)
        torch.testing.assert_close(y2, y1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h2, h1, atol=1e-5, rtol=1e-5)
    # and the same gradients (training differentiates the chunked scan)
    ins = [x.clone().requires_grad_() for x in (u, delta, A, B, C, h0)]
    w_y, w_h = torch.randn_like(y1), torch.randn_like(h1)
    ref = torch.autograd.grad(sum((o * w).sum() for o, w in zip(scan_sequential(*ins), (w_y, w_h))), ins)
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(scan_chunked(*ins, chunk=5), (w_y, w_h))), ins)
    for g_ref, g in zip(ref, got):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)
    # by hand, one channel and one state entry: h_t = exp(d A) h_{t-1} + d u B, y = C h
    y, h = scan_sequential(torch.tensor([[[1.0], [2.0]]]), torch.tensor([[[0.5], [0.5]]]), torch.tensor([[-2.0]]),
                           torch.tensor([[[1.0], [1.0]]]), torch.tensor([[[1.0], [3.0]]]))
    h1_ = 0.5
    h2_ = math.exp(-1.0) * h1_ + 1.0
    torch.testing.assert_close(y, torch.tensor([[[h1_], [3 * h2_]]]))


def test_ssm_mixer_in_generation_keeps_a_constant_state_and_refuses_rollback():
    from midlayer.speculative.tree import DraftTree
    from midlayer.speculative.verify import speculative_generate
    from midlayer.speculative.layer_skip import LayerSkipDrafter

    m = model_with(PARTS["ssm_hybrid"], gating=False)
    assert [b.mixer is not None for b in m.layers] == [False, True, True, False]
    x = torch.randint(0, 64, (1, 20))
    torch.testing.assert_close(m(x).logits, m(x).logits)
    seq = m.layers[1].mixer(torch.randn(1, 20, 32), scan="chunked")
    cache = KVCache.for_model(m.cfg, 1)
    forward_cached(m, x[:, :5], cache, torch.arange(5)[None])
    shapes = {l: (st.conv.shape, st.h.shape) for l, st in cache.ssm.items()}
    for t in range(5, 20):
        forward_cached(m, x[:, t:t + 1], cache, torch.tensor([[t]]))
    assert {l: (st.conv.shape, st.h.shape) for l, st in cache.ssm.items()} == shapes  # whatever the length
    assert seq.shape == (1, 20, 32)
    # batched prompts of different lengths (left padding: the pads leave the state alone)
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (3, 11, 6)]
    cfg = GenerationConfig(max_new_tokens=10)
    assert generate(m, prompts, cfg) == generate_naive(m, prompts, cfg)
    with pytest.raises(ValueError, match="cannot be rolled back"):
        speculative_generate(m, prompts[1], LayerSkipDrafter(m, [0]), DraftTree.chain(2), 8)
    with pytest.raises(ValueError, match="ssm_layers"):
        ModelConfig(**SMALL, ssm_layers=(1,), gating=True)
    with pytest.raises(ValueError, match="ssm_layers"):
        ModelConfig(**SMALL, ssm_layers=(4,), gating=False)


def test_ssm_mixer_sequential_and_chunked_forward_agree():
    from midlayer.model.ssm import SelectiveSSM

    torch.manual_seed(0)
    mixer = SelectiveSSM(ModelConfig(**{**SMALL, "gating": False, "ssm_layers": (0,)}))
    mixer.reset_ssm_parameters()
    x = torch.randn(2, 23, 32)
    torch.testing.assert_close(mixer(x, scan="chunked"), mixer(x, scan="sequential"), atol=1e-5, rtol=1e-5)
    assert torch.equal(mixer(x), mixer(x, scan="sequential"))  # "auto" on CPU
    with pytest.raises(ValueError, match="scan"):
        mixer(x, scan="parallel")

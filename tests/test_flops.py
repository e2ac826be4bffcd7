"""Cost model (paper section 3) against hand counts written out as arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from midlayer.config import ModelConfig, get_preset
from midlayer.model.flops import (active_param_count, block_param_count, decode_flops, format_breakdown, forward_flops,
                            kv_bytes_per_token, param_count, prefill_decode_split)

# Tiny model: d = 8, L = 2, H = 2, K = 1 kv head, hd = 4, V = 10, h = 2 * 8 = 16 (a multiple of 16).
TINY = ModelConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=10, ffn_dim_multiplier=2.0,
                   multiple_of=16, max_seq_len=16)
T = 4
P = 4 * 5 // 2  # causal pairs: 1 + 2 + 3 + 4 = 10

# One block of TINY at T = 4, term by term (gated, sandwich norm).
TINY_BLOCK = {
    "qkv_proj": 2 * 4 * 8 * 8 + 2 * (2 * 4 * 8 * 4),  # wq 512, wk and wv d x (1 * 4): 256 each
    "out_proj": 2 * 4 * 8 * 8,  # 512
    "rope": 3 * 4 * (2 * 4 + 1 * 4),  # q has 2 heads x 4, k 1 head x 4: 144
    "attn_scores": 2 * 4 * 2 * 10,  # 2 hd per pair and head: 160
    "softmax": 5 * 2 * 10,  # 100
    "attn_values": 2 * 4 * 2 * 10,  # 160
    "key_bias": 2 * 10 + 2 * 4,  # one add per score, ln(max(g, eps)) per token: 28
    "ffn_proj": 3 * (2 * 4 * 8 * 16),  # 3072
    "swiglu": 5 * 4 * 16,  # 320
    "norms": 4 * (4 * 4 * 8),  # four norms of T x d elements, 4 FLOPs each: 512
    "residual": 2 * 4 * 8,  # 64
    "gate_mul": 2 * 4 * 8,  # 64
}
TINY_OTHER = {
    "embed_norm": 4 * 4 * 8,  # 128
    "final_norm": 4 * 4 * 8,  # 128
    "lm_head": 2 * 4 * 8 * 10,  # 640
    "router": 1 * 4 * (2 * 8 + 2),  # one router: w . h (16), + b, ReLU per token: 72
    "router_gates": 4 * (0 + 3),  # no running-sum add with one router; 1 - clamp(S): 12
}


def test_tiny_every_term_by_hand() -> None:
    fb = forward_flops(TINY, T)
    assert (fb.n_tokens, fb.n_pairs) == (4, 10)
    for name, v in TINY_BLOCK.items():
        assert getattr(fb, name) == 2 * v, name  # two blocks
    for name, v in TINY_OTHER.items():
        assert getattr(fb, name) == v, name
    assert sum(TINY_BLOCK.values()) == 6160
    assert fb.per_block == (6160.0, 6160.0)
    assert fb.total == 2 * 6160 + 128 + 128 + 640 + 72 + 12 == 13300
    rows = dict(fb.as_rows())
    assert rows["total"] == 13300 and rows["lm_head"] == 640


def test_tiny_dense_pre_norm_by_hand() -> None:
    cfg = dataclasses.replace(TINY, gating=False, norm_placement="pre")
    fb = forward_flops(cfg, T)
    assert fb.norms == 2 * (2 * (4 * 4 * 8))  # two norms per block
    assert fb.key_bias == fb.gate_mul == fb.router == fb.router_gates == 0
    block = 6160 - 28 - 64 - 256  # no key bias, no gate multiply, two norms fewer
    assert fb.total == 2 * block + 128 + 128 + 640 == 12520


def test_paper_12l_total_pinned() -> None:
    # paper-12l: d = 768, L = 12, H = K = 12, hd = 64, h = 3072, V = 50257, sandwich, gated. T = 1024,
    # P = 1024 * 1025 / 2 = 524800, T d = 786432.
    # One block:
    #   wq, wk, wv, wo     4 * 2 * 1024 * 768 * 768         = 4831838208
    #   QK^T and AV        2 * (2 * 768 * 524800)           = 1612185600
    #   FFN                6 * 1024 * 768 * 3072            = 14495514624
    #   RoPE               3 * 1024 * 24 * 64               = 4718592
    #   softmax            5 * 12 * 524800                  = 31488000
    #   SwiGLU             5 * 1024 * 3072                  = 15728640
    #   4 RMSNorms         16 * 786432                      = 12582912
    #   residual adds      2 * 786432                       = 1572864
    #   dense block                                         = 21005629440
    #   gate multiplies    2 * 786432                       = 1572864
    #   key bias           12 * 524800 + 2 * 1024           = 6299648
    #   gated block                                         = 21013501952
    # Outside blocks: 2 norms 8 * 786432 = 6291456; head 2 * 786432 * 50257 = 79047426048;
    #   routers 6 * 1024 * 1538 = 9449472; running sum and gates 1024 * (5 + 18) = 23552.
    # Dense (paper-dense-12): 12 * 21005629440 + 6291456 + 79047426048              = 331121270784
    # Gated:                  12 * 21013501952 + 6291456 + 79047426048 + 9449472 + 23552 = 331225213952
    gated, _, _ = get_preset("paper-12l")
    dense, _, _ = get_preset("paper-dense-12")
    assert forward_flops(gated, 1024).total == 331225213952
    assert forward_flops(dense, 1024).total == 331121270784
    assert forward_flops(gated, 1024).per_block[0] == 21013501952


def test_gqa_shrinks_only_kv() -> None:
    cfg = dataclasses.replace(get_preset("paper-12l")[0], n_kv_heads=4)  # K hd = 256
    fb = forward_flops(cfg, 1024)
    assert fb.qkv_proj == 12 * (2 * 1024 * 768 * 768 + 2 * 2 * 1024 * 768 * 256)
    assert fb.rope == 12 * 3 * 1024 * (12 + 4) * 64
    assert fb.attn_scores == 12 * 2 * 768 * 524800  # query heads set the score count


def test_sparsity_scales_block_terms_only() -> None:
    cfg = dataclasses.replace(TINY, n_layers=4)  # two routers, blocks (0, 3) and (1, 2) paired
    dense_z = forward_flops(cfg, T)
    block = 6160
    other = 128 + 128 + 640 + 2 * 72 + 4 * (1 + 2 * 3)  # one running-sum add, two gate fns
    assert dense_z.total == 4 * block + other
    full = forward_flops(cfg, T, [1.0, 1.0])
    assert full.total == other and full.blocks == 0 and full.per_block == (0.0,) * 4
    half = forward_flops(cfg, T, [0.0, 0.5])
    assert half.per_block == (block, block / 2, block / 2, block)  # block 2 mirrors block 1
    assert half.total == 3 * block + other
    assert half.lm_head == 640 and half.router == 144


def test_forward_equals_sum_of_decode_steps() -> None:
    windowed = dataclasses.replace(TINY, sliding_window=6)  # (steps at contexts shorter than the window, and longer)
    for cfg, seq, z in ((TINY, 4, None), (TINY, 9, [0.3]), (get_preset("paper-12l")[0], 33, [0, 0.1, .2, .5, .5, 1]),
                        (get_preset("paper-dense-4")[0], 17, None), (windowed, 4, None), (windowed, 9, [0.5])):
        fwd = forward_flops(cfg, seq, z)
        steps = [decode_flops(cfg, t, z) for t in range(1, seq + 1)]
        for name, v in fwd.as_rows():
            assert sum(dict(s.as_rows())[name] for s in steps) == pytest.approx(v, rel=1e-12), name



def test_each_part_of_the_menu_by_hand() -> None:
    """The terms each setting changes, in TINY at T = 4 (2 gated blocks of 4 norms, P = 10 pairs, h = 16), by hand
    (the tests above pin only RMSNorm, RoPE, SwiGLU, no experts)."""
    def f(**kw):
        return forward_flops(dataclasses.replace(TINY, **kw), T)
    ln = f(norm_type="layernorm")  # 4 as RMSNorm + subtract the mean + add the bias: 6 a normalised element
    assert (ln.norms, ln.embed_norm, ln.final_norm) == (2 * 4 * 6 * T * 8, 6 * T * 8, 6 * T * 8)
    alibi = f(pos_encoding="alibi")  # no rotation; + a position bias on each of H P scores beside the gate's
    assert (alibi.rope, alibi.key_bias) == (0, 2 * ((2 * P + 2 * T) + 2 * P))
    qk = f(qk_norm=True)  # + RMSNorm over q's 2 heads and k's 1 head of 4: T (H + K) hd elements a block
    assert qk.norms == 2 * (4 * 4 * T * 8 + 4 * T * 3 * 4)
    mlp = f(ffn_type="relu")  # two matrices, and the activation without the GLU's product: 4 a hidden unit
    assert (mlp.ffn_proj, mlp.swiglu) == (2 * 2 * (2 * T * 8 * 16), 2 * 4 * T * 16)
    moe = f(moe_experts=4, moe_top_k=2)  # k = 2 experts' FFNs, + router 2 T d E, its softmax 5 T E, sum 2 k T d
    assert moe.ffn_proj == 2 * (2 * 3 * 2 * T * 8 * 16 + 2 * T * 8 * 4 + 5 * T * 4 + 2 * 2 * T * 8)
    assert moe.swiglu == 2 * (2 * 5 * T * 16)
    hybrid_cfg = dataclasses.replace(TINY, ssm_layers=(1,), gating=False, qk_norm=True)
    hybrid = forward_flops(hybrid_cfg, T)  # block 1 mixes by state space: no attention terms, no QK-norm
    assert hybrid.norms == 4 * 4 * T * 8 * 2 + 4 * T * 3 * 4 and hybrid.attn_scores == 2 * 4 * 2 * P
    assert kv_bytes_per_token(hybrid_cfg) == kv_bytes_per_token(TINY) / 2  # K/V in one block of two


def test_decode_step_by_hand() -> None:
    # One token attending to 3 keys (itself and 2 cached) in TINY.
    fb = decode_flops(TINY, 3)
    assert fb.attn_scores == 2 * (2 * 4 * 2 * 3)
    assert fb.softmax == 2 * (5 * 2 * 3)
    assert fb.qkv_proj == 2 * (2 * 8 * 8 + 2 * 2 * 8 * 4)
    assert fb.lm_head == 2 * 8 * 10


def test_prefill_decode_split() -> None:
    cfg = get_preset("paper-12l")[0]
    z = [0, 0, 0.1, 0.2, 0.4, 0.9]
    split = prefill_decode_split(cfg, 100, 20, z)
    assert split.prefill == forward_flops(cfg, 100, z).total
    loop = sum(decode_flops(cfg, t, z).total for t in range(101, 121))
    assert split.decode == pytest.approx(loop, rel=1e-12)
    assert split.prefill + split.decode == pytest.approx(forward_flops(cfg, 120, z).total, rel=1e-12)
    # TINY: 1 prompt token, 1 new token at context 2: the T = 2 forward minus the T = 1 forward.
    s = prefill_decode_split(TINY, 1, 1)
    assert s.decode == forward_flops(TINY, 2).total - forward_flops(TINY, 1).total
    assert prefill_decode_split(TINY, 5, 0).decode == 0


def test_sliding_window_blocks_score_only_their_window_by_hand() -> None:
    """A window-2 block at T = 4 scores 1 + 2 + 2 + 2 = 7 pairs, not 10 (the model costed every window block as a
    full one: 32x too much attention at T = 1024, W = 16). Block 1 is global (Gemma 3's mix)."""
    from midlayer.model.flops import causal_pairs

    assert [causal_pairs(4, w) for w in (0, 1, 2, 4, 9)] == [10, 4, 7, 10, 10]
    assert causal_pairs(3, 2, context=4) == 2 + 2 + 2 and causal_pairs(2, 0, context=3) == 4 + 5
    assert causal_pairs(1024, 16) == 16 * 17 // 2 + (1024 - 16) * 16 == 16264
    cfg = dataclasses.replace(TINY, sliding_window=2, full_attention_layers=(1,))
    fb = forward_flops(cfg, T)
    assert (fb.n_pairs, fb.window_pairs) == (10, 7)
    per_pair = 2 * 4 * 2 + 5 * 2 + 2 * 4 * 2 + 2  # scores, softmax, values, key bias: 44 FLOPs a pair
    assert fb.per_block == (6160.0 - per_pair * 3, 6160.0)
    assert fb.attn_scores == 2 * 4 * 2 * (7 + 10) and fb.total == 13300 - per_pair * 3
    # a decode step at context 5: the window block scores 2 keys, the global one 5
    assert decode_flops(cfg, 5).softmax == 5 * 2 * (2 + 5)
    everywhere = dataclasses.replace(TINY, sliding_window=2)
    assert forward_flops(everywhere, T).total == 13300 - 2 * per_pair * 3
    for c, z in ((cfg, [0.25]), (everywhere, None)):  # the sum of its decode steps, in closed form
        split = prefill_decode_split(c, 3, 6, z)
        assert split.decode == pytest.approx(sum(decode_flops(c, t, z).total for t in range(4, 10)), rel=1e-12)
        assert split.prefill + split.decode == pytest.approx(forward_flops(c, 9, z).total, rel=1e-12)


def test_param_count_by_hand() -> None:
    # embedding 10 * 8; per block wq 64 + wk 32 + wv 32 + wo 64 + FFN 3 * 8 * 16 + 4 norms * 8 = 608;
    # embedding norm + final norm 16; output 80; one router 8 + 1.
    assert block_param_count(TINY) == 64 + 32 + 32 + 64 + 384 + 32 == 608
    assert param_count(TINY) == 80 + 2 * 608 + 16 + 80 + 9 == 1401
    assert param_count(dataclasses.replace(TINY, tie_embeddings=True)) == 1401 - 80
    dense_pre = dataclasses.replace(TINY, gating=False, norm_placement="pre")
    assert param_count(dense_pre) == 80 + 2 * (608 - 16) + 16 + 80 == 1360
    # paper-12l: 2 * 50257 * 768 + 12 * (4 * 768^2 + 3 * 768 * 3072 + 4 * 768) + 2 * 768 + 6 * 769
    assert block_param_count(get_preset("paper-12l")[0]) == 9440256
    assert param_count(get_preset("paper-12l")[0]) == 190483974


def test_active_params_and_kv_bytes() -> None:
    cfg = dataclasses.replace(TINY, n_layers=4)
    total = 80 + 4 * 608 + 16 + 80 + 2 * 9
    assert param_count(cfg) == total
    assert active_param_count(cfg) == total
    # 2 N_B sum z = 2 * 608 * (0.25 + 0.5)
    assert active_param_count(cfg, [0.25, 0.5]) == total - 912
    # K and V, 1 kv head of 4, 4 blocks, 2 bytes: 64; skipped blocks hold none.
    assert kv_bytes_per_token(cfg) == 2 * 4 * 1 * 4 * 2 == 64
    assert kv_bytes_per_token(cfg, 4) == 128
    assert kv_bytes_per_token(cfg, 2, [0.25, 0.5]) == 16 * (0.75 + 0.5 + 0.5 + 0.75)
    assert kv_bytes_per_token(get_preset("paper-12l")[0]) == 2 * 12 * 12 * 64 * 2 == 36864


@pytest.mark.parametrize("call, match", [
    (lambda: forward_flops(TINY, 0), "seq_len"),
    (lambda: forward_flops(TINY, -3), "seq_len"),
    (lambda: forward_flops(TINY, 4, [0.1, 0.2]), "one value per first-half block"),
    (lambda: forward_flops(TINY, 4, [1.5]), r"\[0, 1\]"),
    (lambda: forward_flops(TINY, 4, [float("nan")]), r"\[0, 1\]"),
    # eq. 2's S is cumulative: a token closed at block 0 is closed at block 1 too
    (lambda: forward_flops(dataclasses.replace(TINY, n_layers=4), 4, [0.9, 0.0]),
     r"must not decrease .* sparsity\[1\] = 0.0 < sparsity\[0\] = 0.9"),
    (lambda: forward_flops(dataclasses.replace(TINY, gating=False), 4, [0.0]), "gated"),
    (lambda: decode_flops(TINY, 0), "context_len"),
    (lambda: prefill_decode_split(TINY, 4, -1), "new_tokens"),
])
def test_validation(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        call()


def test_longer_than_max_seq_len_is_allowed() -> None:
    assert forward_flops(TINY, 64).n_tokens == 64  # TINY.max_seq_len is 16


def test_format_breakdown() -> None:
    text = format_breakdown(get_preset("paper-12l")[0], 1024)
    for word in ("lm_head", "ffn_proj", "total", "331.2252", "190,483,974", "prefill", "decode", "36,864"):
        assert word in text, word
    dense = format_breakdown(get_preset("paper-dense-4")[0], 128)
    assert "router" not in dense and "gate_mul" not in dense


def test_query_and_none_gating_charge_the_visible_keys_of_skipped_tokens() -> None:
    """Key-indexed gating (eq. 3) hides a skipped token from every query, so it does no work in the block;
    with "query" or "none" gating later tokens still read its key and value. TINY, T = 4, z = 0.5 in both
    blocks, per skipped token and block: k and v 2 * 2 * 8 * 4 = 128, the input RMSNorm 4 * 8 = 32, RoPE on
    k 3 * 4 = 12: 172; two of the four tokens in each of the two blocks: 4 * 172 = 688."""
    key = forward_flops(TINY, T, [0.5])
    assert key.skipped_kv == 0 and key.per_block == (3080.0, 3080.0)
    for mode in ("query", "none"):
        cfg = dataclasses.replace(TINY, gate_attention=mode)
        fb = forward_flops(cfg, T, [0.5])
        # "none" adds no gate bias to the scores: the key bias's 28 per block (TINY_BLOCK), on half the tokens
        bias = 14 if mode == "none" else 0
        assert fb.skipped_kv == 688 and fb.per_block == (3080.0 + 344 - bias, 3080.0 + 344 - bias)
        assert fb.total == key.total + 688 - 2 * bias
        # nothing skipped, nothing charged
        assert forward_flops(cfg, T).total == forward_flops(TINY, T).total - (2 * 28 if mode == "none" else 0)
        # QK-norm on k adds 4 * 4 per skipped token and block; the decode steps still add up to the forward pass
        assert forward_flops(dataclasses.replace(cfg, qk_norm=True), T, [0.5]).skipped_kv == 4 * (172 + 16)
        steps = [decode_flops(cfg, t, [0.5]).skipped_kv for t in range(1, T + 1)]
        assert sum(steps) == pytest.approx(688)
        # and its K/V stays in the cache: 2 * K hd * 2 bytes in both blocks, whatever the sparsity
        assert kv_bytes_per_token(cfg, 2, [0.5]) == 2 * 4 * 2 * 2
    assert kv_bytes_per_token(TINY, 2, [0.5]) == 2 * 4 * 2 * 1

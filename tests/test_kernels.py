"""The q4 format's C kernels (midlayer/kernels.py, csrc/qkernels.c): bit-identical to their PyTorch
reference, AVX2 == portable scalar path, and row-invariant -- so a row's logits do not depend on how many
rows share its forward, and speculative output equals plain greedy output token for token."""

from __future__ import annotations

import pytest
import torch

from midlayer import kernels
from midlayer.attention import apply_rope
from midlayer.generate import GenerationConfig, forward_cached, generate
from midlayer.kv_cache import KVCache
from midlayer.quantization import compress_weights
from midlayer.speculative import DraftTree, OracleDrafter, RandomDrafter, speculative_generate
from tiny_models import make_tiny

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")

V = 96
DIMS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=64, multiple_of=32)


@pytest.fixture(params=[True, False], ids=["avx2", "scalar"])
def simd(request):
    kernels.set_simd(request.param)
    yield request.param
    kernels.set_simd(True)


def _weights(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(17, K, generator=g) * 2
    x[3, 5] = 400.0  # an outlier: its group's scale is large, the other groups' are not
    x[4] = 0.0  # an all-zero row: scale 0
    return w, x


@pytest.mark.parametrize("M", [1, 2, 5, 8, 13, 17])
def test_gemms_equal_their_reference_bit_for_bit(simd, M):
    w, x = _weights(40, 96)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    assert torch.equal(kernels.gemm_q4_1(x[:M], packed, scales), kernels.gemm_q4_1_reference(x[:M], packed, scales))
    assert torch.equal(kernels.gemm_q8_0(x[:M], codes, d), kernels.gemm_q8_0_reference(x[:M], codes, d))
    q, dq, sq = kernels.quantize_q8(x[:M])
    rq, rdq, rsq = kernels.quantize_q8_reference(x[:M])
    assert torch.equal(q, rq) and torch.equal(dq, rdq) and torch.equal(sq, rsq)


def test_quantisation_hand_example():
    """One group of 32: d = amax/127, q = round(x/d) (half to even), s = d * sum(q)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 2.54, -1.0, 0.01  # d = 0.02: q = 127, -50, round(0.5) = 0 (half to even)
    q, d, s = kernels.quantize_q8(x)
    assert float(d) == pytest.approx(0.02)
    assert q[0, :3].tolist() == [127, -50, 0] and int(q[0, 3:].abs().sum()) == 0
    assert float(s) == pytest.approx(0.02 * 77)


def test_gemm_rows_are_invariant():
    """Row 0 computed alone, or among 2..17 rows: the same bits (exact int32 block sums, per-row order)."""
    w, x = _weights(200, 128, seed=1)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    alone4, alone8 = kernels.gemm_q4_1(x[:1], packed, scales), kernels.gemm_q8_0(x[:1], codes, d)
    for m in range(2, 18):
        assert torch.equal(kernels.gemm_q4_1(x[:m], packed, scales)[:1], alone4)
        assert torch.equal(kernels.gemm_q8_0(x[:m], codes, d)[:1], alone8)


def test_quantisers_recover_file_codes_and_approximate_the_matmul():
    """Weights that are exactly d q + m (fp16 d, m: a Q4_1 file) requantise to the same codes; the kernel's
    result is the dense matmul of the represented weight up to the Q8 activation rounding."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (64, 4, 32), generator=g)
    q[:, :, 0], q[:, :, 1] = 0, 15  # Q4_1 blocks span their full code range
    d = (torch.rand(64, 4, generator=g) * 0.01 + 1e-3).half()
    m = (-torch.rand(64, 4, generator=g) * 0.05).half()
    w = (d.float()[..., None] * q + m.float()[..., None]).reshape(64, 128)
    packed, scales = kernels.quantize_q4_1(w)
    assert torch.equal(kernels.unpack_q4_1(packed).long(), q)
    assert torch.equal(kernels.dequantize_q4_1(packed, scales), w)
    c8 = torch.randint(-127, 128, (64, 4, 32), generator=g)
    c8[:, :, 0] = 127
    w8 = (d.float()[..., None] * c8).reshape(64, 128)
    codes, d8 = kernels.quantize_q8_0(w8)
    assert torch.equal(codes.long(), c8) and torch.equal(kernels.dequantize_q8_0(codes, d8), w8)
    x = torch.randn(5, 128, generator=g)
    for y, ref in ((kernels.gemm_q4_1(x, packed, scales), x @ w.t()), (kernels.gemm_q8_0(x, codes, d8), x @ w8.t())):
        assert float((y - ref).norm() / ref.norm()) < 0.02


def _attention_inputs(T: int, S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 6, T, 16, generator=g)
    k = torch.randn(1, 2, S, 16, generator=g)
    v = torch.randn(1, 2, S, 16, generator=g)
    mask = torch.zeros(1, 1, T, S)
    for t in range(T):  # causal over the last T slots, plus one hidden context key (a skipped token)
        mask[0, 0, t, S - T + t + 1:] = float("-inf")
    mask[..., 3] = float("-inf")
    mask[..., 5] = -1.5  # a gated key: ln g
    return q, k, v, mask


def test_attention_matches_reference_and_rows_are_invariant(simd):
    q, k, v, mask = _attention_inputs(12, 40)
    out = kernels.attention(q, k, v, mask)
    torch.testing.assert_close(out, kernels.attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-6)
    for T in range(1, 13):  # the first row among T rows
        assert torch.equal(kernels.attention(q[:, :, :T], k, v, mask[:, :, :T])[:, :, :1], out[:, :, :1])
    # a decode step: the same row over only the keys that exist then, with an all-visible (None) mask
    S0 = 40 - 12 + 1
    alone = kernels.attention(q[:, :, :1], k[:, :, :S0], v[:, :, :S0], mask[:, :, :1, :S0])
    assert torch.equal(alone, out[:, :, :1])


def test_attention_avx2_equals_scalar():
    q, k, v, mask = _attention_inputs(5, 70, seed=3)
    fast = kernels.attention(q, k, v, mask)
    kernels.set_simd(False)
    try:
        slow = kernels.attention(q, k, v, mask)
    finally:
        kernels.set_simd(True)
    assert torch.equal(fast, slow)


def test_rmsnorm_and_rope_store_match_pytorch():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(7, 64, generator=g) * 100, torch.rand(64, generator=g)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-5), ref, rtol=1e-6, atol=1e-6)
    B, T, H, Hk, D = 1, 3, 4, 2, 16
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    kc, vc = torch.zeros(B, Hk, 10, D), torch.zeros(B, Hk, 10, D)
    slots = torch.tensor([[4, 5, 7]])
    view = qkv.view(B, T, H + 2 * Hk, D)
    q_ref = apply_rope(view[:, :, :H], cos[:, :, None], sin[:, :, None])
    k_ref = apply_rope(view[:, :, H:H + Hk], cos[:, :, None], sin[:, :, None])
    v_ref = view[:, :, H + Hk:].clone()
    kernels.rope_store(qkv, H, Hk, cos, sin, kc, vc, slots)
    torch.testing.assert_close(view[:, :, :H], q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc[:, :, [4, 5, 7]], k_ref.transpose(1, 2), rtol=1e-6, atol=1e-6)
    assert torch.equal(vc[:, :, [4, 5, 7]], v_ref.transpose(1, 2))
    assert float(kc[:, :, 6].abs().sum()) == 0.0


def _q4(seed: int = 0):
    return compress_weights(make_tiny(DIMS, gating=False, seed=seed), "q4")


def test_q4_model_rows_bit_identical_decode_verify_prefill():
    """A row's logits, and the K/V it writes, are the same bits whether it is decoded alone, verified among
    1..16 rows, or part of a prefill chunk (SPEC section 9, batch invariance)."""
    model = _q4()
    assert model.batch_invariant
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(5))
    ctx = 12

    def run(T: int):
        cache = KVCache.for_model(model.cfg, 1, 40)
        forward_cached(model, ids[:, :ctx], cache, torch.arange(ctx)[None])
        logits = forward_cached(model, ids[:, ctx:ctx + T], cache, torch.arange(ctx, ctx + T)[None])
        return logits[0, 0], cache.k[:, :, :, ctx].clone(), cache.v[:, :, :, ctx].clone()

    alone = run(1)
    for T in range(2, 17):
        rows = run(T)
        assert all(torch.equal(a, b) for a, b in zip(alone, rows)), T
    # prefill chunk: the same row as the last of a 13-token prefill
    cache = KVCache.for_model(model.cfg, 1, 40)
    pre = forward_cached(model, ids[:, :ctx + 1], cache, torch.arange(ctx + 1)[None])
    assert torch.equal(pre[0, ctx], alone[0])


@pytest.mark.parametrize("tree", [DraftTree.chain(3), DraftTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])],
                         ids=["chain3", "tree5"])
def test_q4_speculative_output_equals_plain_greedy(tree):
    """Lossless in q4 by exact token equality, for a wrong drafter (every draft rejected: the bonus token
    comes from a multi-row forward) and a perfect one (long acceptances)."""
    model = _q4(seed=1)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        prompt = torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        ref = generate(model, [prompt], GenerationConfig(max_new_tokens=20))[0]
        for drafter in (RandomDrafter(V, seed=2), OracleDrafter(prompt + ref, V)):
            out, _ = speculative_generate(model, prompt, drafter, tree, 20)
            assert out == ref


def test_draft_trained_on_fp32_base_loads_onto_q4_model_and_stays_lossless(tmp_path):
    """A q4 model's head is Q8_0 codes, not an nn.Linear: the draft's base check must still recognise it
    (the LM-head probe reads the dequantised head), and decoding with the draft stays lossless."""
    from midlayer.drafters import MedusaHeads, load_drafter, save_draft

    base = make_tiny(DIMS, gating=False, seed=2)
    heads = MedusaHeads(DIMS["dim"], 2)
    with torch.no_grad():
        for lin in heads.heads:
            lin.weight.normal_(0, 0.1)
    save_draft(tmp_path / "medusa", heads, base=base)
    model = compress_weights(base, "q4")
    drafter, _, _ = load_drafter(tmp_path / "medusa", model)
    prompt = [3, 14, 15, 92, 65, 35]
    ref = generate(model, [prompt], GenerationConfig(max_new_tokens=16))[0]
    assert speculative_generate(model, prompt, drafter, DraftTree.chain(2), 16)[0] == ref


def test_only_q4_is_called_lossless():
    for fmt in ("fp32", "bf16", "int4"):
        assert not compress_weights(make_tiny(DIMS, gating=False), fmt).batch_invariant
    assert not compress_weights(make_tiny(DIMS, gating=False), "q4", head="fp32").batch_invariant

"""The static step's row-wise kernels (midlayer/ops/fused_rows.py: RMSNorm, SwiGLU's product, RoPE with the K/V
store) against the PyTorch formulas they replace, where the model takes them (inside the step's forwards with
the row-attention kernel, nowhere else), and the step through them. On a CPU the kernels run in Triton's
interpreter (tests/conftest.py); without Triton these skip. (Their build for GPUs: tests/test_row_linear.py.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from tiny_models import assert_drafts_lossless, make_tiny

pytest.importorskip("triton")

from midlayer.engine.decode_step import DecodeStep, static_generate  # noqa: E402
from midlayer.engine.generate import GenerationConfig, generate  # noqa: E402
from midlayer.engine.quantization import fuse_projections  # noqa: E402
from midlayer.model.attention import apply_rope  # noqa: E402
from midlayer.model.layers import RMSNorm  # noqa: E402
from midlayer.ops import fused_rows as fr  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
on_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
V = 96
DIMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=80, multiple_of=32)


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _one_rounding(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """got (bf16) within one bf16 rounding of exact (fp64) plus fp32's error before it: half an ulp and a bit."""
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    return bool(((got.double() - exact).abs() <= ulp / 2 + exact.abs() * 1e-6 + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_is_the_modules_formula(dtype):
    """(x * rsqrt(mean(x^2) + eps)) * w over rows of an odd width: fp32 within fp32 rounding of RMSNorm's own
    path; bf16 one rounding from the exact value (the module's PyTorch path rounds the same once)."""
    norm = RMSNorm(70, 1e-5).to(DEV)
    norm.weight.data = _rand(70, seed=1)
    x = _rand(3, 5, 70, dtype=dtype)
    y = fr.rms_norm(x, norm.weight.to(dtype), norm.eps)
    assert y.dtype == dtype and y.shape == x.shape
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.to(dtype).double()
    if dtype == torch.float32:
        torch.testing.assert_close(y, norm(x), atol=1e-6, rtol=1e-6)
    else:
        assert _one_rounding(y, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    """A block's residual add and the norm after it in one kernel: h the very bits of PyTorch's x + a, and the
    norm the very bits of `rms_norm(h)`."""
    x, a, w = _rand(4, 70, dtype=dtype), _rand(4, 70, dtype=dtype, seed=1), _rand(70, dtype=dtype, seed=2)
    h, y = fr.add_rms_norm(x, a, w, 1e-5)
    assert torch.equal(h, x + a) and torch.equal(y, fr.rms_norm(x + a, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_is_swiglus_product(dtype):
    """silu(a) * b for ab = [a | b], 45 wide (a block tail): fp32 close to PyTorch's ops, bf16 one rounding."""
    ab = _rand(2, 3, 90, dtype=dtype) * 3
    y = fr.silu_mul(ab)
    a, b = ab.double().chunk(2, -1)
    exact = F.silu(a) * b
    assert y.shape == (2, 3, 45) and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), exact, atol=1e-6, rtol=1e-6)
    else:
        assert _one_rounding(y, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_store_is_apply_rope_then_the_store(dtype):
    """q and k rotated as attention.apply_rope rotates them, k and v written at each row's slot, q returned;
    nothing else in the cache touched. Under the interpreter the very bits of PyTorch's ops (the same products
    and sum in fp32, unfused, then one rounding); compiled, within rounding (a GPU may fuse into an FMA)."""
    H, Hk, d, S = 4, 2, 16, 12
    qkv = _rand(2, 3, H + 2 * Hk, d, dtype=dtype)
    cos, sin = _rand(2, 3, d, seed=1), _rand(2, 3, d, seed=2)
    slots = torch.tensor([[7, 2, 9], [0, 11, 4]], device=DEV)
    kc, vc = _rand(2, Hk, S, d, dtype=dtype, seed=3), _rand(2, Hk, S, d, dtype=dtype, seed=4)
    kr, vr = kc.clone(), vc.clone()
    q = fr.rope_store(qkv, cos, sin, H, kc, vc, slots)
    qr = fr.reference_rope_store(qkv, cos, sin, H, kr, vr, slots)
    assert torch.equal(qr, apply_rope(qkv[:, :, :H], cos[:, :, None], sin[:, :, None]))  # (the model's own RoPE)
    assert q.shape == (2, 3, H, d) and q.dtype == dtype
    for got, want in ((q, qr), (kc, kr), (vc, vr)):
        if os.environ.get("TRITON_INTERPRET") == "1":
            assert torch.equal(got, want)
        else:  # (an fp32 ulp apart can round to neighbouring bf16 values)
            torch.testing.assert_close(got, want, **({} if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)))
    with pytest.raises(ValueError, match="want H"):
        fr.rope_store(qkv, cos, sin, H + 1, kc, vc, slots)


def test_a_rows_bits_depend_on_no_other_row():
    """Each kernel gives a row the same bits alone as among other rows (each program reads its row alone)."""
    x, w = _rand(9, 70, dtype=torch.bfloat16), _rand(70, dtype=torch.bfloat16, seed=1)
    assert torch.equal(fr.rms_norm(x[4:5], w, 1e-5)[0], fr.rms_norm(x, w, 1e-5)[4])
    ab = _rand(9, 90, dtype=torch.bfloat16)
    assert torch.equal(fr.silu_mul(ab[4:5])[0], fr.silu_mul(ab)[4])


def _counting(monkeypatch) -> dict[str, int]:
    calls = {"rms_norm": 0, "add_rms_norm": 0, "silu_mul": 0, "rope_store": 0}
    for name in calls:
        real = getattr(fr, name)

        def wrapped(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)
        monkeypatch.setattr(fr, name, wrapped)
    return calls


@on_cpu
def test_the_step_takes_them_with_the_row_attention_kernel_and_nothing_else_does(monkeypatch):
    """A plain decode step of the fused model (q|k|v and w1|w3 joined) with attention="triton" runs every norm
    (the tiny model is sandwich-normed; the FFN's with the residual add), every SwiGLU product and every block's RoPE + store through the kernels;
    the same step with the PyTorch attention, and `generate`, run none. Its tokens equal the PyTorch step's
    and `generate`'s here (a check of sense: other kernels may round otherwise at a near-tie)."""
    model = fuse_projections(make_tiny(DIMS, False))
    L = model.cfg.n_layers
    calls = _counting(monkeypatch)
    prompt = [(5 * i + 2) % V for i in range(7)]
    cfg = GenerationConfig(max_new_tokens=6)
    ref = generate(model, [prompt], cfg)[0]
    torch_step = static_generate(model, [prompt], cfg, buckets=(8, 16))[0]
    assert set(calls.values()) == {0}
    step = DecodeStep(model, max_len=32, buckets=(8, 16), attention="triton")
    step.prefill(torch.tensor([prompt]))
    calls.update(rms_norm=0, add_rms_norm=0, silu_mul=0, rope_store=0)
    step.decode(torch.tensor([3]), len(prompt))
    norms = sum(isinstance(m, RMSNorm) for m in model.modules())  # (sandwich: 4 a block, the embedding's, the last)
    # (each block's FFN norm with the residual add before it)
    assert calls == {"rms_norm": norms - L, "add_rms_norm": L, "silu_mul": L, "rope_store": L} and norms == 4 * L + 2
    assert static_generate(model, [prompt], cfg, step=step)[0] == torch_step == ref


@on_cpu
def test_a_row_kernel_off_the_formula_takes_the_attention_kernel_down_with_it(monkeypatch):
    """The row-wise kernels run wherever the row-attention kernel does, so the probe's self-check covers them:
    one that is 1% off (row-invariant, so the probe alone would pass it) is reported, and the step attends in
    PyTorch ops. (The kernels tried on this CPU by pretending, as on CUDA with Triton.)"""
    from midlayer.engine import decode_step
    from midlayer.engine.decode_step import StepKernels, invariant_buckets

    monkeypatch.setattr(decode_step, "triton_kernels", lambda mdl: True)
    monkeypatch.setattr(decode_step, "STEP_CANDIDATES", (StepKernels((8, 16), attention="triton"),
                                                         StepKernels((8, 16))))
    model = fuse_projections(make_tiny(DIMS, False))
    assert invariant_buckets(model, 40) == (decode_step.STEP_CANDIDATES[0], True)
    real = fr.silu_mul
    monkeypatch.setattr(fr, "silu_mul", lambda ab: real(ab) * 1.01)
    with pytest.warns(RuntimeWarning, match=r"row-wise \(RMSNorm, SwiGLU, RoPE\) kernel failed.*from the formula"):
        assert invariant_buckets(fuse_projections(make_tiny(DIMS, False)), 40) == (StepKernels((8, 16)), True)


@on_cpu
def test_a_bf16_step_through_every_kernel_is_row_invariant_and_lossless():
    """bf16, where every kernel rounds its output to bf16 itself (the norms, SwiGLU, RoPE, the attention when
    the probe's tap is off): the probe passes, and speculative decoding gives plain decoding's tokens exactly
    with noisy and random drafts."""
    model = fuse_projections(make_tiny(DIMS, False)).to(torch.bfloat16)
    step = DecodeStep(model, max_len=48, buckets=(8, 16), attention="triton")
    assert step.row_invariant()
    prompt = [(7 * i + 3) % V for i in range(9)]
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=10), step=step)[0]
    assert_drafts_lossless(model, step, prompt, ref)

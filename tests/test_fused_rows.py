"""The static step's row-wise kernels (midlayer/ops/fused_rows.py: RMSNorm, SwiGLU's product, RoPE with the K/V
store) against the PyTorch formulas they replace, where the model takes them (inside the step's forwards with
the row-attention kernel, nowhere else), and the step through them. On a CPU the kernels run in Triton's
interpreter (tests/conftest.py); without Triton these skip. (Their build for GPUs: tests/test_row_linear.py.)"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F
from tiny_models import assert_drafts_lossless, make_tiny, RowWiseBLAS

pytest.importorskip("triton")

from midlayer.engine.decode_step import DecodeStep, static_generate  # noqa: E402
from midlayer.engine.generate import GenerationConfig, generate  # noqa: E402
from midlayer.engine.quantization import fuse_projections  # noqa: E402
from midlayer.model.attention import apply_rope  # noqa: E402
from midlayer.model.layers import RMSNorm  # noqa: E402
from midlayer.ops import fused_rows as fr  # noqa: E402
from midlayer.speculative.tree import DraftTree  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_block_that_leaves_its_last_add_to_the_next_gives_the_same_bits(dtype, monkeypatch):
    """Block.forward's defer / carry (what the static step chains its blocks by): block 1 fed (h, f) from block
    0 gives the very bits of block 1 fed h + f, inside the kernels' context (where the add and block 1's first
    norm are one kernel) and outside it (the same add, one block later). Sandwich and pre-norm blocks."""
    calls = _counting(monkeypatch)
    for sandwich in (True, False):
        model = make_tiny(DIMS, False, **({} if sandwich else dict(norm_placement="pre"))).to(DEV, dtype)
        b0, b1 = model.layers[0], model.layers[1]
        x = _rand(1, 5, DIMS["dim"], dtype=dtype, seed=3)
        cos, sin = model.rope_cos[:5], model.rope_sin[:5]
        for kernels in (True, False):
            with torch.no_grad(), (fr.active() if kernels else torch.no_grad()):
                h, f = b0(x, cos, sin, defer=True)
                assert f is not None and torch.equal(h + f, b0(x, cos, sin))
                assert torch.equal(b1(h, cos, sin, carry=f), b1(h + f, cos, sin))
            # (inside: each block's FFN norm with its add, 4, and block 1's first norm with the carry, 1)
            assert calls["add_rms_norm"] == (5 if kernels else 0)
            calls["add_rms_norm"] = 0


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
    (the tiny model is sandwich-normed; the FFN's with the residual add, and each block's first with the add
    the block before left to it), every SwiGLU product and every block's RoPE + store through the kernels;
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
    # (each block's FFN norm with the residual add before it, and each block's first norm but block 0's with
    # the last add of the block before: Block.forward's carry)
    assert calls == {"rms_norm": norms - 2 * L + 1, "add_rms_norm": 2 * L - 1, "silu_mul": L, "rope_store": L}
    assert norms == 4 * L + 2
    assert static_generate(model, [prompt], cfg, step=step)[0] == torch_step == ref


@on_cpu
def test_a_row_kernel_off_the_formula_takes_the_attention_kernel_down_with_it(monkeypatch):
    """The row-wise kernels run wherever the row-attention kernel does, so the probe's self-check covers them:
    one that is 1% off (row-invariant, so the probe alone would pass it) is reported, and the step attends in
    PyTorch ops. (The kernels tried on this CPU by pretending, as on CUDA with Triton; on RowWiseBLAS, where the
    buckets (8, 16) in PyTorch ops are row-invariant on every CPU.)"""
    from midlayer.engine import decode_step
    from midlayer.engine.decode_step import StepKernels, invariant_buckets

    RowWiseBLAS().install(monkeypatch)
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
@pytest.mark.parametrize("rows", [0, 4], ids=["row", "rows4"])
def test_a_bf16_step_through_every_kernel_is_row_invariant_and_lossless(rows, monkeypatch):
    """bf16, where every kernel rounds its output to bf16 itself (the norms, SwiGLU, RoPE, the attention when
    the probe's tap is off): the probe passes, and speculative decoding gives plain decoding's tokens exactly
    with noisy and random drafts. The attention one row a program, and 4 rows a program (tl.dot)."""
    from midlayer.ops import row_attention

    monkeypatch.setattr(row_attention, "ROWS", rows)
    model = fuse_projections(make_tiny(DIMS, False)).to(torch.bfloat16)
    step = DecodeStep(model, max_len=48, buckets=(8, 16), attention="triton")
    assert step.row_invariant()
    prompt = [(7 * i + 3) % V for i in range(9)]
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=10), step=step)[0]
    assert_drafts_lossless(model, step, prompt, ref)


class _Logged:
    """A kernel that logs each launch by its function's name (`kernel[grid](...)`), then runs it."""

    def __init__(self, kernel, log: list[str]) -> None:
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        self.log.append(self.kernel.fn.__name__)
        return self.kernel[grid]

    def __getattr__(self, name: str):  # (what a traced graph's launch reads of its kernel: arg_names, ...)
        return getattr(self.kernel, name)


class _TracedAsOnAGpu:
    """torch.compile(fullgraph=True) of a call through the kernels as it goes on a GPU, run on this CPU. Where
    Triton has a GPU, dynamo traces a launch of a compiled kernel (a JITFunction) into the graph as one node
    (`triton_kernel_wrapper_mutation`), and it cannot trace an interpreter's kernel at all. So for the trace the
    kernels are made JITFunctions, as on a GPU, with dynamo told that Triton runs; then the traced graph's
    launches run the interpreter's kernels (logged, `_Logged`). `graphs`: what each trace gave."""

    def __init__(self, monkeypatch, fns: tuple, log: list[str]) -> None:
        from triton.runtime.jit import JITFunction

        from midlayer.ops import triton_build

        self.mp, self.fns, self.tb = monkeypatch, fns, triton_build
        self.logged = {f: _Logged(triton_build.kernel(f), log) for f in fns}
        self.jit = {f: JITFunction(f, **getattr(f, "triton_jit", {})) for f in fns}
        self.helpers = {f: {name: (triton_build._kernels[h], JITFunction(h))
                            for name, h in triton_build.helpers(f).items()} for f in fns}
        self.graphs: list = []
        self._kernels(traced=False)

    def _kernels(self, traced: bool) -> None:
        for f in self.fns:
            self.mp.setitem(self.tb._kernels, f, (self.jit if traced else self.logged)[f])
            for name, made in self.helpers[f].items():
                self.mp.setitem(f.__globals__, name, made[traced])
        self.mp.setattr("torch.utils._triton.has_triton", (lambda: True) if traced else (lambda: False))

    def _backend(self, gm, example_inputs):
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        self.graphs.append(gm)
        self._kernels(traced=False)  # (the trace is done: the graph runs here, on the interpreter's kernels)
        for n in gm.graph.nodes:
            if "triton_kernel_wrapper" in str(n.target):
                idx = n.kwargs["kernel_idx"]
                kernel_side_table.id_to_kernel[idx] = self.logged[_kernel_fn(kernel_side_table.get_kernel(idx))]
        return gm.forward

    def __call__(self, fn, *args):
        self._kernels(traced=True)
        self.mp.setattr(self.tb, "interpreted", lambda k: True)  # (the JITFunctions "run" on this CPU)
        try:
            return torch.compile(fn, backend=self._backend, fullgraph=True)(*args)
        finally:
            self.mp.undo()  # (all of it, `interpreted` too: then this CPU runs the interpreter's kernels again)
            self._kernels(traced=False)

    @staticmethod
    def launches(gm) -> list[str]:
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        return [_kernel_fn(kernel_side_table.get_kernel(n.kwargs["kernel_idx"])).__name__ for n in gm.graph.nodes
                if "triton_kernel_wrapper" in str(n.target)]


def _kernel_fn(k):
    """The Python function a kernel (a JITFunction, `_Logged` around one, or the one-config autotuner dynamo
    wraps a launch with num_warps in) was made from."""
    k = k.kernel if isinstance(k, _Logged) else k
    while not inspect.isfunction(k):
        k = k.fn
    return k


@on_cpu
@pytest.mark.parametrize("kind,rows", [("eagle-2", 0), ("hidden-transfer", 0), ("hidden-transfer", 4)])
def test_the_step_through_every_kernel_traces_without_graph_breaks(monkeypatch, kind, rows):
    """Issue 42's proxy for capture, with the Triton kernels (attention, row-wise and linear): EAGLE-2's and
    hidden transfer's device rounds (the draft, the verification forward, the acceptance, the compaction)
    trace under torch.compile(fullgraph=True) as they would on a GPU (`_TracedAsOnAGpu`), each kernel launch
    one node of the graph and no F.linear left. The traced graph launches the very kernels the eager round
    launches, in order, and gives its very bits: the outputs, the K/V cache and the held slots. The attention
    one row a program, and (hidden transfer's round of many rows) 4 rows a program."""
    from midlayer.ops import acceptance, row_attention, row_linear, tree_layout
    from midlayer.speculative.static import DeviceRounds
    from tiny_models import device_drafters
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    torch._dynamo.reset()
    kernel_side_table.reset_table()  # (its launches run the logged kernels: this test's own, none before or after)
    monkeypatch.setattr(row_attention, "ROWS", rows)
    model = fuse_projections(make_tiny({**DIMS, "n_layers": 3, "max_seq_len": 160}, False))
    drafter = device_drafters(model)[kind]
    tree = DraftTree.greedy_from_accuracies([[0.6, 0.2], [0.5]], 4)
    prompt = [(5 * i + 2) % V for i in range(20)]
    fns = fr.KERNELS + row_attention.KERNELS + row_linear.KERNELS + acceptance.KERNELS
    fns += tree_layout.KERNELS if kind == "eagle-2" else ()  # (a dynamic tree's layout)
    runs, log = [], []
    traced = _TracedAsOnAGpu(monkeypatch, fns, log)
    for compiled in (False, True):
        step = DecodeStep(model, max_len=96, buckets=(8, 16, 32, 64), attention="triton", linear="triton")
        _, hidden = step.prefill(torch.tensor([prompt[:-1]]))
        root, last = step._scalar(prompt[-1]), step._scalar(len(prompt) - 1)
        draft = None
        if kind == "hidden-transfer":  # (its first round: the root alone, whose pseudo rows are the first draft)
            step.attach(drafter)
            *_, draft = step.verify(prompt[-1], [], step.tree_tensors([], [], 3), len(prompt) - 1, len(prompt) - 1)
        rounds = DeviceRounds.for_step(step, drafter, tree)
        args = (root, last, *rounds.draft.first(list(prompt), hidden[0], draft))
        log.clear()  # (the call's launches alone)
        with torch.no_grad():
            out = traced(rounds.round, *args) if compiled else rounds.round(*args)
        runs.append((out, step.k.clone(), step.v.clone(), step.held.clone(), list(log), list(traced.graphs)))
    (eager, *state_e, log_e, _), (comp, *state_c, log_c, graphs) = runs
    assert len(graphs) == 1 and log_e and _TracedAsOnAGpu.launches(graphs[0]) == log_e == log_c
    assert not [n for n in graphs[0].graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    # (every kernel but SwiGLU's, the add-and-norm, RoPE's and the attention's pass 2: with the linear kernel, the
    # product and each norm with the residual add before it are the linears' prologues, RoPE and the K/V store
    # q|k|v's epilogue; pass 2 runs in pass 1's launch)
    assert set(log_e) == {f.__name__ for f in fns} - {"_silu_mul_rows", "_add_rms_norm_rows", "_rope_store_rows",
                                                      "_combine_chunks", "_attend_chunks" if rows else "_attend_rows"}
    for a, b in zip((*eager, *state_e), (*comp, *state_c)):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    kernel_side_table.reset_table()

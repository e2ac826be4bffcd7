"""The row-attention kernel (midlayer/ops/row_attention.py) against the naive formula, its row invariance by
construction, and the probe's choice. Its build for GPUs, and the fp32 step through it with one-row plain
decoding: tests/test_row_linear.py; the step's tokens against the PyTorch attention's, and the bf16 step:
tests/test_fused_rows.py. On a CPU the kernel runs in Triton's interpreter (tests/conftest.py); without
Triton these skip."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from tiny_models import benchmark, make_tiny, RowWiseBLAS

pytest.importorskip("triton")

from midlayer.engine import decode_step  # noqa: E402
from midlayer.engine.decode_step import invariant_buckets  # noqa: E402
from midlayer.engine.quantization import compress_weights  # noqa: E402
from midlayer.ops.row_attention import reference, reference_keys, row_attention, row_keys  # noqa: E402

# the kernel's own tests run where it runs: on CUDA compiled, else interpreted; the step's run on the CPU and
# need the interpreter (tests/conftest.py sets it where there is no CUDA)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
on_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
V = 96
DIMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=80, multiple_of=32)


def _case(H: int, Hk: int, d: int, dtype: torch.dtype, N: int = 6, S: int = 180, seed: int = 0, at: int = 126):
    """A forward's operands as the step builds them: rows at positions at..at+3 (a root and a 3-deep branch
    whose own keys sit at slots 150.. , not next to the committed text) and padding at position 0; keys
    in position order through `keys`, the masked ones at -inf. At 126..129 the rows' keys span the kernel's
    chunks 0 and 1 (CHUNK = 64), and the branch's 2..3 of them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N, H, d, generator=g).to(dtype).transpose(1, 2)  # (a view, as `attend` gets it)
    kl, vl = (torch.randn(1, Hk, S, d, generator=g).to(dtype) for _ in range(2))
    pos = torch.tensor([[at, at + 1, at + 2, at + 3] + [0] * (N - 4)])
    keys = torch.arange(S).expand(1, N, S).clone()
    kmask = torch.full((1, N, S), float("-inf"))
    for i in range(N):
        p = int(pos[0, i])
        kmask[0, i, :p + 1] = 0
        if i < 4:
            keys[0, i, at:p + 1] = torch.arange(150, 150 + p - at + 1)  # the branch's keys, at the tree's slots
    return q, kl, vl, keys, kmask, pos


def _use_shape(monkeypatch, spec: str) -> None:
    """The kernel's shape for this test (MIDLAYER_ROW_ATTENTION's form); the module's own is restored after it."""
    import midlayer.ops.row_attention as ra

    for name in ("BLOCK_POSITIONS", "CHUNK", "WARPS", "ROWS", "TENSOR_CORES", "SHARED"):
        monkeypatch.setattr(ra, name, getattr(ra, name))
    ra.set_shape(ra.parse_shape(spec))


@pytest.mark.parametrize("H,Hk,d", [(4, 2, 16), (9, 3, 24), (4, 4, 32)], ids=["gqa", "rep3-d24", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_is_the_naive_formula(H, Hk, d, dtype):
    """softmax(q k^T / sqrt(d) + mask) v over each row's keys in position order, in fp32 from the operands'
    values (bf16 operands are exact in fp32), against the formula in fp64; GQA with a power-of-two and a
    non-power-of-two group, a head size that is not a power of two, and plain multi-head attention."""
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(H, Hk, d, dtype))
    out = row_attention(q, kl, vl, keys, kmask, pos)
    assert out.dtype == torch.float32 and out.shape == (1, 6, H, d)
    torch.testing.assert_close(out.double(), reference(q, kl, vl, keys, kmask), atol=2e-6, rtol=2e-6)


def test_large_scores_seen_or_hidden_are_the_formula():
    """Scores of a few hundred (q x 40): every exp has its max subtracted, pass 1's and the chunks' combine's,
    or fp32 overflows to inf / inf. Keys the rows do not see (positions 100..109, masked), scaled by 1e4: their
    huge scores stay out of the running max, or every visible weight underflows to 0 and the row is 0 / 0.
    (Two survivors of the 59th session's mutation review; the other tests' scores are a few units.)"""
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(4, 2, 16, torch.float32))
    loud = row_attention(q * 40, kl, vl, keys, kmask, pos)
    assert torch.isfinite(loud).all()
    torch.testing.assert_close(loud.double(), reference(q * 40, kl, vl, keys, kmask), atol=1e-4, rtol=1e-4)
    kl, kmask = kl.clone(), kmask.clone()
    kl[:, :, 100:110] *= 1e4
    kmask[:, :4, 100:110] = float("-inf")
    hidden = row_attention(q, kl, vl, keys, kmask, pos)
    torch.testing.assert_close(hidden.double(), reference(q, kl, vl, keys, kmask), atol=2e-6, rtol=2e-6)


def test_a_row_at_the_caches_last_positions_reads_nothing_past_its_own_keys():
    """A cache of 180 slots, not a multiple of the chunk: the rows at positions 176..179 read the chunk from
    128 on, whose positions from 180 lie past their keys (the next row's, in memory). Only keys up to the row's
    own position enter (a mutant bounding the chunk at its end instead gave row 179 an error of 2e-2)."""
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(4, 2, 16, torch.float32, at=176))
    out = row_attention(q, kl, vl, keys, kmask, pos)
    torch.testing.assert_close(out.double(), reference(q, kl, vl, keys, kmask), atol=2e-6, rtol=2e-6)


def test_a_bf16_output_is_the_fp32_result_rounded_once():
    """Stored in bf16 (the step's output when the probe's tap is off), the result is the fp32 result as
    PyTorch's cast rounds it (to nearest even), bit for bit: the probe's fp32 tap and generation agree."""
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(9, 3, 24, torch.bfloat16))
    out = row_attention(q, kl, vl, keys, kmask, pos, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, row_attention(q, kl, vl, keys, kmask, pos).to(torch.bfloat16))


def test_a_rows_bits_depend_on_no_other_row():
    """A row's result, bit for bit, is the same alone, in a larger forward at another place beside other rows,
    and with its keys at other slots (plain decoding's adjacent slots against a tree's)."""
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(4, 2, 16, torch.float32))
    row = 3  # the branch's deepest row: position 129, its last 4 keys at slots 150..153
    alone = row_attention(q[:, :, row:row + 1], kl, vl, keys[:, row:row + 1], kmask[:, row:row + 1],
                          pos[:, row:row + 1])[0, 0]
    order = [5, 1, 3, 0, 2, 4]  # (the row at place 2 of 6, other rows around it)
    mixed = row_attention(q[:, :, order], kl, vl, keys[:, order], kmask[:, order], pos[:, order])[0, 2]
    assert torch.equal(alone, mixed)
    # plain decoding's layout: the same keys and values at slots 126..129 (slot = position)
    kl2, vl2 = kl.clone(), vl.clone()
    kl2[:, :, 126:130], vl2[:, :, 126:130] = kl[:, :, 150:154], vl[:, :, 150:154]
    plain = torch.arange(180, device=DEV).view(1, 1, 180)
    moved = row_attention(q[:, :, row:row + 1], kl2, vl2, plain, kmask[:, row:row + 1], pos[:, row:row + 1])[0, 0]
    assert torch.equal(alone, moved)


def test_operands_in_any_strides_give_the_same_bits():
    """Positions, keys and the mask as views (a broadcast: one row's value for every row, stride 0; a slice of a
    wider buffer) give the bits of the same values laid out densely: the kernel is handed dense positions (EAGLE's
    draft layer passes one position, broadcast to its rows: read as dense, every row but the first took memory past
    it, 0.3 apart from the formula)."""
    q, kl, vl, keys, kmask, _ = (t.to(DEV) for t in _case(4, 2, 16, torch.float32, N=3))
    pos = torch.tensor(128, device=DEV).expand(1, 3)  # every row at one position (stride 0)
    dense = row_attention(q, kl, vl, keys.contiguous(), kmask.contiguous(), pos.contiguous())
    wide = torch.zeros(1, 3, 2 * keys.shape[2], dtype=keys.dtype, device=DEV)
    wide[..., :keys.shape[2]] = keys
    assert torch.equal(row_attention(q, kl, vl, wide[..., :keys.shape[2]], kmask, pos), dense)
    torch.testing.assert_close(dense.double(), reference(q, kl, vl, keys, kmask), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("shape", ["32x64x4", "16x32x4x4", "32x64x4x2t", "16x32x4x4g"])
def test_committed_text_is_read_at_its_own_slots_with_the_same_bits(shape, monkeypatch):
    """Given the committed text's end (`start`: 126 here, the branch's root), a row at or past it reads the
    positions before it at their own slots without loading `keys` there: the same slots, so the same bits as
    through `keys`, and the formula. Padding rows (at position 0, before it) see the scratch slot through `keys`
    as the step's do (a kernel that took slot 0 for them too would give them other values). With rows a program,
    a program of rows all past it (rows 0..3) loads each block before it once for them all (SHARED), or, with
    "g", each row its own: the same values."""
    _use_shape(monkeypatch, shape)
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(4, 2, 16, torch.float32))
    keys[0, 4:, 0] = keys.shape[2] - 1  # (the padding rows' scratch slot)
    want = reference(q, kl, vl, keys, kmask)
    through_keys = row_attention(q, kl, vl, keys, kmask, pos)
    direct = row_attention(q, kl, vl, keys, kmask, pos, start=torch.tensor(126, device=DEV))
    assert torch.equal(direct, through_keys)
    torch.testing.assert_close(direct.double(), want, atol=2e-6, rtol=2e-6)
    # two sequences of two rows each: a program of 4 rows holds both, whose committed texts differ
    two = [[t[:, :2] for t in (keys, kmask, pos)] for _ in range(2)]
    q2 = torch.cat([q[:, :, :2], _case(4, 2, 16, torch.float32, seed=1)[0].to(DEV)[:, :, :2]])
    kl2, vl2 = (torch.cat([t, torch.randn_like(t)]) for t in (kl, vl))
    keys2, kmask2, pos2 = (torch.cat([a, b]) for a, b in zip(*two))
    direct = row_attention(q2, kl2, vl2, keys2, kmask2, pos2, start=torch.tensor(126, device=DEV))
    assert torch.equal(direct, row_attention(q2, kl2, vl2, keys2, kmask2, pos2))
    torch.testing.assert_close(direct.double(), reference(q2, kl2, vl2, keys2, kmask2), atol=2e-6, rtol=2e-6)


@on_cpu
def test_the_step_gives_the_kernel_its_committed_texts_end(model, monkeypatch):
    """`DecodeStep.attend` passes the forward's start to the kernel (the committed text read at its own
    slots): a plain step at position 5 after a prompt of 5 tokens, a prefill chunk from 0."""
    seen = []
    real = decode_step.row_attention.row_attention

    def spy(*a, **k):
        seen.append(int(k["start"]))
        return real(*a, **k)

    monkeypatch.setattr(decode_step.row_attention, "row_attention", spy)
    st = decode_step.DecodeStep(model, max_len=16, buckets=(8,), attention="triton")
    st.prefill(torch.tensor([[1, 2, 3, 4, 5]]))
    st.decode(torch.tensor([6]), 5)
    L = DIMS["n_layers"]
    assert seen == [0] * L + [5] * L


@pytest.mark.parametrize("shape", ["16x32x2", "64x128x8", "8x256x4", "16x32x4x4", "32x64x4x1", "64x128x8x8t",
                                   "32x64x4x2"])
def test_every_shape_of_the_kernel_is_the_formula_and_keeps_a_rows_bits(shape, monkeypatch):
    """The kernel's shape (positions per block, per program, warps, rows a program: MIDLAYER_ROW_ATTENTION, which
    the device sweep chooses) changes which program sums which positions and how, not what is summed: at each, the
    formula to 2e-6 (at 126..129 the rows' keys span 4, 1 and 1 programs), and a row's bits the same alone and
    among others. With rows a program (`_attend_rows`, tl.dot) the 6 rows fill 6, 3, 2 and 1 blocks of them,
    padding at position 0 beside rows at 126..129: a row's blocks past its own position are another's."""
    _use_shape(monkeypatch, shape)
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(4, 2, 16, torch.float32))
    out = row_attention(q, kl, vl, keys, kmask, pos)
    torch.testing.assert_close(out.double(), reference(q, kl, vl, keys, kmask), atol=2e-6, rtol=2e-6)
    order = [5, 1, 3, 0, 2, 4]
    mixed = row_attention(q[:, :, order], kl, vl, keys[:, order], kmask[:, order], pos[:, order])
    assert torch.equal(mixed, out[:, order])
    alone = row_attention(q[:, :, 3:4], kl, vl, keys[:, 3:4], kmask[:, 3:4], pos[:, 3:4])
    assert torch.equal(alone[0, 0], out[0, 3])


def test_tensor_cores_serve_a_bf16_model_and_an_fp32_one_stays_in_ieee_fp32(monkeypatch):
    """A "t" shape (rows a program in tensor cores) launches the kernel with tf32x3 for bf16 operands and IEEE fp32
    for fp32 ones: the fp32 recipe we are measured against computes at PyTorch's default fp32 precision. (The
    interpreter ignores the precision, so the launch's argument is what is checked.)"""
    from midlayer.ops import row_attention as ra
    from midlayer.ops import triton_build

    made, seen = triton_build.kernel, []

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["PREC"])
                return self.kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(triton_build, "kernel", lambda fn: Recorded(made(fn)) if fn is ra._attend_rows else made(fn))
    for spec, dtype in (("32x64x4x4t", torch.float32), ("32x64x4x4t", torch.bfloat16), ("32x64x4x4", torch.bfloat16)):
        _use_shape(monkeypatch, spec)
        q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(4, 2, 16, dtype))
        row_attention(q, kl, vl, keys, kmask, pos)
    assert seen == ["ieee", "tf32x3", "ieee"]


def test_the_kernels_shape_is_read_from_the_environment_and_a_bad_one_refused():
    """MIDLAYER_ROW_ATTENTION="BSxCHUNKxWARPS" sets the shape when the module is imported; a malformed one, or
    one that is not powers of two with 8 <= BS <= CHUNK, is refused by the first launch with the form it wants,
    not at import (which every command does)."""
    import subprocess
    import sys

    import midlayer.ops.row_attention as ra
    from midlayer.ops.row_attention import parse_shape

    assert parse_shape("16x128x8") == (16, 128, 8, 0, False, True)
    assert parse_shape(" 32x64x4x8") == (32, 64, 4, 8, False, True)
    assert parse_shape("32x64x4x8t") == (32, 64, 4, 8, True, True)
    assert parse_shape("32x64x4x8g") == (32, 64, 4, 8, False, False)
    assert parse_shape("32x64x4x8tg") == (32, 64, 4, 8, True, False)
    for spec in ("32x64x4", "32x64x4x8", "32x64x4x8t", "32x64x4x8g", "32x64x4x8tg"):
        assert ra.format_shape(parse_shape(spec)) == spec
    for bad in ("16x128", "24x64x4", "128x64x4", "4x64x4", "16x64x32", "axbxc", "8x64x4x4", "32x64x4x32",
                "32x64x4x3", "32x64x4x4x1", "32x64x4t", "32x64x4x8tt", "32x64x4g", "32x64x4x8gt", "32x64x4x8gg"):
        with pytest.raises(ValueError, match="row attention"):
            parse_shape(bad)
    show = ("from midlayer.ops import row_attention as r; "
            "print(r.BLOCK_POSITIONS, r.CHUNK, r.WARPS, r.ROWS, r.TENSOR_CORES, r.SHARED); import torch; "
            "q = torch.zeros(1, 2, 1, 4); kv = torch.zeros(1, 1, 8, 4); keys = torch.arange(8).view(1, 1, 8); "
            "m = torch.zeros(1, 1, 8); r.row_attention(q, kv, kv, keys, m, torch.tensor([[7]]))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    for spec, want in (("16x32x2", ["16", "32", "2", "0", "False", "True"]),
                       ("16x32x2x4tg", ["16", "32", "2", "4", "True", "False"])):
        got = subprocess.run([sys.executable, "-c", show], env={**env, "MIDLAYER_ROW_ATTENTION": spec},
                             capture_output=True, text=True, timeout=120)
        assert got.returncode == 0 and got.stdout.split() == want, got.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", show], env={**env, "MIDLAYER_ROW_ATTENTION": "64x32x4"},
                         capture_output=True, text=True, timeout=120)
    assert bad.stdout.split() == ["32", "64", "4", "0", "False", "True"]  # (imported: the defaults)
    assert "ValueError: MIDLAYER_ROW_ATTENTION: row attention: '64x32x4'" in bad.stderr


def test_the_attention_sweep_keeps_the_fastest_shape_that_gives_the_defaults_values(tmp_path, monkeypatch, capsys):
    """benchmarks/triton_kernels.py --attention (what scripts/static_check.sh runs the check and bench at), with a
    faked device clock: the shape with the least time relative to the default's, averaged over dtypes and row
    counts, is written (as MIDLAYER_ROW_ATTENTION's value); a faster shape whose output is off the default's is
    not taken, one that fails is passed over; the module's shape is left as it was."""
    import midlayer.ops.row_attention as ra

    tk = benchmark("triton_kernels")
    # relative times by shape and row count (1 where not given); 16x32x4 is fastest but its output is 1% off, and
    # 32x64x4x4 gives row 0 a unit in the last place more with 8 rows than alone (within fp32's rounding of the
    # default's values, but not row-invariant)
    times = {"16x64x4": {1: 0.7, 8: 1.2}, "64x64x8": {1: 0.9, 8: 0.8}, "16x32x4": {1: 0.5, 8: 0.5},
             "32x64x4x8t": {1: 1.1, 8: 0.5}, "32x64x4x4": {1: 0.3, 8: 0.3}}
    off, moved = "16x32x4", "32x64x4x4"
    now = lambda: ra.format_shape(ra.shape())  # noqa: E731
    last = []

    def call(n):
        last[:] = [n]
        if now() == "32x128x4":
            raise RuntimeError("out of resources")  # (a shape that fails to build there: passed over)
        out = torch.full((1, n, 2), 1.01 if now() == off else 1.0)
        if now() == moved and n == 8:
            out[0, 0, 1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
        return out

    monkeypatch.setattr(tk, "attention_call", lambda dev, dtype, n: lambda n=n: call(n))
    monkeypatch.setattr(tk, "device_us", lambda fn: (fn(), 10.0 * times.get(now(), {}).get(last[0], 1.0))[1])
    before = ra.shape()
    out = tmp_path / "attention.txt"
    ahead = []  # (with workers, the shapes after the default are compiled ahead first: test_the_sweeps_shapes_...)
    monkeypatch.setattr(tk, "compile_ahead", lambda dev, dtypes, rows, shapes, workers, limit: ahead.append(
        (shapes, workers, limit, len(capsys.readouterr().out))))
    tk.sweep_attention(torch.device("cpu"), ["fp32"], [1, 8], str(out), workers=8)
    assert ahead == [(list(tk.ATTENTION_CANDIDATES[1:]), 8, 40.0, 0)]  # (before the table's first line)
    # 16x64x4: (0.7 + 1.2) / 2 = 0.95; 64x64x8: 0.85; 8 rows a program in tensor cores: 0.8, the least taken
    assert out.read_text() == "32x64x4x8t" and ra.parse_shape(out.read_text()) == (32, 64, 4, 8, True, True)
    assert ra.shape() == before
    printed = capsys.readouterr().out
    assert "| 16x32x4 |" in printed and printed.count("not taken") == 2
    assert "| 32x64x4x4 | 3.0 | 3.0 | 0.30 (row 0's bits differ at fp32 8 rows: not taken) |" in printed
    assert "MIDLAYER_ROW_ATTENTION=32x64x4x8t" in printed
    assert "| 32x128x4 | failed: RuntimeError: out of resources |" in printed


def test_the_sweeps_shapes_are_compiled_ahead_in_shares_and_a_late_helper_is_stopped(monkeypatch, capsys):
    """--workers: the shapes after the default go to that many helper processes, round robin, each a share in
    MIDLAYER_ROW_ATTENTION's form (`compile_ahead`); a helper still at work when the time is up is killed. A
    helper (--warm-attention) makes each of its shapes' calls once, passes over one that fails, and leaves the
    module's shape as it was."""
    import subprocess

    import midlayer.ops.row_attention as ra

    tk = benchmark("triton_kernels")
    started, killed = [], []

    class Helper:
        def __init__(self, cmd, **kw):
            self.share = cmd[cmd.index("--warm-attention") + 1]
            started.append(self)

        def wait(self, timeout=None):
            if self.share.split(",")[0] == ra.format_shape(shapes[1]) and timeout is not None:  # (helper 1: late)
                raise subprocess.TimeoutExpired("helper", timeout)

        def kill(self):
            killed.append(self.share)

    monkeypatch.setattr(tk.subprocess, "Popen", Helper)
    shapes = list(tk.ATTENTION_CANDIDATES[1:])
    tk.compile_ahead(torch.device("cpu"), ["fp32", "bf16"], [1, 128], shapes, 8, 1.0)
    shares = [h.share.split(",") for h in started]
    assert len(shares) == 8
    assert sorted(ra.parse_shape(x) for sh in shares for x in sh) == sorted(shapes)
    assert shares[1][:2] == [ra.format_shape(shapes[1]), ra.format_shape(shapes[9])]  # (round robin)
    assert killed == [started[1].share]
    made = []

    def call(n):
        if ra.shape()[3] == 2:
            raise RuntimeError("out of resources")
        made.append((ra.format_shape(ra.shape()), n))

    monkeypatch.setattr(tk, "attention_call", lambda dev, dtype, n: lambda: call(n))
    before = ra.shape()
    tk.warm_attention(torch.device("cpu"), ["fp32"], [1, 128], [ra.parse_shape(x) for x in ("32x64x4x2t",
                                                                                              "16x64x4x8t")])
    assert made == [("16x64x4x8t", 1), ("16x64x4x8t", 128)] and ra.shape() == before
    monkeypatch.setattr("sys.argv", ["triton_kernels.py", "--device", "cpu", "--warm-attention", "32x64x4,32x64"])
    with pytest.raises(SystemExit) as exit_:  # (a malformed share: one line naming the flag, exit 2, nothing made)
        tk.main()
    assert exit_.value.code == 2 and made == [("16x64x4x8t", 1), ("16x64x4x8t", 128)]
    assert "--warm-attention: row attention: '32x64' is not BSxCHUNKxWARPS" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [0, 4], ids=["row", "rows4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_launch_gives_the_bits_of_two_and_leaves_its_counters_zero(dtype, rows, monkeypatch):
    """Pass 2 inside pass 1's launch (the row's last chunk to count combines) gives the bits of the two
    launches, for rows whose keys span one chunk, two and three, and padding rows; the counters it is handed
    are zero again after it, so a step's one buffer serves every launch (a second launch: the same bits).
    Counters too few or not int32 are refused. With 4 rows a program, the block's last chunk to count combines
    its 4 rows, which span 1 to 3 chunks each."""
    from midlayer.ops import row_attention as ra

    monkeypatch.setattr(ra, "ROWS", rows)
    q, kl, vl, keys, kmask, pos = (t.to(DEV) for t in _case(9, 3, 24, dtype, N=8, S=200, at=62))
    pos[0, 4:7] = torch.tensor([3, 140, 0])  # (one chunk, three; the rest padding at 0)
    kmask[0, 4:7] = torch.where(torch.arange(200, device=DEV) <= pos[0, 4:7, None], 0.0, float("-inf"))
    counts = torch.zeros(8 * 3, dtype=torch.int32, device=DEV)
    one = row_attention(q, kl, vl, keys, kmask, pos, dtype=dtype, counts=counts)
    assert not counts.any()
    assert torch.equal(row_attention(q, kl, vl, keys, kmask, pos, dtype=dtype, counts=counts), one)
    monkeypatch.setattr(ra, "ONE_PASS", False)
    assert torch.equal(row_attention(q, kl, vl, keys, kmask, pos, dtype=dtype), one)
    monkeypatch.setattr(ra, "ONE_PASS", True)
    for bad in (torch.zeros(8 * 3 - 1, dtype=torch.int32), torch.zeros(8 * 3, dtype=torch.long)):
        with pytest.raises(ValueError, match="counts"):
            row_attention(q, kl, vl, keys, kmask, pos, counts=bad.to(DEV))


def test_the_self_check_falls_back_to_two_launches_where_one_is_off(monkeypatch):
    """The self-check runs both ways. Where the one launch is off the formula and the two are not (the
    counters' memory ordering on a GPU, which this CPU cannot show; here one launch's result made 1% off), it
    warns and the kernel runs in two launches from then on; the check then reports the two launches' error. Where
    both are right, nothing changes."""
    from midlayer.ops import row_attention as ra

    assert ra.ONE_PASS and ra.self_check(DEV, torch.float32) < 1e-5 and ra.ONE_PASS
    real = ra.row_attention
    monkeypatch.setattr(ra, "row_attention", lambda *a, **kw: real(*a, **kw) * (1.01 if ra.ONE_PASS else 1.0))
    monkeypatch.setattr(ra, "ONE_PASS", True)  # (restored after the test)
    with pytest.warns(UserWarning, match="two launches"):
        assert ra.self_check(DEV, torch.float32) < 1e-5
    assert not ra.ONE_PASS


def test_the_keys_by_hand():
    """Each row's keys in position order and its mask (`reference_keys`, and its kernel), worked by hand: 4
    committed slots of which slot 2 is not held (a rejected draft's), a root row at position 4 in slot 6, its
    child at position 5 in slot 7, and a padding row, which sees the scratch slot (8) alone."""
    held = torch.tensor([[True, True, False, True, False, True, False, False, False]])
    path_slots = torch.tensor([[[6, -1], [6, 7], [-1, -1]]])
    depth, real = torch.tensor([0, 1, 0]), torch.tensor([True, True, False])
    inf = float("-inf")
    want_keys = torch.tensor([[[0, 1, 2, 3, 6, 5, 6, 7, 8], [0, 1, 2, 3, 6, 7, 6, 7, 8], [8, 1, 2, 3, 4, 5, 6, 7, 8]]])
    want_mask = torch.tensor([[[0, 0, inf, 0, 0, inf, inf, inf, inf], [0, 0, inf, 0, 0, 0, inf, inf, inf],
                               [0] + [inf] * 8]])
    for keys_of in (reference_keys, row_keys):
        keys, kmask = keys_of(*(t.to(DEV) for t in (path_slots, depth, real, held, torch.tensor(4))), 8)
        assert torch.equal(keys.cpu(), want_keys) and torch.equal(kmask.cpu(), want_mask), keys_of.__name__


@pytest.mark.parametrize("B,N,Wp,S", [(1, 8, 8, 40), (2, 5, 6, 1100)], ids=["one-block", "two-blocks"])
def test_the_keys_kernel_is_the_formula(B, N, Wp, S):
    """The keys' kernel gives `reference_keys`' very values on random operands: slots -1 on paths, padding
    rows, unheld slots, `start` at 0, inside and at the end; S past one program's 1024 positions."""
    g = torch.Generator().manual_seed(S)
    path_slots = torch.randint(-1, S, (B, N, Wp), generator=g)
    depth, real = torch.randint(0, Wp, (N,), generator=g), torch.rand(N, generator=g) > 0.3
    held = torch.rand(B, S, generator=g) > 0.2
    for start in (0, 3, S - Wp):
        args = [t.to(DEV) for t in (path_slots, depth, real, held, torch.tensor(start))]
        keys, kmask = row_keys(*args, S - 1)
        want_keys, want_mask = reference_keys(*args, S - 1)
        assert torch.equal(keys, want_keys) and torch.equal(kmask, want_mask)
        assert 0 < int((kmask == 0).sum()) < kmask.numel()  # (both kinds of position present)


@pytest.fixture(scope="module")
def model():
    return compress_weights(make_tiny(DIMS, False), "fp32")


@on_cpu
def test_the_probe_tries_the_kernel_first_and_passes_over_a_failure(model, monkeypatch):
    """Where the kernel is tried (CUDA with Triton), its candidates come first; a kernel that fails to build,
    or that computes something else than the formula (which the probe, comparing bits across buckets, would
    not see), is passed over with a warning, and the step attends in PyTorch ops. (On this CPU the kernel is
    tried by pretending; the failures are stand-ins. On RowWiseBLAS with a lone row rounded otherwise, as the
    CPU's fp32 GEMV does: the buckets (8, 16) in PyTorch ops are then row-invariant on every CPU.)"""
    RowWiseBLAS(lone_row=True).install(monkeypatch)
    m = copy.deepcopy(model)
    monkeypatch.setattr(decode_step, "triton_kernels", lambda mdl: True)
    # (STEP_CANDIDATES' order on smaller buckets: the interpreter is slow)
    K = decode_step.StepKernels
    monkeypatch.setattr(decode_step, "STEP_CANDIDATES", (K((1, 8, 16), attention="triton"),
                                                         K((8, 16), attention="triton"), K((8, 16))))
    (buckets, rows, attention, linear), ok = invariant_buckets(m, 40)
    assert ok and attention == "triton" and buckets == (8, 16)  # (the fp32 GEMV at one row differs)

    def broken(*a, **k):
        raise RuntimeError("no kernel here")

    def wrong(*a, **k):  # row-invariant, so the probe alone would pass it, but not the formula
        return real(*a, **k) * 1.01

    real = decode_step.row_attention.row_attention
    for stand_in, why in ((broken, "no kernel here"), (wrong, "from the formula")):
        m2 = copy.deepcopy(model)
        monkeypatch.setattr(decode_step.row_attention, "row_attention", stand_in)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert invariant_buckets(m2, 40) == (K((8, 16)), True)
        assert any("row-attention kernel failed" in str(w.message) and why in str(w.message) for w in caught)


@on_cpu
def test_the_kernels_are_refused_for_a_model_in_another_dtype(model):
    """The Triton kernels store fp32 or bf16: an fp16 model asking for them is refused by name at the step's
    construction (the probe, whose tap reads fp32, would have passed it and generation then failed)."""
    half = copy.deepcopy(model).half()
    for kw in (dict(attention="triton"), dict(linear="triton")):
        with pytest.raises(ValueError, match="runs fp32 or bf16 models, not torch.float16"):
            decode_step.DecodeStep(half, max_len=16, buckets=(8,), **kw)

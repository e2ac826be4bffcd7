"""The static step's Triton kernels on a device, one by one, against the PyTorch ops they replace (issue 42;
docs/results/static-step.md): each kernel family's self-check (its value against the formula, the check the
step's probe runs first), then the device time of one call at SmolLM2-135M's shapes for a few row counts,
each side captured in a CUDA graph of REPS calls (so no host time is counted), both in one run. The
attention kernel is set beside SDPA over the same keys, the recipe's attention (not the step's own PyTorch
attention, which also gathers keys into position order). On a CPU (Triton's interpreter) it runs the
self-checks alone: a dry run.

With --tiles FILE it times instead the row-linear kernel's tiles (`row_linear.TILES`) at each of the step's
weight shapes, each through the call the step makes (the norm and SwiGLU prologues, the RoPE epilogue), and
keeps for each shape the tile with the least time relative to the default tile's, summed over the dtypes and
row counts; FILE gets their MIDLAYER_ROW_TILES value (written after each shape: a run cut short keeps what it
measured). scripts/static_check.sh runs the step's bench at it.

With --attention FILE it times the row-attention kernel's shapes (`row_attention.parse_shape`: positions per
block, per program, warps, and rows a program by tl.dot) over 512 slots for the given row counts, and keeps the
shape with the least time relative to the default's (FILE: its MIDLAYER_ROW_ATTENTION value, rewritten after
each shape).

    python benchmarks/triton_kernels.py [--device cuda] [--dtypes fp32,bf16] [--rows 1,8,64] [--tiles FILE]
        [--attention FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported: the self-checks on a CPU)

import torch.nn.functional as F  # noqa: E402

from midlayer.engine.decode_step import ROUNDING  # noqa: E402
from midlayer.model.layers import RMSNorm  # noqa: E402
from midlayer.ops import acceptance, fused_rows, row_attention, row_linear, tree_layout  # noqa: E402

REPS = 50
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# SmolLM2-135M: dim 576, 9 heads of 64 over 3 kv heads, FFN 1536, vocabulary 49152
DIM, H, HK, HD, FFN, VOCAB = 576, 9, 3, 64, 1536, 49152
# its linears (K, N): q|k|v, o, w1|w3, w2, the head
LINEARS = ((DIM, (H + 2 * HK) * HD), (DIM, DIM), (DIM, 2 * FFN), (FFN, DIM), (DIM, VOCAB))


def device_us(fn, reps: int = REPS) -> float:
    """Device microseconds of one fn() call: reps calls captured in one CUDA graph, the best of 5 replays."""
    fn()  # (Triton's compile, cuBLAS's choice)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


def cases(dev: torch.device, dtype: torch.dtype, n: int) -> list[tuple[str, object, object]]:
    """(name, the kernel's call, the PyTorch ops' call) at SmolLM2's shapes for n rows."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dev, dt)

    out = []
    for k, m in LINEARS:
        x, w = rand(n, k), rand(m, k) / math.sqrt(k)
        out.append((f"linear {k}->{m}", lambda x=x, w=w: row_linear.row_linear(x, w), lambda x=x, w=w: F.linear(x, w)))
    norm = RMSNorm(DIM, 1e-5).to(dev, dtype)
    x, a = rand(1, n, DIM), rand(1, n, DIM)
    out.append(("rms_norm", lambda: fused_rows.rms_norm(x, norm.weight, norm.eps), lambda: norm(x)))
    out.append(("add_rms_norm", lambda: fused_rows.add_rms_norm(x, a, norm.weight, norm.eps),
                lambda: norm(x + a)))
    ab = rand(1, n, 2 * FFN)
    out.append(("silu_mul", lambda: fused_rows.silu_mul(ab), lambda: F.silu(ab[..., :FFN]) * ab[..., FFN:]))
    w2 = rand(DIM, FFN) / math.sqrt(FFN)  # (the FFN's down projection with SwiGLU's product as its prologue,
    # against the SwiGLU kernel and cuBLAS: what the step runs where its linears are cuBLAS's)
    out.append((f"swiglu_linear {FFN}->{DIM} | silu_mul + linear", lambda: row_linear.swiglu_linear(ab, w2),
                lambda: F.linear(fused_rows.silu_mul(ab), w2)))
    S = 400
    qkv = rand(1, n, H + 2 * HK, HD)
    cos, sin = rand(1, n, HD, dt=torch.float32), rand(1, n, HD, dt=torch.float32)
    kc, vc = rand(1, HK, S, HD), rand(1, HK, S, HD)
    slots = torch.arange(300, 300 + n, device=dev)[None]
    out.append(("rope_store", lambda: fused_rows.rope_store(qkv, cos, sin, H, kc, vc, slots),
                lambda: fused_rows.reference_rope_store(qkv, cos, sin, H, kc, vc, slots)))
    # the attention's norm, q|k|v, RoPE and the K/V store as one kernel, against the norm's kernel and RoPE's
    wqkv = rand((H + 2 * HK) * HD, DIM) / math.sqrt(DIM)
    rope = fused_rows.RopeStore(cos, sin, H, kc, vc, slots)
    out.append(("norm_linear + RoPE epilogue | norm_linear + rope_store",
                lambda: row_linear.norm_linear(x, a, norm.weight, norm.eps, wqkv, rope=rope),
                lambda: fused_rows.rope_store(row_linear.norm_linear(x, a, norm.weight, norm.eps, wqkv)[1].view(
                    1, n, H + 2 * HK, HD), cos, sin, H, kc, vc, slots)))
    q = rand(1, n, H, HD).transpose(1, 2)
    pos, keys, kmask, counts, first = attention_operands(dev, n, S)
    mask = kmask[:, None].to(dtype)
    out.append((f"row_attention ({S} slots) | SDPA",
                lambda: row_attention.row_attention(q, kc, vc, keys, kmask, pos, dtype=dtype, counts=counts,
                                                    start=first),
                lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)))
    out.append((f"row_attention ({S} slots): one launch | two",
                lambda: row_attention.row_attention(q, kc, vc, keys, kmask, pos, dtype=dtype, counts=counts,
                                                    start=first),
                lambda: _two_launches(q, kc, vc, keys, kmask, pos, dtype, first)))
    # the forward's keys and a round's acceptance (integers: the same at every dtype): n rows of a chain at
    # slots 300.. after 300 committed ones, every draft accepted
    i = torch.arange(n, device=dev)
    chain = i[None, :] <= i[:, None]  # row r sees rows 0..r
    path_slots = torch.where(chain, 300 + i[None, :], -1)[None]
    held, start, real = (torch.arange(S, device=dev) < 300)[None], torch.tensor(300, device=dev), i >= 0
    out.append((f"row_keys ({S} slots)", lambda: row_attention.row_keys(path_slots, i, real, held, start, S - 1),
                lambda: row_attention.reference_keys(path_slots, i, real, held, start, S - 1)))
    tok = torch.randint(0, VOCAB, (n,), generator=g).to(dev)
    tree = (tok, torch.cat([tok[1:], tok[:1]]), (i - 1).clamp_min(0), i > 0, chain, i, torch.where(chain, i[None], -1),
            300 + i, start)
    out.append(("accept (a chain, all accepted)", lambda: acceptance.accept(*tree),
                lambda: acceptance.reference(*tree)))
    # EAGLE-2's reranking and layout: min(n, 63) rows from 136 candidates (as many as k = 8 and 3 depths make),
    # here random scores, 8 at depth 1 and 128 under them: two depths (integers but the scores: the same at
    # every dtype)
    m = min(n, 63)
    cand = (torch.randn(136, generator=g).to(dev), torch.randint(0, VOCAB, (136,), generator=g).to(dev),
            torch.cat([torch.full((8,), -1), torch.randint(0, 8, (128,), generator=g)]).to(dev),
            torch.cat([torch.ones(8, dtype=torch.long), torch.full((128,), 2)]).to(dev))
    out.append(("tree rows (EAGLE-2: n of 136)", lambda: tree_layout.rows(*cand, m, m + 1),
                lambda: tree_layout.reference_rows(*cand, m, m + 1)))
    _, parent, depth = tree_layout.reference_rows(*cand, m, m + 1)
    real = torch.arange(m + 1, device=dev) <= m
    out.append(("tree layout", lambda: tree_layout.layout(parent, depth, real, 2),
                lambda: tree_layout.reference(parent, depth, real, 2)))
    return out


# the tiles (BN, BK) tried, the default first
TILE_CANDIDATES = ((row_linear.BN, row_linear.BK), (16, 64), (16, 128), (16, 256), (32, 128), (64, 64))


def tile_calls(dev: torch.device, dtype: torch.dtype, n: int) -> dict[tuple[int, int], tuple[str, object]]:
    """For each row-linear weight shape (N, K) of the step: (name, the step's call at that shape for n rows)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dev, dt)

    x, a, ab = rand(1, n, DIM), rand(1, n, DIM), rand(1, n, 2 * FFN)
    nw = 1 + 0.1 * rand(DIM)
    wqkv, wo, w13, w2, head = (rand(m, k) / math.sqrt(k) for k, m in LINEARS)
    S = 400
    rope = fused_rows.RopeStore(rand(1, n, HD, dt=torch.float32), rand(1, n, HD, dt=torch.float32), H,
                                rand(1, HK, S, HD), rand(1, HK, S, HD), torch.arange(300, 300 + n, device=dev)[None])
    return {tuple(wqkv.shape): ("q|k|v: norm + RoPE epilogue", lambda: row_linear.norm_linear(
                x, a, nw, 1e-5, wqkv, rope=rope)),
            tuple(wo.shape): ("o", lambda: row_linear.row_linear(x, wo)),
            tuple(w13.shape): ("w1|w3: norm prologue", lambda: row_linear.norm_linear(x, a, nw, 1e-5, w13)),
            tuple(w2.shape): ("w2: SwiGLU prologue", lambda: row_linear.swiglu_linear(ab, w2)),
            tuple(head.shape): ("head", lambda: row_linear.row_linear(x, head))}


def sweep_tiles(dev: torch.device, dtypes: list[str], rows: list[int], path: str) -> None:
    """--tiles (module docstring): a table of each shape's tiles, and path's MIDLAYER_ROW_TILES value. A tile
    whose outputs are off the default tile's by more than its dtype's rounding (decode_step.ROUNDING, the
    probe's bound for the self-checks, which run at their own small shapes, not at these) is not taken."""
    print("\n| weight (N x K) | tile (BN x BK) | " + " | ".join(f"{d} {n} us" for d in dtypes for n in rows)
          + " | / default |\n|---|---|" + "---|" * (len(dtypes) * len(rows) + 1))
    calls = {(d, n): tile_calls(dev, DTYPES[d], n) for d in dtypes for n in rows}
    chosen, spec = {}, ""
    for shape in calls[dtypes[0], rows[0]]:
        name = calls[dtypes[0], rows[0]][shape][0]
        rel, us, want = {}, {}, {}
        kept = row_linear.TILES.get(shape)  # (a tile MIDLAYER_ROW_TILES or row_linear.MEASURED gave it)
        for t in TILE_CANDIDATES:
            row_linear.TILES[shape] = t
            with torch.no_grad():
                outs = {(d, n): calls[d, n][shape][1]() for d in dtypes for n in rows}
                want = want or outs  # (the first tile is the default)
                off = max(_off(outs[d, n], want[d, n]) / ROUNDING[DTYPES[d]] for d, n in outs)
                us[t] = [device_us(calls[d, n][shape][1]) for d in dtypes for n in rows]
            rel[t] = sum(u / u0 for u, u0 in zip(us[t], us[TILE_CANDIDATES[0]])) / len(us[t])
            print(f"| {shape[0]} x {shape[1]} ({name}) | {t[0]} x {t[1]} | " + " | ".join(f"{u:.1f}" for u in us[t])
                  + f" | {rel[t]:.2f}{'' if off <= 1 else f' (off the default by {off:.1f} roundings: not taken)'} |",
                  flush=True)
            if off > 1:
                del rel[t]
        del row_linear.TILES[shape]
        if kept is not None:
            row_linear.TILES[shape] = kept
        best = min(rel, key=rel.get)
        chosen[shape] = best  # (the default too: it must win over a MEASURED tile where the run sets these)
        spec = row_linear.format_tiles(chosen)
        with open(path, "w") as f:
            f.write(spec)
    print(f"\nMIDLAYER_ROW_TILES={spec}")


# the row-attention kernel's shapes (`row_attention.parse_shape`) tried, the default first, then rows a program by
# tl.dot, in tensor cores ("t") or FMAs (63rd session: not yet timed on a GPU; since the 64th the committed keys are
# loaded once for a program's rows, and the first two shapes are also tried with each row gathering its own, "g"),
# then one row a program. Each builds for sm_90 in bf16 and fp32 (tests/test_row_linear.py, and a one-off compile of
# these, 62nd to 64th sessions). A review's compile under Triton 3.6 (66th session) found register spills (a stack of
# 0.8-14 KB a thread at 4 and 8 rows a program), which the PTX's text does not show, and 32x64x4x8tg in fp32 taking
# 227 KiB of shared memory, the most an H100's or H200's block can have, besides 1 KiB of static shared memory: its
# launch may be refused, and the sweep then passes over it. A run cut short (ATTN_S) keeps the best of those it timed.
ATTENTION_CANDIDATES = tuple(row_attention.parse_shape(c) for c in (
    row_attention.format_shape(row_attention.shape()), "32x64x4x4t", "32x64x4x4tg", "32x64x4x8t", "32x64x4x8tg",
    "32x64x4x4", "32x64x4x8", "16x64x4x8t", "64x64x8x4t", "32x128x4x8t", "32x64x4x2t", "32x64x4x1t", "16x64x4",
    "64x64x4", "32x32x4", "32x64x8", "64x64x8", "16x32x4", "32x128x4", "64x128x4"))


def attention_operands(dev: torch.device, n: int, S: int) -> tuple[torch.Tensor, ...]:
    """What the step gives the attention kernel besides q, K and V, for n rows at positions 300.. (a chain, each
    seeing every position up to its own) after 300 committed ones, over S slots: (positions, keys, kmask, the
    counters, the committed text's end)."""
    pos = torch.arange(300, 300 + n, device=dev)[None]
    keys = torch.arange(S, device=dev).expand(1, n, S).contiguous()
    kmask = torch.where(torch.arange(S, device=dev)[None, None] <= pos[..., None], 0.0, float("-inf"))
    counts = torch.zeros(n * HK, dtype=torch.int32, device=dev)  # (the step's one buffer of counters)
    return pos, keys, kmask, counts, torch.tensor(300, device=dev)


def attention_call(dev: torch.device, dtype: torch.dtype, n: int, S: int = 512):
    """The step's attention call for n rows at positions 300.. (each seeing every position up to its own) over
    a cache layer of S slots, SmolLM2's heads: a plain step (n = 1) to a hidden-transfer round (n = 128)."""
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(1, HK, S, HD, generator=g).to(dev, dtype) for _ in range(2))
    q = torch.randn(1, n, H, HD, generator=g).to(dev, dtype).transpose(1, 2)  # (row 0 the same at every n)
    pos, keys, kmask, counts, first = attention_operands(dev, n, S)
    return lambda: row_attention.row_attention(q, kc, vc, keys, kmask, pos, dtype=dtype, counts=counts, start=first)


def warm_attention(dev: torch.device, dtypes: list[str], rows: list[int], shapes: list[tuple]) -> None:
    """Each shape's calls made once (Triton compiles a kernel at its first launch, into its cache on disk, which
    other processes then read), a shape that fails passed over; the module's shape is left as it was. What
    --warm-attention runs in each of the sweep's helper processes (`sweep_attention`'s workers)."""
    calls = [attention_call(dev, DTYPES[d], n) for d in dtypes for n in rows]
    saved = row_attention.shape()
    try:
        for shape in shapes:
            row_attention.set_shape(shape)
            try:
                with torch.no_grad():
                    for c in calls:
                        c()
            except Exception as e:  # (the sweep itself reports it)
                print(f"warm {row_attention.format_shape(shape)}: {type(e).__name__}", flush=True)
    finally:
        row_attention.set_shape(saved)


def compile_ahead(dev: torch.device, dtypes: list[str], rows: list[int], shapes: list[tuple], workers: int,
                  limit_s: float) -> None:
    """The shapes' kernels compiled in `workers` processes at once, each making a share of them (round robin,
    `warm_attention`), for at most limit_s seconds: the timed loop then finds them in Triton's cache. Why: a
    kernel of rows a program takes up to 9 s to compile (63rd session, on an Intel Xeon), two dtypes and two
    row counts a shape, and the sweep has ATTN_S (100 s) for 20 shapes; a GPU machine has 16 CPUs."""
    start = time.time()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--device", str(dev), "--dtypes",
                               ",".join(dtypes), "--rows", ",".join(map(str, rows)), "--warm-attention",
                               ",".join(row_attention.format_shape(sh) for sh in shapes[i::workers])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # (their failures: the sweep's)
             for i in range(min(workers, len(shapes)))]
    for pr in procs:
        try:
            pr.wait(timeout=max(limit_s - (time.time() - start), 0.1))
        except subprocess.TimeoutExpired:
            pr.kill()
            pr.wait()
    print(f"(compiled ahead in {len(procs)} processes: {time.time() - start:.0f} s)", flush=True)


def sweep_attention(dev: torch.device, dtypes: list[str], rows: list[int], path: str, workers: int = 0,
                    ahead_s: float = 40.0) -> None:
    """--attention (module docstring): a table of each shape's device time, and path's MIDLAYER_ROW_ATTENTION
    value. With workers (--workers), the shapes after the default are compiled first in that many processes at
    once (`compile_ahead`, at most ahead_s). A shape whose output is off the default's by more than its dtype's
    rounding is not taken, nor one that gives row 0 (the same query and keys at every row count) other bits in a
    call of other rows: the device's own word on a shape's row invariance, which the step's probe would otherwise
    first find, and then run the PyTorch attention. The module's shape is left as it was."""
    if workers > 1:
        compile_ahead(dev, dtypes, rows, list(ATTENTION_CANDIDATES[1:]), workers, ahead_s)
    print("\n| attention shape (BS x CHUNK x WARPS [x ROWS]) | "
          + " | ".join(f"{d} {n} us" for d in dtypes for n in rows) + " | / default |\n|---|"
          + "---|" * (len(dtypes) * len(rows) + 1))
    calls = {(d, n): attention_call(dev, DTYPES[d], n) for d in dtypes for n in rows}
    saved = row_attention.shape()
    rel, want, base = {}, {}, None
    try:
        for shape in ATTENTION_CANDIDATES:
            row_attention.set_shape(shape)
            name = row_attention.format_shape(shape)
            try:  # (a shape that fails to build or launch there is passed over; the default must not)
                with torch.no_grad():
                    outs = {k: c().clone() for k, c in calls.items()}
                    want = want or outs  # (the first shape is the default)
                    off = max(_off(outs[d, n], want[d, n]) / ROUNDING[DTYPES[d]] for d, n in outs)
                    moved = [f"{d} {n}" for d, n in outs if not torch.equal(outs[d, n][:, 0], outs[d, rows[0]][:, 0])]
                    us = [device_us(calls[d, n]) for d in dtypes for n in rows]
            except Exception as e:
                if base is None:
                    raise
                print(f"| {name} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)
                continue
            base = base or us
            r = sum(u / b for u, b in zip(us, base)) / len(us)
            why = (f" (off the default by {off:.1f} roundings: not taken)" if off > 1 else
                   f" (row 0's bits differ at {', '.join(moved)} rows: not taken)" if moved else "")
            print(f"| {name} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {r:.2f}{why} |", flush=True)
            if not why:
                rel[name] = r
                with open(path, "w") as f:
                    f.write(min(rel, key=rel.get))
    finally:
        row_attention.set_shape(saved)
    print(f"\nMIDLAYER_ROW_ATTENTION={min(rel, key=rel.get)}" if rel else "\nno shape taken: the default stays")


def _off(got, want) -> float:
    """The largest difference of a call's outputs (a tensor, or a tuple of them) from another's, relative to the
    other's largest magnitude."""
    got, want = (o if isinstance(o, tuple) else (o,) for o in (got, want))
    return max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
               for a, b in zip(got, want))


def _two_launches(*args) -> torch.Tensor:
    """row_attention with pass 2 as a launch of its own (ONE_PASS off for the call: a host-side choice, so a
    captured graph keeps the two launches)."""
    saved, row_attention.ONE_PASS = row_attention.ONE_PASS, False
    try:
        return row_attention.row_attention(*args[:6], dtype=args[6], start=args[7])
    finally:
        row_attention.ONE_PASS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rows", default="1,8,64", help="comma-separated row counts to time")
    ap.add_argument("--tiles", metavar="FILE", help="time the row-linear kernel's tiles instead, and write the "
                    "best as MIDLAYER_ROW_TILES's value to FILE (CUDA only)")
    ap.add_argument("--attention", metavar="FILE", help="time the row-attention kernel's shapes instead, and "
                    "write the best as MIDLAYER_ROW_ATTENTION's value to FILE (CUDA only)")
    ap.add_argument("--workers", type=int, default=0, help="with --attention: compile its shapes first in this "
                    "many processes at once")
    ap.add_argument("--warm-attention", metavar="SHAPES", help="make these row-attention shapes' calls once "
                    "(comma-separated, MIDLAYER_ROW_ATTENTION's form): --workers' helper processes")
    args = ap.parse_args()
    dev = torch.device(args.device)
    bad = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if bad:
        ap.error(f"--dtypes: choose from {', '.join(DTYPES)}, got {bad}")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: comma-separated row counts, got {args.rows!r}")
    print(f"torch {torch.__version__}, {dev}"
          f"{f' ({torch.cuda.get_device_name(dev)})' if dev.type == 'cuda' else ''}, Triton "
          f"{'available' if row_attention.available(dev) else 'not available here'}")
    if not row_attention.available(dev):
        return
    if args.warm_attention:
        try:
            shapes = [row_attention.parse_shape(sh) for sh in args.warm_attention.split(",")]
        except ValueError as e:
            ap.error(f"--warm-attention: {e}")
        warm_attention(dev, args.dtypes.split(","), rows, shapes)
        return
    if args.tiles or args.attention:
        if dev.type != "cuda":
            ap.error("--tiles and --attention time on CUDA only")
        if args.tiles:
            sweep_tiles(dev, args.dtypes.split(","), rows, args.tiles)
        if args.attention:
            sweep_attention(dev, args.dtypes.split(","), rows, args.attention, args.workers)
        return
    for d in args.dtypes.split(","):
        dtype = DTYPES[d]
        checks = {name: check(dev, dtype) for name, check in (("row_attention", row_attention.self_check),
                                                             ("fused_rows", fused_rows.self_check),
                                                             ("row_linear", row_linear.self_check))}
        print(f"\n{d}: self-checks (largest difference from the formula, relative): "
              + ", ".join(f"{k} {v:.2e}" for k, v in checks.items())
              + f"; the attention in {'one launch' if row_attention.ONE_PASS else 'two launches'}", flush=True)
        if dev.type != "cuda":
            print("(no timing off CUDA)")
            continue
        print("\n| kernel | rows | Triton us | PyTorch us | Triton / PyTorch |\n|---|---|---|---|---|")
        for n in rows:
            for name, kernel, ops in cases(dev, dtype, n):
                with torch.no_grad():
                    t, p = device_us(kernel), device_us(ops)
                print(f"| {name} | {n} | {t:.1f} | {p:.1f} | {t / p:.2f} |", flush=True)


if __name__ == "__main__":
    main()

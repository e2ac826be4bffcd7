"""Row attention: the static decode step's attention (`DecodeStep.attend`) as one Triton kernel a layer.

A row reads its keys in POSITION order through the position -> slot map `keys` [B, N, S] of the step, up to
its own position, in chunks of CHUNK positions (flash-decoding's split of the keys: Dao et al. 2023, "Flash-
Decoding for long-context inference"). Pass 1: one program per (row, kv head, chunk) keeps an online softmax
over its chunk in blocks of BS positions (running max, sum and weighted sum, all fp32; Milakov and Gimelshein
2018, arXiv 1805.02867) for the `rep` query heads that share the kv head (GQA). Pass 2 combines a (row, kv
head)'s chunks 0, 1, .. in that order: in the same launch, by the row's last chunk to finish (ONE_PASS; a
counter per (row, kv head), the pattern of CUDA's threadFenceReduction sample), or as a second kernel. A row's
result then depends on its query, its position and the keys it sees, and on no other row: not on how many rows
share the forward nor on where it sits among them, and not on where its keys sit in the cache (a tree node's
ancestors need not be adjacent).
Positions before the forward's start (`row_attention`'s start: the committed text, at slot = position) are read
at their own slots, without the load of `keys` that each block's key and value loads otherwise wait for (64th
session; the same slots, so the same bits; not yet timed on a GPU).
The chunks' bounds are multiples of CHUNK, fixed by position, and the same compiled kernels run at every
bucket size, so this holds by construction on any GPU; the step's probe still measures it
(`DecodeStep.row_invariant`).

Why. The PyTorch version of `attend` is about 14 kernels a layer (the scores' GEMM, their gather into
position order, the softmax, two more GEMMs, the window's gathers, the casts); on a GPU each small kernel
costs a few microseconds even inside a CUDA graph, where the recipe's SDPA is one. Why the split: plain
decoding is one row, so one program per (row, kv head) would be 3 programs for SmolLM2, each walking up to
the whole context in series, a few dependent loads per block of 32 positions: by reasoning tens of
microseconds a layer at 900 positions (not measured). Split, a row at position p runs p // CHUNK + 1
programs per kv head, each at most CHUNK / BS blocks, and pass 2 reads p // CHUNK + 1 partials.
Exactness: blocks and chunks past a row's position are not visited. A visited block whose keys are all
masked adds exact zeros and rescales by exp(0) = 1.

Rows a program (ROWS > 0, `_attend_rows`; 63rd session, not yet timed on a GPU). On the H200 (62nd session) the
kernel took 12.0 us a layer for one bf16 row against SDPA's 6.9, and 44.1 against 12.8 for 64 rows, where a
hidden-transfer round's attention was 46% of its time: one program per (row, kv head, chunk) is thousands of short
programs at 128 rows, each a chain of dependent loads, their products reduced across threads. `_attend_rows` runs
the same online softmax, in the same chunks and blocks of positions, for ROWS rows a program, each row a batch of
its own in a batched tl.dot (IEEE fp32: on a GPU one FMA chain per output over the block's positions in order); the
weights' sum is such a product too. A row's arithmetic is then the same whichever rows share its program and however
many (Triton's tile layout, which ROWS changes, decides which thread computes an output, not the order of its sum),
so a forward of n rows runs n (to a power of two) a program where that is fewer than ROWS: one at a plain step.
TENSOR_CORES (a "t" after ROWS) runs a bf16 model's three products in tensor cores as tf32x3 (each fp32 operand a
TF32 part and a TF32 remainder, three products of them): the bf16 query and keys' products exact, the weights within
about 2^-21 of theirs, far under the bf16 output's rounding (2^-9). The FMA path pads the 3 query heads a kv head
has in SmolLM2 to tl.dot's 16 rows: 5.3 times the products a row needs, which tensor cores take at several times the
rate. An fp32 model's products stay IEEE fp32 (FMAs) with TENSOR_CORES too: the fp32 recipe we are measured against
computes at PyTorch's default float32 matmul precision ("highest", IEEE fp32), and tf32x3 is below it.
`_attend_rows`' bits differ from `_attend_chunks`' (another order of sums), so the choice of kernel is global, as
the shape is; the device sweep (benchmarks/triton_kernels.py --attention) passes over a shape that gives a row other
bits in a call of other rows, and the step's probe measures it again.

The keys themselves (`keys`, and the mask `kmask`: which positions a row sees) are one more kernel a forward,
`row_keys`: the formula of `reference_keys` (which the PyTorch attention uses), in integer ops, where PyTorch
launches about 20 small kernels for it.

Triton is optional (triton_build.py). On a CPU the same kernel source runs in Triton's interpreter (numpy, slow):
what the tests use to check it against the naive formula and the step's losslessness; `DecodeStep` tries this
attention on CUDA only.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from . import triton_build
from .triton_build import NEEDS, pow2

BLOCK_POSITIONS = 32  # BS: positions per step of a program's loop (a [rep, BS, d] product lives in registers)
CHUNK = 64  # positions per program of pass 1: a row at position p is split over p // CHUNK + 1 programs
WARPS = 4  # pass 1's num_warps (Triton's default)
ROWS = 0  # 0: one row a program, products summed by `tl.sum` (`_attend_chunks`); n: n rows a program by tl.dot
TENSOR_CORES = False  # with ROWS: a bf16 model's products in FMAs (False) or in tensor cores, as tf32x3 (True)
# with ROWS: a block of positions before the committed text's end, the same for all of a program's rows, is loaded
# once and broadcast to them (True), or each row gathers its own ("g" in the shape, False; the 63rd session's)
SHARED = True
TOLERANCE = 1e-4  # `self_check`'s: a correct kernel is about 1e-6 from the formula (the probe's, decode_step)
ONE_PASS = True  # pass 2 inside pass 1's launch (`_attend_chunks`); False where `self_check` finds it off
tl = to_bf16 = None  # triton.language and the shared helper, set when a kernel is first made


def parse_shape(spec: str) -> tuple[int, int, int, int, bool, bool]:
    """MIDLAYER_ROW_ATTENTION's form, "BSxCHUNKxWARPS" (e.g. 32x64x4: the defaults) or "BSxCHUNKxWARPSxROWS[t][g]",
    as (BLOCK_POSITIONS, CHUNK, WARPS, ROWS, TENSOR_CORES, SHARED), ROWS 0 where not given, TENSOR_CORES where "t"
    follows it, SHARED unless "g" ends it (each row gathers its committed keys too): powers of two, BS at least 8
    and at most CHUNK (at least 16 with ROWS: tl.dot's least), WARPS 1 to 16, ROWS at most 16. Any of them gives
    each row the bits of its own (the same kernel at every bucket); they change which program sums which positions
    and how, and its speed. benchmarks/triton_kernels.py --attention FILE chooses one
    on the device. A clear error otherwise."""
    spec = spec.strip()
    gathered = spec.endswith("g")
    tc = spec.removesuffix("g").endswith("t")
    try:
        bs, chunk, warps, *rows = (int(v) for v in spec.removesuffix("g").removesuffix("t").split("x"))
        if len(rows) > 1 or (tc or gathered) and not rows:
            raise ValueError
    except ValueError:
        raise ValueError(f"row attention: {spec!r} is not BSxCHUNKxWARPS[xROWS[t][g]] (e.g. 32x64x4, 32x64x4x8t)"
                         ) from None
    rows = rows[0] if rows else 0
    if (any(v < 1 or v & (v - 1) for v in (bs, chunk, warps, rows or 1)) or not 8 <= bs <= chunk or warps > 16
            or rows > 16 or (rows and bs < 16)):
        raise ValueError(f"row attention: {spec!r}: powers of two, 8 <= BS <= CHUNK (16 <= BS with ROWS), WARPS "
                         "and ROWS at most 16")
    return bs, chunk, warps, rows, tc, not gathered


def format_shape(shape: tuple[int, int, int, int, bool, bool]) -> str:
    """(BLOCK_POSITIONS, CHUNK, WARPS, ROWS, TENSOR_CORES, SHARED) in MIDLAYER_ROW_ATTENTION's form, what
    `parse_shape` reads back (ROWS and its letters left out where 0)."""
    if not shape[3]:
        return "x".join(map(str, shape[:3]))
    return "x".join(map(str, shape[:4])) + ("t" if shape[4] else "") + ("" if shape[5] else "g")


def shape() -> tuple[int, int, int, int, bool, bool]:
    """The kernel's shape now: (BLOCK_POSITIONS, CHUNK, WARPS, ROWS, TENSOR_CORES, SHARED)."""
    return BLOCK_POSITIONS, CHUNK, WARPS, ROWS, TENSOR_CORES, SHARED


def set_shape(shape: tuple[int, int, int, int, bool, bool]) -> None:
    """Sets the kernel's shape (what the device sweep tries; the environment's is set at import)."""
    global BLOCK_POSITIONS, CHUNK, WARPS, ROWS, TENSOR_CORES, SHARED
    BLOCK_POSITIONS, CHUNK, WARPS, ROWS, TENSOR_CORES, SHARED = shape


# a malformed MIDLAYER_ROW_ATTENTION is refused by the first launch (`row_attention`), not at import
_SHAPE_ERROR = ""
try:
    if os.environ.get("MIDLAYER_ROW_ATTENTION", "").strip():
        BLOCK_POSITIONS, CHUNK, WARPS, ROWS, TENSOR_CORES, SHARED = parse_shape(
            os.environ["MIDLAYER_ROW_ATTENTION"])
except ValueError as e:
    _SHAPE_ERROR = f"MIDLAYER_ROW_ATTENTION: {e}"


def available(device: torch.device | None = None) -> bool:
    """Whether the kernel runs here: Triton imports, and for `device` (when given) it runs there (CUDA
    compiled; a CPU only under Triton's interpreter, TRITON_INTERPRET=1 before triton's import)."""
    return triton_build.runs_on(KERNELS, device)


def _attend_chunks(q, k, v, keys, kmask, last, first, pm, pl, pacc, counts, out,
                   sqb, sqn, sqh, skb, skh, sks, svb, svh, svs, sxb, sxn, smb, smn, sob, son, soh,
                   N, Hk, NC, rep, d, scale, REP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   CHUNK: tl.constexpr, ONE_PASS: tl.constexpr, BF16: tl.constexpr):
    """Pass 1 (module docstring); grid (B * N, Hk, NC): chunk c's partial softmax over positions c * CHUNK ..
    of one (row, kv head), in blocks of BS positions, into pm, pl [B * N, Hk, NC, REP] (running max and sum)
    and pacc [B * N, Hk, NC, REP, D]. A chunk past the row's position writes nothing (pass 2 does not read it).
    ONE_PASS: pass 2 is this launch's too. Each chunk counts itself done in counts [B * N * Hk] (int32, zero
    before the launch) after its partials are stored (`last_to_count`: the memory order), and the row's last
    chunk to count combines them (`combine`) and sets the count back to zero: the partials are the same, and so
    are the combine's order and its bits. first (int64 [1]): the committed text's end (`row_attention`'s start):
    a row at or past it reads a position before it at its own slot, without the load of `keys` there.
    (At module level: Triton resolves `tl` through the function's globals, and the interpreter swaps in its
    own there.)"""
    row = tl.program_id(0)  # b * N + n
    hk = tl.program_id(1)
    c = tl.program_id(2)
    b = row // N
    n = row % N
    r = tl.arange(0, REP)
    dd = tl.arange(0, D)
    rm = r < rep
    dm = dd < d
    heads = hk * rep + r
    qv = tl.load(q + b * sqb + n * sqn + heads[:, None] * sqh + dd[None, :], mask=rm[:, None] & dm[None, :],
                 other=0.0).to(tl.float32)  # [REP, D]
    m = tl.full([REP], -1.0e30, tl.float32)  # (finite: a first block with no visible key gives no NaN)
    total = tl.zeros([REP], tl.float32)
    acc = tl.zeros([REP, D], tl.float32)
    hi = tl.load(last + row).to(tl.int32)  # the row's position: every later position is masked for it
    committed = tl.load(first).to(tl.int32)
    lo = c * CHUNK
    for j0 in range(lo, tl.minimum(lo + CHUNK, hi + 1), BS):
        j = j0 + tl.arange(0, BS)
        jm = j <= hi
        # (the row's position as a tensor of j's shape: the interpreter masks by tensors only)
        slot = key_slots(keys + b * sxb + n * sxn, j, j * 0 + hi, committed, jm)
        km = tl.load(kmask + b * smb + n * smn + j, mask=jm, other=float("-inf"))
        kd = tl.load(k + b * skb + hk * skh + slot[:, None] * sks + dd[None, :], mask=dm[None, :],
                     other=0.0).to(tl.float32)  # [BS, D]
        s = tl.sum(qv[:, None, :] * kd[None, :, :], axis=2) * scale + km[None, :]  # [REP, BS]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        vd = tl.load(v + b * svb + hk * svh + slot[:, None] * svs + dd[None, :], mask=dm[None, :],
                     other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vd[None, :, :], axis=1)
        m = m_new
    at = (row * Hk + hk) * NC + c
    live = lo + r * 0 <= hi  # [REP]: the chunk holds positions the row sees
    tl.store(pm + at * REP + r, m, mask=live)
    tl.store(pl + at * REP + r, total, mask=live)
    tl.store(pacc + (at * REP + r[:, None]) * D + dd[None, :], acc, mask=live[:, None] & (dd[None, :] < D))
    if ONE_PASS:
        if lo <= hi:
            if last_to_count(counts + row * Hk + hk, hi // CHUNK):  # (the row's chunks are 0 .. hi // CHUNK)
                combine(pm, pl, pacc, out, row, hk, hi, sob, son, soh, N, Hk, NC, rep, d, REP, D, CHUNK, BF16)


def _attend_rows(q, k, v, keys, kmask, last, first, pm, pl, pacc, counts, out,
                 sqb, sqn, sqh, skb, skh, sks, svb, svh, svs, sxb, sxn, smb, smn, sob, son, soh,
                 R, N, Hk, NC, rep, d, scale, ROWS: tl.constexpr, RP: tl.constexpr, REP: tl.constexpr,
                 D: tl.constexpr, BS: tl.constexpr, CHUNK: tl.constexpr, ONE_PASS: tl.constexpr,
                 BF16: tl.constexpr, PREC: tl.constexpr, SHARED: tl.constexpr):
    """Pass 1 for ROWS rows a program (ROWS > 0); grid (cdiv(B * N, ROWS), Hk, NC). `_attend_chunks`' online
    softmax, in the same blocks of BS positions and chunks of CHUNK, for each of the block's rows alone: its
    query heads (padded to RP >= 16 rows, tl.dot's least) against its own keys in position order, a batched
    tl.dot [ROWS, RP, D] x [ROWS, D, BS], then the weights' [ROWS, RP, BS] x [ROWS, BS, D], in fp32 (bf16
    operands widened, exact). PREC: "ieee", products and sums in FMAs; or "tf32x3", in tensor cores (module
    docstring: why, and a row's bits at any ROWS). Blocks past a row's own position (another row's) are masked
    for it: rescaled by exp(0) = 1, exact zeros added. Partials [.., REP, D] as `_attend_chunks`' (the heads
    past rep are not stored); one count per (block of rows, kv head): the block's last chunk to count combines
    its rows (`combine_rows`). SHARED: a block of positions before the committed text's end (`first`) is loaded
    once for the program's rows where all of them are past it and of one sequence (the same slots: the same
    values, so the same bits), broadcast to them; else each row gathers its own keys and values."""
    blk = tl.program_id(0)
    hk = tl.program_id(1)
    c = tl.program_id(2)
    rows = blk * ROWS + tl.arange(0, ROWS)
    here = rows < R
    b = tl.minimum(rows, R - 1) // N  # (a block's rows past the last: the last row's operands, all masked)
    n = tl.minimum(rows, R - 1) % N
    r = tl.arange(0, RP)
    dd = tl.arange(0, D)
    j_ = tl.arange(0, BS)
    dm = dd < d
    heads = hk * rep + r
    qv = tl.load(q + b[:, None, None] * sqb + n[:, None, None] * sqn + heads[None, :, None] * sqh
                 + dd[None, None, :], mask=here[:, None, None] & (r < rep)[None, :, None] & dm[None, None, :],
                 other=0.0).to(tl.float32)  # [ROWS, RP, D]
    m = tl.full([ROWS, RP], -1.0e30, tl.float32)
    total = tl.zeros([ROWS, RP], tl.float32)
    acc = tl.zeros([ROWS, RP, D], tl.float32)
    ones = tl.full([ROWS, BS, 16], 1.0, tl.float32)
    zeros = tl.zeros([ROWS, RP, 16], tl.float32)
    hi = tl.load(last + rows, mask=here, other=-1).to(tl.int32)  # [ROWS]: each row's position (-1: no row)
    committed = tl.load(first).to(tl.int32)
    top = tl.max(hi, axis=0)
    # every row of the block past the committed text, of one sequence: a block of positions before it is the same
    # keys and values for all of them, loaded once and broadcast (the same values: the same bits)
    b0 = tl.min(b, axis=0)
    alike = (tl.min(tl.where(here, hi, 2147483647), axis=0) >= committed) & (b0 == tl.max(b, axis=0))
    lo = c * CHUNK
    for j0 in range(lo, tl.minimum(lo + CHUNK, top + 1), BS):
        j = j0 + j_
        jm = j[None, :] <= hi[:, None]  # [ROWS, BS]
        slot = key_slots(keys + (b * sxb + n * sxn)[:, None], j[None, :], hi[:, None], committed, jm)  # [ROWS, BS]
        km = tl.load(kmask + b[:, None] * smb + n[:, None] * smn + j[None, :], mask=jm, other=float("-inf"))
        if SHARED:
            shared = alike & (j0 + BS <= committed)
        else:
            shared = False
        kd = block_rows(k, b, b0, hk, slot, j, dd, dm, skb, skh, sks, shared, ROWS, BS, D)  # [ROWS, BS, D]
        s = tl.dot(qv, tl.permute(kd, (0, 2, 1)), input_precision=PREC) * scale + km[:, None, :]  # [ROWS, RP, BS]
        m_new = tl.maximum(m, tl.max(s, axis=2))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, :, None])
        # the weights' sum as a product with ones: one FMA chain over the block's positions in order, where a
        # tl.sum's order would follow the tile's layout, which ROWS changes (every column of the product is it)
        total = tl.max(tl.dot(p, ones, (total * alpha)[:, :, None] + zeros, input_precision=PREC), axis=2)
        vd = block_rows(v, b, b0, hk, slot, j, dd, dm, svb, svh, svs, shared, ROWS, BS, D)
        acc = tl.dot(p, vd, acc * alpha[:, :, None], input_precision=PREC)
        m = m_new
    at = (rows * Hk + hk) * NC + c  # [ROWS]
    live = (lo <= hi)[:, None] & (r < REP)[None, :]  # [ROWS, RP]: the chunk holds positions the row sees
    tl.store(pm + at[:, None] * REP + r[None, :], m, mask=live)
    tl.store(pl + at[:, None] * REP + r[None, :], total, mask=live)
    tl.store(pacc + ((at[:, None] * REP + r[None, :]) * D)[:, :, None] + dd[None, None, :], acc,
             mask=live[:, :, None])
    if ONE_PASS:
        if lo <= top:
            if last_to_count(counts + blk * Hk + hk, top // CHUNK):  # (the block's chunks are 0 .. top // CHUNK)
                combine_rows(pm, pl, pacc, out, rows, here, hi, top, b, n, hk, sob, son, soh, Hk, NC, rep, d, ROWS,
                             REP, D, CHUNK, BF16)


def key_slots(keys, j, hi, committed, jm):
    """A device helper (`key_slots`): the slots of a row's keys at positions j (`keys`: the row's map at position
    0; hi: its position, broadcast with j; jm: the positions it sees, 0 elsewhere). A row at or past the committed
    text's end (`row_attention`'s start) sees a position j before it at slot j, so it is not loaded from `keys`
    there (a load each block's key and value loads would wait for); the others are `keys`' own."""
    direct = (j < committed) & (hi >= committed)
    read = jm & ((j >= committed) | (hi < committed))
    return tl.where(direct, j, tl.load(keys + j, mask=read, other=0))


def block_rows(x, b, b0, hk, slot, j, dd, dm, sb, sh, ss, shared, ROWS: tl.constexpr, BS: tl.constexpr,
               D: tl.constexpr):
    """A device helper (`block_rows`): a block's keys or values for a program's rows, [ROWS, BS, D] in fp32, of the
    cache layer x (strides sb, sh, ss by sequence, kv head, slot): loaded once at slots j (sequence b0) and
    broadcast where `shared`, else each row's at its own slots `slot` [ROWS, BS] (sequences b [ROWS])."""
    if shared:
        out = tl.broadcast_to(tl.load(x + b0 * sb + hk * sh + j[:, None] * ss + dd[None, :], mask=dm[None, :],
                                      other=0.0).to(tl.float32)[None, :, :], (ROWS, BS, D))
    else:
        out = tl.load(x + b[:, None, None] * sb + hk * sh + slot[:, :, None] * ss + dd[None, None, :],
                      mask=dm[None, None, :], other=0.0).to(tl.float32)
    return out


def last_to_count(count, last):
    """A device helper (`last_to_count`): counts the program's chunk done at `count` (int32) and says whether it
    was the last of chunks 0 .. last to count, which sets the count back to zero. Called after the program's
    partials are stored: the barrier makes all its threads' stores come first, and the add is acquire-release at
    GPU scope, so the program that counts last sees every chunk's partials."""
    tl.debug_barrier()
    done = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    if done == last:
        tl.store(count, 0)
    return done == last


def _combine_chunks(pm, pl, pacc, last, out, sob, son, soh, N, Hk, NC, rep, d,
                    REP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, BF16: tl.constexpr):
    """Pass 2 as a launch of its own (where ONE_PASS is off); grid (B * N, Hk): `combine` for each."""
    row = tl.program_id(0)
    combine(pm, pl, pacc, out, row, tl.program_id(1), tl.load(last + row).to(tl.int32), sob, son, soh, N, Hk, NC,
            rep, d, REP, D, CHUNK, BF16)


def combine(pm, pl, pacc, out, row, hk, hi, sob, son, soh, N, Hk, NC, rep, d, REP: tl.constexpr,
            D: tl.constexpr, CHUNK: tl.constexpr, BF16: tl.constexpr):
    """A device helper (`combine`), pass 2 for one (row, kv head) at position hi: `combine_rows` for a block of
    that row alone."""
    rows = row + tl.arange(0, 1)
    combine_rows(pm, pl, pacc, out, rows, rows == row, rows * 0 + hi, hi, rows // N, rows % N, hk, sob, son, soh, Hk,
                 NC, rep, d, 1, REP, D, CHUNK, BF16)


def combine_rows(pm, pl, pacc, out, rows, here, hi, top, b, n, hk, sob, son, soh, Hk, NC, rep, d,
                 ROWS: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, BF16: tl.constexpr):
    """A device helper (`combine_rows`), pass 2 for a block's rows at once ([ROWS, REP, D]; `combine`: one row):
    each row's chunks 0 .. its position // CHUNK combined in that order, the largest running max first, then each
    chunk's sum and weighted sum rescaled to it. One loop over the block's chunks 0 .. top // CHUNK, a row's
    chunks past its own last masked: the running max unmoved by them (-inf), and exact zeros added (weight
    exp(-inf) = 0), so a row gets the bits it gets in a block of its own, where ROWS one-row combines would be
    ROWS loops one after another. hi [ROWS]: the rows' positions; here: the block's real rows (the others are
    not stored). (Loads past the L1 cache, ".cg": partials another program stored in this launch. The output in
    bf16 is rounded once: the bits of the fp32 result cast by PyTorch.)"""
    r = tl.arange(0, REP)
    dd = tl.arange(0, D)
    base = (rows * Hk + hk) * NC  # [ROWS]
    big = tl.full([ROWS, REP], -1.0e30, tl.float32)
    for c in range(0, top // CHUNK + 1):
        cm = (here & (c <= hi // CHUNK))[:, None]  # [ROWS, 1]: the row has chunk c
        big = tl.maximum(big, tl.load(pm + (base + c)[:, None] * REP + r[None, :], mask=cm, other=float("-inf"),
                                      cache_modifier=".cg"))
    total = tl.zeros([ROWS, REP], tl.float32)
    acc = tl.zeros([ROWS, REP, D], tl.float32)
    for c in range(0, top // CHUNK + 1):
        cm = (here & (c <= hi // CHUNK))[:, None]
        at = (base + c)[:, None] * REP + r[None, :]  # [ROWS, REP]
        w = tl.exp(tl.load(pm + at, mask=cm, other=float("-inf"), cache_modifier=".cg") - big)
        total += tl.load(pl + at, mask=cm, other=0.0, cache_modifier=".cg") * w
        acc += tl.load(pacc + (at * D)[:, :, None] + dd[None, None, :], mask=cm[:, :, None], other=0.0,
                       cache_modifier=".cg") * w[:, :, None]
    res = acc / tl.where(here[:, None], total, 1.0)[:, :, None]  # (a block's rows past the last: not stored)
    if BF16:
        res = to_bf16(res)
    heads = hk * rep + r
    tl.store(out + (b * sob + n * son)[:, None, None] + heads[None, :, None] * soh + dd[None, None, :], res,
             mask=here[:, None, None] & (r < rep)[None, :, None] & (dd < d)[None, None, :])


def _row_keys(path_slots, depth, real, held, start, keys, kmask, N, S, Wp, scratch,
              spb, spn, sd, sr, shb, skb, skn, smb, smn, BS: tl.constexpr):
    """`reference_keys`' formula for BS positions of one row; grid (B * N, cdiv(S, BS)). Integers and a
    0 / -inf choice: exact, whatever the order."""
    row = tl.program_id(0)  # b * N + n
    b = row // N
    n = row % N
    p = tl.program_id(1) * BS + tl.arange(0, BS)
    inside = p < S
    st = tl.load(start)
    r = tl.load(real + n * sr).to(tl.int32)
    real_n = r != 0
    committed = (p < st) & (tl.load(held + b * shb + p, mask=inside, other=0).to(tl.int32) != 0)
    j = p - st
    at = tl.load(path_slots + b * spb + n * spn + tl.minimum(tl.maximum(j, 0), Wp - 1), mask=inside, other=-1)
    tail = (j >= 0) & (j <= tl.load(depth + n * sd)) & real_n & (at >= 0)
    pad0 = (p == 0) & (r == 0)
    key = tl.where(tail, at, tl.where(pad0, scratch, p).to(tl.int64))
    visible = tail | pad0 | (committed & real_n)
    tl.store(keys + b * skb + n * skn + p, key, mask=inside)
    tl.store(kmask + b * smb + n * smn + p, tl.where(visible, 0.0, float("-inf")), mask=inside)


KERNELS = (_attend_chunks, _attend_rows, _combine_chunks, _row_keys)  # (made together by `available`, before any trace)
# (bound by triton_build.kernel)
HELPERS = {"combine": combine, "combine_rows": combine_rows, "last_to_count": last_to_count,
           "block_rows": block_rows, "key_slots": key_slots}


def row_attention(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, keys: torch.Tensor, kmask: torch.Tensor,
                  positions: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                  counts: torch.Tensor | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v per row, over its keys in position order (module docstring).

    q [B, H, N, d] (any strides with d contiguous), kl, vl [B, Hk, S, d] the cache layer, keys [B, N, S]
    (long: the slot holding row i's key at position p), kmask [B, N, S] (fp32, 0 or -inf by position),
    positions [B, N] (long: each row's own). Returns [B, N, H, d] (`out` if given), computed in fp32 and
    stored in `dtype` (fp32 or bf16: the fp32 result rounded once, to nearest even).

    One launch where ONE_PASS (the combine in pass 1's last chunk of a row), two otherwise. counts: the
    one-pass launch's counters, int32, at least B N Hk of them, zero (and left zero): a step keeps one buffer
    for all its launches (`DecodeStep`), where a fresh one would be one more kernel, its zeroing.
    start (a long scalar on the device, the step's `start`): the committed text's end. Where `keys` are the
    step's (`reference_keys`), a row at or past it sees position p < start at slot p, so the kernel reads
    slot p there without loading `keys` (a load each block's key and value loads waited for); the same slots, so
    the same bits. None: `keys` everywhere (operands built otherwise)."""
    B, H, N, d = q.shape
    Hk = kl.shape[1]
    rep = H // Hk
    if out is None:
        out = torch.empty(B, N, H, d, device=q.device, dtype=dtype)
    if out.dtype not in triton_build.TYPES:
        raise ValueError(f"row_attention stores fp32 or bf16, not {out.dtype}")
    if _SHAPE_ERROR:
        raise ValueError(_SHAPE_ERROR)
    if not available(q.device):
        raise RuntimeError(NEEDS)
    sq, sk, sv, sx, sm, so = q.stride(), kl.stride(), vl.stride(), keys.stride(), kmask.stride(), out.stride()
    if min(sq[3], sk[3], sv[3], sx[2], sm[2], so[3]) != 1 or max(sq[3], sk[3], sv[3], sx[2], sm[2], so[3]) != 1:
        raise ValueError("row_attention needs the last dimension of every operand contiguous")
    # (with ROWS, D at least tl.dot's 16: the partials' layout is the kernel's, and pass 2 reads it so)
    REP, D, NC = max(pow2(rep), 2), max(pow2(d), 16 if ROWS else 1), triton_build.cdiv(keys.shape[2], CHUNK)
    pm = torch.empty(B * N, Hk, NC, REP, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B * N, Hk, NC, REP, D, device=q.device, dtype=torch.float32)
    last, bf16 = positions.reshape(B * N).contiguous(), out.dtype == torch.bfloat16  # (the kernel reads it densely)
    if ONE_PASS and counts is None:
        counts = torch.zeros(B * N * Hk, device=q.device, dtype=torch.int32)
    if ONE_PASS and (counts.dtype != torch.int32 or counts.numel() < B * N * Hk):
        raise ValueError(f"row_attention: counts {counts.dtype} [{counts.numel()}], want int32 [>= {B * N * Hk}]")
    if start is None:
        start = torch.zeros((), dtype=torch.long, device=q.device)  # (no position is before it: `keys` everywhere)
    args = (q, kl, vl, keys, kmask, last, start, pm, pl, pacc, counts if ONE_PASS else pm, out, sq[0], sq[2], sq[1],
            sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sx[0], sx[1], sm[0], sm[1], so[0], so[1], so[2])
    shape = dict(REP=REP, D=D, BS=BLOCK_POSITIONS, CHUNK=CHUNK, ONE_PASS=ONE_PASS, BF16=bf16,
                 **({} if WARPS == 4 else {"num_warps": WARPS}))  # (Triton's default unsaid: the launch dynamo traced)
    if ROWS:  # (a forward of fewer rows, a plain step's one: as many a program; `_attend_rows`: the same bits)
        rows = min(ROWS, pow2(B * N))
        triton_build.kernel(_attend_rows)[(triton_build.cdiv(B * N, rows), Hk, NC)](
            *args, B * N, N, Hk, NC, rep, d, 1.0 / math.sqrt(d), ROWS=rows, RP=max(pow2(rep), 16),
            PREC="tf32x3" if TENSOR_CORES and q.dtype == torch.bfloat16 else "ieee", SHARED=SHARED, **shape)
    else:
        triton_build.kernel(_attend_chunks)[(B * N, Hk, NC)](*args, N, Hk, NC, rep, d, 1.0 / math.sqrt(d), **shape)
    if not ONE_PASS:
        triton_build.kernel(_combine_chunks)[(B * N, Hk)](
            pm, pl, pacc, last, out, so[0], so[1], so[2], N, Hk, NC, rep, d, REP=REP, D=D, CHUNK=CHUNK, BF16=bf16)
    return out


def row_keys(path_slots: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, held: torch.Tensor,
             start: torch.Tensor, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_keys` as one kernel (where the step attends through `row_attention`: about 20 small kernels
    fewer a forward, benchmarks/step_kernels.py). The same operands; the very same results."""
    B, N, Wp = path_slots.shape
    S = held.shape[1]
    if not available(path_slots.device):
        raise RuntimeError(NEEDS)
    if path_slots.stride(2) != 1 or held.stride(1) != 1:
        raise ValueError("row_keys needs path_slots' last dimension and held's contiguous")
    keys = torch.empty(B, N, S, device=held.device, dtype=torch.long)
    kmask = torch.empty(B, N, S, device=held.device, dtype=torch.float32)
    BS = min(pow2(S), 1024)
    triton_build.kernel(_row_keys)[(B * N, triton_build.cdiv(S, BS))](
        path_slots, depth, real, held, start, keys, kmask, N, S, Wp, scratch, path_slots.stride(0),
        path_slots.stride(1), depth.stride(0), real.stride(0), held.stride(0), keys.stride(0), keys.stride(1),
        kmask.stride(0), kmask.stride(1), BS=BS)
    return keys, kmask


def reference_keys(path_slots: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, held: torch.Tensor,
                   start: torch.Tensor, scratch: int, slot_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys in position order, and which it sees (`DecodeStep.blocks`): (keys [B, N, S], the slot
    holding row i's key at position p; kmask [B, N, S] fp32, 0 where row i sees position p, else -inf).

    path_slots [B, N, Wp] (long): the slot of row i's key at position start + j for j <= depth[i] (-1: none
    there); depth [N] (long); real [N] (bool; False: padding); held [B, S] (bool: the slots holding committed
    text, slot p at position p for p < start); start (a long scalar tensor); scratch: the slot that padding
    rows see alone (at position 0, for a finite softmax). slot_ids: arange(S), where the caller keeps one."""
    B, N, _ = path_slots.shape
    S = held.shape[1]
    p = torch.arange(S, device=held.device) if slot_ids is None else slot_ids
    committed = (p < start) & held  # [B, S]: slot p = position p
    j = p - start  # a tail position's index on the row's path
    at = path_slots.gather(2, j.clamp(0, path_slots.shape[-1] - 1).view(1, 1, S).expand(B, N, S))
    tail = (j >= 0) & (j <= depth[:, None]) & real[:, None] & (at >= 0)  # [B, N, S]
    pad0 = (~real)[:, None] & (p == 0)  # [N, S]
    keys = torch.where(tail, at, torch.where(pad0, scratch, p.expand(B, N, S)))
    visible = tail | pad0 | committed[:, None, :] & real[:, None]
    return keys, torch.where(visible, 0.0, float("-inf"))


def self_check(device: torch.device, dtype: torch.dtype, H: int = 9, Hk: int = 3, d: int = 64, seed: int = 0
               ) -> float:
    """The kernel's largest difference from `reference` on `device` on a random forward (rows at other slots
    than their positions, padding, GQA): what the step's probe, which compares a row's bits across buckets
    and not its value, cannot see. A correct kernel is within fp32 rounding (about 1e-6 here). Both ways are
    checked, one launch and two (ONE_PASS): where the one launch is off by more than TOLERANCE and the two are
    not (the counters' ordering, which only a GPU can show), the two are used from then on, with a warning."""
    global ONE_PASS
    g = torch.Generator().manual_seed(seed)
    N, S = 8, 200  # (positions 126..130: the rows' keys span chunks 0..2 of CHUNK = 64)
    q = torch.randn(1, N, H, d, generator=g).to(device, dtype).transpose(1, 2)
    kl, vl = (torch.randn(1, Hk, S, d, generator=g).to(device, dtype) for _ in range(2))
    pos = torch.tensor([[126, 127, 127, 129, 130, 0, 0, 0]], device=device)
    keys = torch.arange(S, device=device).expand(1, N, S).clone()
    keys[0, :5, 126:131] = torch.arange(180, 185, device=device)  # (the tree's rows at slots 180..)
    kmask = torch.where(torch.arange(S, device=device)[None, None] <= pos[..., None], 0.0, float("-inf"))
    want, errs = reference(q, kl, vl, keys, kmask), {}
    chosen = ONE_PASS
    for one in (True, False):
        ONE_PASS = one
        try:
            got = row_attention(q, kl, vl, keys, kmask, pos, start=torch.tensor(126, device=device))
            errs[one] = float((got.double() - want).abs().max())
        finally:
            ONE_PASS = chosen
    if ONE_PASS and errs[True] > TOLERANCE >= errs[False]:
        warnings.warn(f"the row-attention kernel in one launch is {errs[True]:.2e} from the formula on {device}, "
                      f"in two {errs[False]:.2e}: it runs in two launches a layer", stacklevel=2)
        ONE_PASS = False
    return errs[ONE_PASS]


def compile_for(capability: int, dtype: torch.dtype, rep: int = 3, d: int = 64, rows: int = 4) -> list:
    """The two passes, pass 1 with pass 2 in it and without (and the keys' kernel), at this module's shape
    (BLOCK_POSITIONS, CHUNK, WARPS), and pass 1 of `rows` rows a program (`_attend_rows`, in both ways, and in
    tensor cores, at BLOCK_POSITIONS of at least 16; the two-launch one with each row's keys gathered, the others
    with the committed ones shared), compiled ahead of time for an NVIDIA GPU of compute capability
    `capability` with `dtype` operands and output (triton_build.compile_for: no GPU needed;
    tests/test_row_linear.py)."""
    t = triton_build.TYPES[dtype]
    kinds = dict(q=f"*{t}", k=f"*{t}", v=f"*{t}", keys="*i64", kmask="*fp32", last="*i64", first="*i64", out=f"*{t}",
                 pm="*fp32", pl="*fp32", pacc="*fp32", counts="*i32", scale="fp32", REP="constexpr", D="constexpr",
                 BS="constexpr", CHUNK="constexpr", ONE_PASS="constexpr", BF16="constexpr", path_slots="*i64",
                 depth="*i64", real="*i1", held="*i1", start="*i64", ROWS="constexpr", RP="constexpr",
                 PREC="constexpr", SHARED="constexpr")
    shape = dict(REP=max(pow2(rep), 2), D=pow2(d), CHUNK=CHUNK)
    bf16 = dtype == torch.bfloat16
    return [*(triton_build.compile_for(_attend_chunks, capability, kinds,
                                       dict(shape, BS=BLOCK_POSITIONS, ONE_PASS=one, BF16=bf16), num_warps=WARPS)
              for one in (True, False)),
            *(triton_build.compile_for(_attend_rows, capability, kinds,
                                       dict(shape, D=max(pow2(d), 16), BS=max(BLOCK_POSITIONS, 16), ONE_PASS=one,
                                            BF16=bf16, ROWS=rows, RP=max(pow2(rep), 16), PREC=prec, SHARED=shared),
                                       num_warps=WARPS)
              for one, prec, shared in ((True, "ieee", True), (False, "ieee", False), (True, "tf32x3", True))),
            triton_build.compile_for(_combine_chunks, capability, kinds, dict(shape, BF16=bf16)),
            triton_build.compile_for(_row_keys, capability, kinds, dict(BS=1024))]


def reference(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, keys: torch.Tensor, kmask: torch.Tensor
              ) -> torch.Tensor:
    """The naive formula the kernel computes, in fp64 (for tests): each row's keys and values gathered into
    position order, then softmax(q k^T / sqrt(d) + mask) v. Returns [B, N, H, d] fp64."""
    B, H, N, d = q.shape
    Hk, S = kl.shape[1], kl.shape[2]
    rep = H // Hk
    idx = keys[:, None, :, :, None].expand(B, Hk, N, S, d)
    kp = kl.double()[:, :, None].expand(B, Hk, N, S, d).gather(3, idx)  # [B, Hk, N, S, d]
    vp = vl.double()[:, :, None].expand(B, Hk, N, S, d).gather(3, idx)
    qg = q.double().view(B, Hk, rep, N, d)
    s = torch.einsum("bhrnd,bhnsd->bhrns", qg, kp) / math.sqrt(d) + kmask.double()[:, None, None]
    o = torch.einsum("bhrns,bhnsd->bhrnd", s.softmax(-1), vp)  # [B, Hk, rep, N, d]
    return o.reshape(B, H, N, d).transpose(1, 2)

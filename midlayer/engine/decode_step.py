"""The static-shape decode step (issue 42): one forward over a bucket of rows against a preallocated KV cache
that the step owns, with every shape fixed and nothing read back to the host inside, so that it can be
captured in a CUDA graph, and so that a row's result does not depend on the rows that share its forward.

Why. A SmolLM2-135M decode step is ~1,900 PyTorch ops. On a GPU each is a Python dispatch and a kernel
launch, so the eager step is bound by the host (22-28 ms on an H100, where transformers with a static cache
and CUDA graphs needs 1.9 ms; issue 42). A CUDA graph replays every kernel of a step with one launch. It
needs static shapes, static addresses (the step's own buffers) and no host read inside the step.

What is static.
  * The cache: k, v [L, B, Hk, S, d] and `held` [B, S] (which slots hold committed text: slot p holds the
    token at position p), S = max_len + 1. The last slot is scratch: padded rows write there, it is never held.
  * Row counts: a forward runs a bucket of N rows (`buckets`). Rows beyond the real ones are padding:
    token 0, position 0, the scratch slot, seeing the scratch slot only (so every row has a finite softmax).
  * The inputs are device tensors: tokens, positions and slots [B, N], `start` (the first slot of the
    forward), and the rows' structure: path [N, N], depth [N], real [N]. Row i sees the committed slots
    before `start` and the slots of the rows on its path (its ancestors-or-self: a prompt chunk's rows are a
    chain, a draft tree's rows its branches, plain decoding's one row itself).
  * Attention runs over all S slots with masked keys, so every row reduces over S keys, in POSITION order
    (`DecodeStep.attend`): a tree node's ancestors sit at slots that need not be adjacent, and a SIMD
    reduction rounds the same terms differently at other indices.

Row invariance. A row's logits then depend on its token, its position and the keys it sees, and not on N or
on its place in the bucket, if every kernel reduces a row in the same order at every bucket size. Measured
on an AMD EPYC with AVX-512 (torch 2.13 CPU, 2 threads): an fp32 GEMM gives a row the same bits at every M
that is a multiple of 8, but not between M = 1 (a GEMV), 2-3 and 4-7. So plain decoding runs in the
smallest bucket (8 rows; 1 in q4; 32 under the grouped candidate below) and gets the bits of verification, and so
does the attention's split (`attend`), as long as both use the same buckets (its window is the largest). In
the q4 format every kernel is row-invariant at any M (kernels.py). On CUDA, cuBLAS picks its kernel by M
(split-K for small M), so a row may differ between buckets. What holds is measured, not assumed:
`buckets="auto"` takes the first of STEP_CANDIDATES (StepKernels: on a CPU first with the attention in the q4
format's C kernels, attention="c"; the buckets 1, 8 .. 256; 8 .. 256; on a CPU the same two with the linears in
a C kernel that is row-invariant by construction, kernels.linear_rows; 32 .. 256
with the attention's GEMMs in fixed groups, ATTN_ROWS; then the single bucket 256, where no kernel choice can
depend on M) that the probe `DecodeStep.row_invariant` passes at the step's own cache size and in its mode
(`invariant_buckets`), once per model, size, mode and process, and `DecodeStep.invariant` says whether one
did. The probe runs forwards and verification rounds against plain decoding, and compares the logits and the
attention's fp32 result at every layer (in bf16 the cast after the attention hides most differences). On
CUDA with Triton the first candidates attend through two kernels a layer instead of `attend`'s PyTorch ops
(ops/row_attention.py: each row reduced alone, in position order, so row-invariant by construction), and the
third runs the linears through a Triton kernel too (ops/row_linear.py: every row count the same program), for
a BLAS that rounds a row by M (an H200's fp32 cuBLAS).

Acceptance on the device (`verify`): the greedy targets, the longest accepted path, the bonus token and the
compaction of the accepted rows' K/V to the front are index-tensor operations, and the host reads one small
tensor per round: [accepted count, the path's tokens..., bonus].

Scope. Dense attention models (pre-norm or sandwich, GQA, RoPE or no positions, tied or untied heads, fp32,
bf16 or q4 weights; in q4 the C kernels attend, summing over the visible keys only). Gated models (real skipping is data-dependent), state-space mixers, sliding windows,
ALiBi / T5 biases and mixtures of experts keep the dynamic path (generate.py) and are refused here by name.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from midlayer.ops import acceptance, fused_rows, row_attention, row_linear, tree_layout, triton_build
from midlayer.ops import kernels as c_kernels
from .draft_vocab import head_logits
from .generate import GenerationConfig, sample_next, validate_prompts
from midlayer.model.kv_cache import CacheView, kv_dtype
from midlayer.model.transformer import Transformer

# The rows of each of `attend`'s GEMMs (the scores, the weighted sum over the cache, the window's product) when
# they run in fixed groups (`attn_rows`). A GPU's BLAS may pick its kernel by the row count M: on an H200
# cuBLAS's fp32 GEMMs gave a row other bits at other M (issue 42), and a bf16 model's attention runs in fp32.
# In groups of ATTN_ROWS rows every bucket runs the same GEMM shapes: a bucket of 32 one of each, of 128 four.
ATTN_ROWS = 32
# The most rows whose window products (`attend`: one [rep, W] @ [W, d] per row and kv head) share one batched
# GEMM: larger forwards run it in chunks. On an H200 cuBLAS's batched fp32 GEMM of these products gave a row
# other bits from 64 rows up (192 products and more; benchmarks/row_invariance.py, issue 42), not up to 32.
WINDOW_ROWS = 32


class StepKernels(NamedTuple):
    """What a static step runs its forwards with: the row counts of its forwards, `attend`'s row groups (None:
    one group), its attention ("torch": `attend` in PyTorch ops; "triton": ops/row_attention.py, and with it
    the row-wise kernels of ops/fused_rows.py: RMSNorm, SwiGLU's product, RoPE with the K/V store; "c": the
    CPU's C kernels of the q4 format, RoPE with the store and the attention over the visible keys in slot
    order, row-invariant by construction: Attention._forward_kernels) and its
    linears ("torch": F.linear, i.e. the BLAS; "triton": ops/row_linear.py; "c": the CPU's C kernel,
    kernels.linear_rows, for fp32 and bf16 linears)."""

    buckets: tuple[int, ...]
    attn_rows: int | None = None
    attention: str = "torch"
    linear: str = "torch"


# Tried in order by `invariant_buckets`, the cheapest first. On CUDA with Triton, first the row-attention kernel
# (ops/row_attention.py: two kernels a layer where `attend`'s PyTorch ops are about 14, and row-invariant by
# construction; with it the row-wise kernels, ops/fused_rows.py) with plain decoding in one row, then from 8
# rows; then with the row-linear kernel too (ops/row_linear.py: row-invariant by construction, for a BLAS that
# rounds a row by M: an H200's fp32 cuBLAS, where no candidate below but the single bucket passed). Then
# `attend` in PyTorch ops: several sizes with one GEMM each, plain decoding in one row (where every kernel gives
# a row at M = 1 its bits at M = 8: the q4 format's; on an AMD EPYC it made the q4 static step's plain decoding
# 1.1-1.4x faster than in 8 rows), then from 8 rows (a CPU's fp32 GEMV at one row rounds otherwise); the same two
# with the linears in the CPU's C kernel (kernels.linear_rows, fp32 and bf16: row-invariant by construction, for a
# BLAS that rounds a row by M at every size, an AVX-512 Xeon's MKL, where SmolLM2's fp32 static step otherwise ran
# 256 rows a token: 731 against 68 ms/token; docs/results/static-step.md); several sizes from ATTN_ROWS up with
# attention in groups (at batch 1 a linear's cost is reading its weights, the same for 32 rows as for 8:
# reasoned, not measured); one size for every forward (no kernel choice can then depend on M). On a CPU with the
# C kernels built, the attention's C kernels come first (`c_attention_runs`: three C calls a layer where
# `attend` is ~60 PyTorch ops; SmolLM2's fp32 plain step went from 1.57-1.92x the dynamic engine's ms/token to
# 0.87-1.18x on an AVX-512 Xeon), with PyTorch's linears from one row and from 8, then with the C linear (which
# with them is row-invariant at every M).
_ALL = (1, 8, 16, 32, 64, 128, 256)
STEP_CANDIDATES: tuple[StepKernels, ...] = (
    StepKernels(_ALL, attention="triton"), StepKernels(_ALL[1:], attention="triton"),
    StepKernels(_ALL, attention="triton", linear="triton"),
    StepKernels(_ALL, attention="c"), StepKernels(_ALL[1:], attention="c"),
    StepKernels(_ALL, attention="c", linear="c"),
    StepKernels(_ALL), StepKernels(_ALL[1:]), StepKernels(_ALL, linear="c"), StepKernels(_ALL[1:], linear="c"),
    StepKernels(_ALL[3:], ATTN_ROWS), StepKernels((256,)))
BUCKET_CANDIDATES: tuple[tuple[int, ...], ...] = tuple(dict.fromkeys(c.buckets for c in STEP_CANDIDATES))
# `DecodeStep.attention`: `attend` in PyTorch ops, the row-attention kernel, or the CPU's C kernels
ATTENTIONS = ("torch", "triton", "c")
# `DecodeStep.linear`: F.linear as PyTorch runs it, the row-linear kernel, or the CPU's C kernel (fp32, bf16)
LINEARS = ("torch", "triton", "c")
# The Triton kernels' self-checks (their value against the formula, which the probe, comparing bits, does not
# see), run before the probe tries them: (the candidates' field they serve, the kernels' name, the check, the
# most it may be off, relative to the output's scale: fp32 rounding, or a bf16 output's own, 2^-8).
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
SELF_CHECKS = (("attention", "row-attention", row_attention.self_check,
                dict.fromkeys(ROUNDING, row_attention.TOLERANCE)),
               ("attention", "row-wise (RMSNorm, SwiGLU, RoPE)", fused_rows.self_check, ROUNDING),
               ("linear", "row-linear", row_linear.self_check, ROUNDING))
# W of `DecodeStep.attend`: every row of a forward lies within W - 1 positions of the forward's first slot (a
# prompt chunk has at most W rows; a tree's depth plus hidden transfer's steps stay below W).
MAX_TAIL = 64
GRAPH_MODES: tuple[str, ...] = ("eager", "cudagraph", "compile")
_probed: "weakref.WeakKeyDictionary[Transformer, dict]" = weakref.WeakKeyDictionary()


def invariant_buckets(model: Transformer, max_len: int = 16, graphs: str = "eager") -> tuple[StepKernels, bool]:
    """(kernels, row_invariant): the first of STEP_CANDIDATES whose step gives a row the same bits in every
    bucket and at every place in it, measured on this machine with this model's shapes, dtype and weight format,
    at a cache of `max_len` slots (a kernel may choose by the key count too: split-K on a GPU); once per model,
    size, mode and process (`DecodeStep.row_invariant` is the probe). When none passes: the last candidate, and
    False (speculative output may then differ from plain output at near-ties).
    The C linear's candidates are tried on the CPU only (`c_linear_runs`), the Triton kernels' on CUDA with
    Triton only (`triton_kernels`); a Triton kernel that fails to build or its self-check (its value against
    the formula, which the probe does not see) is passed over with a warning. Under graphs="compile" they are
    tried too: dynamo traces each launch into the graph, and the TorchFunctionMode that routes the linears to
    the row-linear kernel (tests/test_fused_rows.py, as on a GPU), or to the C linear's custom op.
    graphs: the mode the probe runs in. "cudagraph" probes captured graphs: on an H200 in bf16 the eager
    probe passed several buckets and the captured rounds on them still left plain output (issue 42), so a
    captured step is not assumed to replay the eager step's kernel choices. torch.compile's own kernels are not
    probed (a compile per bucket): "compile" probes eagerly."""
    mode = "cudagraph" if graphs == "cudagraph" else "eager"
    memo = _probed.setdefault(model, {})
    dev = model.tok_embeddings.weight.device
    dtype = model.tok_embeddings.weight.dtype
    kernels = triton_kernels(model)
    key = (dtype, str(dev), getattr(model, "weight_format", None), int(max_len), kv_dtype(model), mode)
    if key not in memo:
        usable = {"attention": kernels, "linear": kernels}
        for field, name, check, tol in SELF_CHECKS:  # (the kernels' value first: the probe compares bits only)
            if usable[field]:
                try:
                    err = check(dev, dtype)
                    usable[field] = err <= tol.get(dtype, 1e-5) or _unusable(name, f"{err:.2e} from the formula")
                except Exception as e:
                    usable[field] = _unusable(name, f"{type(e).__name__}: {e}")
        found = None
        for cand in STEP_CANDIDATES:
            tried = [n for n in ("attention", "linear") if getattr(cand, n) == "triton"]
            if not all(usable[n] for n in tried) or not kernels_run(cand, model):
                continue
            try:
                ok = DecodeStep(model, max_len=max_len, buckets=cand.buckets, attn_rows=cand.attn_rows, graphs=mode,
                                attention=cand.attention, linear=cand.linear).row_invariant()
            except Exception as e:  # (a kernel Triton cannot build or capture here: PyTorch's ops instead)
                if not tried:
                    raise
                for n in tried:
                    usable[n] = _unusable(f"row-{n}", f"{type(e).__name__}: {e}")
                continue
            if ok:
                found = (cand, True)
                break
        memo[key] = found or (STEP_CANDIDATES[-1], False)
    return memo[key]


def _unusable(kernel: str, why: str) -> bool:
    """False, having told the user that a Triton kernel's candidates are passed over, and why."""
    warnings.warn(f"the {kernel} kernel failed here ({why}); the static step runs PyTorch's ops instead",
                  RuntimeWarning, stacklevel=3)
    return False


def triton_kernels(model: Transformer) -> bool:
    """Whether `invariant_buckets` tries the Triton kernels (row attention, row linear) for `model`: on CUDA, with
    Triton, in fp32 or bf16 (the dtypes they store; an fp16 model's attention would have passed the probe, whose
    tap reads fp32, and failed in generation), and not in the q4 format (whose C kernels attend and multiply
    themselves). On a CPU the kernels would run in Triton's interpreter."""
    w = model.tok_embeddings.weight
    return (w.device.type == "cuda" and w.dtype in triton_build.TYPES and _attention_kernels()
            and getattr(model, "weight_format", None) != "q4")


def _check_kernels(model: Transformer, attention: str, linear: str) -> tuple[str, str]:
    """(attention, linear) of a step for `model`, refused with a clear message where a kernel cannot run it."""
    dev = model.tok_embeddings.weight.device
    # (the kernels' availability makes them: torch.compile traces their launches, not their making)
    for name, value, values, ok in (("attention", attention, ATTENTIONS, _attention_kernels),
                                    ("linear", linear, LINEARS, row_linear.available)):
        if value not in values:
            raise ValueError(f"{name} must be one of {', '.join(values)}, got {value!r}")
        if value == "triton" and not ok(dev):
            raise ValueError(f"{name}='triton': {triton_build.NEEDS}")
        if value == "triton" and model.tok_embeddings.weight.dtype not in triton_build.TYPES:
            raise ValueError(f"{name}='triton' runs fp32 or bf16 models, not {model.tok_embeddings.weight.dtype}")
    def built() -> str:  # (asked only once a C kernel is refused: a GPU run never builds the library)
        return "" if dev.type != "cpu" or c_kernels.available() else f" (the kernels: {c_kernels.unavailable_reason()})"

    if linear == "c" and not c_linear_runs(model):
        raise ValueError("linear='c' (the C linear) runs an fp32 or bf16 model on the CPU, its linears F.linear's "
                         f"(not int4's or q4's), with the kernels built{built()}")
    if attention == "c" and not c_attention_runs(model):
        raise ValueError("attention='c' (the C attention) runs a model on the CPU whose K/V the kernels hold "
                         f"({' or '.join(str(t).split('.')[-1] for t in c_kernels.KV_DTYPES)}; this one's "
                         f"{str(kv_dtype(model)).split('.')[-1]}), its q|k|v fused (fuse_projections), without "
                         f"q/k norms, not in the q4 format (whose own C path attends), with the kernels built{built()}")
    return attention, linear


def kernels_run(cand: StepKernels, model: Transformer) -> bool:
    """Whether the kernels `cand` names can run `model` here: Triton's on CUDA with Triton (`triton_kernels`),
    the C linear on the CPU (`c_linear_runs`); PyTorch's ops everywhere."""
    return (("triton" not in (cand.attention, cand.linear) or triton_kernels(model))
            and (cand.linear != "c" or c_linear_runs(model)) and (cand.attention != "c" or c_attention_runs(model)))


def c_linear_runs(model: Transformer) -> bool:
    """Whether the step's linears can run the CPU's C kernel (linear="c", kernels.linear_rows) for `model`: an
    fp32 or bf16 model on the CPU whose linears are F.linear's (as loaded, or in the fp32 or bf16 weight
    format; not int4's or q4's own kernels), the library built. (Under torch.compile the kernel is a custom
    op: the compiled step runs it too.)"""
    w = model.tok_embeddings.weight
    return (w.device.type == "cpu" and w.dtype in c_kernels.LINEAR_DTYPES
            and getattr(model, "weight_format", None) in (None, "fp32", "bf16") and c_kernels.available())


def c_attention_runs(model: Transformer) -> bool:
    """Whether the step's attention can run the CPU's C kernels (attention="c": Attention._forward_kernels, the
    q4 format's RoPE with the store and its attention) for `model`: on the CPU, a KV cache of fp32, fp16 or bf16
    (kernels.KV_DTYPES), every block's q|k|v fused and without q/k norms (what `_forward_kernels` takes), not in
    the q4 format (which attends through them already), the library built."""
    dev, kv = model.tok_embeddings.weight.device, kv_dtype(model)
    return (getattr(model, "weight_format", None) != "q4"
            and all(getattr(b, "attention", None) is not None and b.attention.kernels_take(dev, kv)
                    for b in model.layers))


def _attention_kernels(device: torch.device | None = None) -> bool:
    """Whether attention="triton"'s kernels run here: the row attention and the kernels it comes with (the
    row-wise kernels; a round's acceptance, and a dynamic tree's layout)."""
    return all(m.available(device) for m in (row_attention, fused_rows, acceptance, tree_layout))


def _transfer_key(transfer) -> tuple | None:
    """What a captured verification round baked in of hidden transfer's fused pass: the transfer itself (held,
    so that its id cannot be reused by another), its steps and layers, and its weights' addresses and dtypes
    (a transfer moved by `.to()` has new ones, which a captured graph would not read). None: no transfer."""
    if transfer is None:
        return None
    return (transfer, transfer.k, tuple(transfer.layers), transfer.masked,
            tuple((p.data_ptr(), p.dtype) for p in transfer.parameters()))


def round_layout(n_nodes: int, k: int, buckets: Sequence[int], per_step: int | None = None) -> tuple[int, int, int]:
    """(T, N, head_rows) of a verification round over n_nodes nodes with k steps of hidden transfer's pseudo
    rows, per_step rows a step (its anchors; None: every tree row), laid out right after the root and the
    nodes (`TreeTensors`): T tree rows (the root, the nodes, then pseudo rows or padding) in a bucket of N
    rows, of which the LM head reads the first head_rows. T is the smallest bucket that holds the tree, or,
    where that is the largest and pseudo rows ride the round (one bucket only), the tree rows rounded up to 8,
    and the head then reads all N rows, so that every GEMM of the round has one of the probed row counts. T
    does not depend on per_step, so a round with fewer anchors never needs more rows or slots."""
    top = max(buckets)
    rows = n_nodes + 1 + (n_nodes + 1 if per_step is None else per_step) * k
    fits = [b for b in sorted(buckets) if b >= n_nodes + 1 and (b < top or not k)]
    if fits and rows <= top:
        T = fits[0]
        return T, bucket_for(max(T, rows), buckets), T
    T = -(-(n_nodes + 1) // 8) * 8
    if max(T, rows) > top:
        raise ValueError(f"a tree of {n_nodes} nodes with {k} steps of pseudo rows needs {max(T, rows)} rows, more "
                         f"than the largest bucket ({top}): give a smaller tree")
    N = bucket_for(max(T, rows), buckets)
    return T, N, N


def live_rows(first: int, per_step: int, n_rows: int, join_at: dict[int, list[int]], n_layers: int,
              buckets: Sequence[int]) -> tuple[int, ...]:
    """The rows present at each block l = 0..L-1 of a hidden-transfer round, then after the last (entry L): the
    round's first rows up to the smallest bucket that holds the tree's `first` rows (the root and the nodes)
    and the pseudo rows, `per_step` a step, of every step joined by then (arXiv 2404.12022 sec. 3.4: the pseudo
    states of step i enter at block t_i, so the blocks below it run without them; `verify_forward` counts the
    same rows). The rows are laid out step-major after the tree's (TreeTensors), so these are a prefix. A row's
    bits do not depend on the bucket it runs in (the probe), so a tree row below t_1 is computed as in the full
    bucket, at a fraction of the rows: for SmolLM2's transfer (t = 14, 19, 19 of 30 blocks) and a 24-node tree,
    32 rows at blocks 0-13, 64 at 14-18 and 128 at 19-29 where every block ran 128; with pseudo rows for 2
    anchors only, 32 rows at every block. Entry L is n_rows: the forward returns every row."""
    out, joined = [], 0
    for layer in range(n_layers):
        joined += len(join_at.get(layer, ()))
        out.append(min(n_rows, bucket_for(min(n_rows, first + per_step * joined), buckets)))
    return (*out, n_rows)


def any_round_slots(n_nodes: int, k: int, bucket_sets: Sequence[Sequence[int]] = BUCKET_CANDIDATES,
                    per_step: int | None = None) -> int:
    """The most slots a round needs (`round_slots`) under any of these bucket sets (those that can hold it):
    what a step must add to the committed text before `buckets="auto"` has chosen. A round that no set holds
    is round_layout's ValueError (it sized a step for no round, and the round then wrote past the cache)."""
    out, first = 0, None
    for b in bucket_sets:
        try:
            out = max(out, round_slots(n_nodes, k, b, per_step))
        except ValueError as e:  # this set cannot hold the round (the step refuses it if the probe chooses it)
            first = first or e
    if not out and first is not None:
        raise first
    return out


def round_slots(n_nodes: int, k: int, buckets: Sequence[int], per_step: int | None = None) -> int:
    """Cache slots a round needs past its root's slot: its real rows (the pseudo rows too, per_step a step as
    `round_layout`'s; None, every tree row's, is the most) and the T slots its compaction writes. Padding rows
    use the scratch slot."""
    T, _, _ = round_layout(n_nodes, k, buckets, per_step)
    return max(T, n_nodes + 1 + (n_nodes + 1 if per_step is None else per_step) * k)


def anchor_shifts(parent: Sequence[int], depth: Sequence[int], anchors: Sequence[int]) -> list[tuple[int, int]]:
    """Where each tree row takes its next draft from, when hidden transfer's pseudo rows ride a round for some
    rows only (`anchors`, row indices, sorted, the root 0 among them; rows as `DecodeStep.tree_tensors`': 0 the
    root, i + 1 node i of the given parents, -1 the root, and depths). For each row, (j, delta): anchors[j] is
    its deepest ancestor-or-self that carries pseudo rows, delta its depth below it. A round whose accepted
    path ends at that row drafts depth i of the next round from the anchor's step i + delta (the last step
    where that passes k): pseudo step s of an anchor at position p predicts the token at p + 1 + s, blind to
    the tokens between (every pseudo row is, arXiv 2404.12022 sec. 3.2), so it predicts the same position the
    row's own step i would, from an earlier residual. Every row an anchor: (its own index, 0)."""
    rows = len(parent) + 1
    if list(anchors) != sorted(set(anchors)) or not anchors or anchors[0] != 0 or anchors[-1] >= rows:
        raise ValueError(f"anchors must be sorted distinct rows of the tree (0..{rows - 1}), the root 0 first; "
                         f"got {list(anchors)}")
    index = {a: j for j, a in enumerate(anchors)}
    par = [-1] + [p + 1 for p in parent]
    dep = [0] + list(depth)
    out = []
    for r in range(rows):
        b = r
        while b not in index:  # (the root is an anchor, so the walk ends)
            b = par[b]
        out.append((index[b], dep[r] - dep[b]))
    return out


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds n rows."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket ({max(buckets)}): give a larger bucket "
                     f"(buckets={tuple(buckets)}) or a smaller tree")


def unsupported(model: Transformer) -> str | None:
    """Why the static step cannot run `model`, or None."""
    cfg = model.cfg
    reasons = []
    if model.routers is not None:
        reasons.append("gated models (real skipping is data-dependent: generate.py)")
    if cfg.ssm_layers:
        reasons.append("state-space mixers (ssm_layers)")
    if cfg.sliding_window:
        reasons.append("sliding-window attention")
    if model.pos_bias is not None:
        reasons.append(f"{cfg.pos_encoding} position biases")
    if cfg.moe_experts:
        reasons.append("mixtures of experts (data-dependent routing)")
    if cfg.norm_placement == "post":
        reasons.append("post-LN")
    return "; ".join(reasons) or None


class StaticView(CacheView):
    """One layer's view of the step's cache: stores the rows' K/V at their slots, returns the whole static
    cache and the forward's mask (the same for every layer: a dense model keeps every key at every layer).
    A direct view (kv_cache.CacheView): in the q4 format the C kernels store and attend in place, the very
    calls of the dynamic engine, so the two give the same bits."""

    direct = True

    @property
    def c_attention(self) -> bool:
        return self.step.attention == "c"  # (Attention._forward_kernels: the q4 format's C calls, any format)

    def __init__(self, step: "DecodeStep", layer: int) -> None:
        self.step, self.layer = step, layer

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.step.k[self.layer]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.step.v[self.layer]

    @property
    def query_slots(self) -> torch.Tensor:
        return self.step.cur_slots

    @property
    def length(self) -> int:
        return self.step.k.shape[3]

    def finish(self, M: int, device: torch.device) -> torch.Tensor:
        return self.step.slot_mask()

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.step
        kl, vl = st.k[self.layer], st.v[self.layer]  # [B, Hk, S, d]
        # [B, N] batch and slot indices around a sliced head dim: both sides are [B, N, Hk, d]. Padded rows
        # all write the scratch slot; which of them lands there does not matter (no real row reads it).
        kl[st.rows_b, :, st.cur_slots] = k.transpose(1, 2).to(kl.dtype)
        vl[st.rows_b, :, st.cur_slots] = v.transpose(1, 2).to(vl.dtype)
        return kl, vl

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kl, vl = self._store(k, v)
        return kl, vl, self.step.slot_mask()

    def attention(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kl, vl = self._store(k, v)
        return self.step.attend(q, kl, vl, self.layer)

    def fuses_rope(self, x: torch.Tensor) -> bool:
        # with the row-attention kernel, RoPE and the store are one kernel too (ops/fused_rows.py)
        return self.step.attention == "triton" and fused_rows.stores_into(x, self.k_buffer)

    def rope_targets(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        st = self.step
        return st.k[self.layer], st.v[self.layer], st.cur_slots

    def attend_rotated(self, module, q: torch.Tensor) -> torch.Tensor:
        st = self.step
        return st.attend(q.transpose(1, 2), st.k[self.layer], st.v[self.layer], self.layer)


@dataclass
class TreeTensors:
    """A draft tree laid out for a bucket of N rows, as the device tensors `DecodeStep.verify` reads. Row 0 is
    the root, row i + 1 node i; with hidden transfer's fused pass (k steps of A anchors' pseudo rows: every
    tree row's, or the `anchors` given), the n + 1 tree rows are followed by k blocks of A pseudo rows, the
    pseudo row of anchor j, step i at row n + 1 + (i - 1) A + j; then padding. The first T = `tree_rows` rows
    are what the acceptance reads (pseudo rows among them are never nodes). Built once per tree shape
    (`DecodeStep.tree_tensors`)."""

    n_nodes: int
    tree_rows: int  # T
    k: int  # hidden transfer's steps laid out (0: none)
    head_rows: int  # rows the LM head reads (round_layout)
    rows_used: int  # slots past the root's the round writes, compaction included (round_slots)
    reach: int  # the largest position offset of a row from the root
    pseudo: tuple[int, int]  # (n + 1, A): the first pseudo row and the pseudo rows a step (live_rows); (0, 0): none
    vis: torch.Tensor  # [N, N] bool: row i sees row j (the tree's ancestors-or-self; the root)
    parent: torch.Tensor  # [N] long: parent row (root and others: 0)
    depth: torch.Tensor  # [N] long: position offset from the root (pseudo (a, i): depth of a + i)
    real: torch.Tensor  # [N] bool: not padding
    is_node: torch.Tensor  # [N] bool: the tree's nodes
    path: torch.Tensor  # [N, N] long: rows at positions root.., -1 where none (past the depth, a masked step)
    join_src: torch.Tensor  # [N] long: a pseudo row's anchor row (others 0)
    join_step: torch.Tensor  # [N] long: a pseudo row's step (others 0)
    prow: torch.Tensor  # [N, max(k, 1)] long: the pseudo rows tree row a drafts depths 1..k from (anchor_shifts)


class DecodeStep:
    """The static decode step of a dense model and the KV cache it owns (module docstring).

    `forward` is the capturable computation; `run` pads to a bucket and dispatches to it (eagerly, through
    a captured CUDA graph per bucket, or through torch.compile, by `graphs`); `prefill`, `decode` and
    `verify` are what generation calls."""

    def __init__(self, model: Transformer, *, batch: int = 1, max_len: int | None = None,
                 buckets: Sequence[int] | str = "auto", graphs: str = "eager", attn_rows: int | None = None,
                 attention: str | None = None, linear: str | None = None) -> None:
        why = unsupported(model)
        if why:
            raise ValueError(f"the static decode step does not run {why}; use the dynamic path (generate.py)")
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
        dev = model.tok_embeddings.weight.device
        if graphs == "cudagraph" and dev.type != "cuda":
            raise ValueError(f"graphs='cudagraph' needs the model on CUDA, not {dev.type}")
        self.invariant: bool | None = None  # measured row invariance (None: buckets given, not measured)
        if buckets == "auto" and (attn_rows is not None or attention is not None or linear is not None):
            raise ValueError("attn_rows, attention and linear go with buckets given; buckets='auto' lets the probe "
                             "choose")
        if buckets == "auto":  # (attn_rows, the attention and the linears too: the probe chooses them all)
            (buckets, attn_rows, attention, linear), self.invariant = invariant_buckets(
                model, model.cfg.max_seq_len if max_len is None else max_len, graphs)
        elif isinstance(buckets, str):
            raise ValueError(f"buckets: 'auto' or a sequence of row counts, got {buckets!r}")
        self.attention, self.linear = _check_kernels(model, attention or "torch", linear or "torch")
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be positive row counts, got {buckets}")
        if attn_rows is not None and (attn_rows < 1 or any(b % attn_rows for b in buckets)):
            raise ValueError(f"attn_rows must be a positive row count that divides every bucket, got {attn_rows} "
                             f"with buckets {buckets}")
        self.attn_rows = attn_rows  # None: each of `attend`'s GEMMs is one over the bucket's rows
        cfg = model.cfg
        max_len = cfg.max_seq_len if max_len is None else int(max_len)
        if max_len < 1 or batch < 1:
            raise ValueError(f"max_len and batch must be >= 1, got {max_len} and {batch}")
        self.model, self.buckets, self.graphs, self.batch = model, buckets, graphs, batch
        self.max_len, self.scratch = max_len, max_len  # slots 0..max_len-1, then the scratch slot
        S = max_len + 1
        dtype = kv_dtype(model)  # (the q4 format's fp16, as the dynamic engine's cache holds)
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, S, cfg.head_dim)
        self.k = torch.zeros(shape, device=dev, dtype=dtype)
        self.v = torch.zeros(shape, device=dev, dtype=dtype)
        self.held = torch.zeros(batch, S, dtype=torch.bool, device=dev)
        self.slot_ids = torch.arange(S, device=dev)
        self.window = min(MAX_TAIL, buckets[-1])  # W of `attend`
        self._constants(dev)
        self.views = [StaticView(self, layer) for layer in range(cfg.n_layers)]
        # set by each forward, read by the views (tensors, not host values)
        self.rows_b = self.cur_slots = self.cur_mask = self.cur_cos = self.cur_sin = None
        self.cur_keys = self.cur_kmask = self.cur_split = self.cur_pos = self.cur_carry = None  # (carry: `_settle`)
        self.cur_start: torch.Tensor | None = None  # (`blocks`' start)
        self._rows_state: tuple | None = None  # every row's state (`blocks`), of which cur_* hold the present rows
        self.cur_live: tuple[int, ...] | None = None  # the rows present at each block (`live_rows`), or None: all
        self._trees: dict[tuple, TreeTensors] = {}
        self._runners: dict[tuple, object] = {}
        self.device_rounds: dict[tuple, tuple] = {}  # speculative.static.DeviceRounds built on this step (memo)
        self.device = dev
        if graphs == "compile":
            # one compiled entry per bucket and kind of call: more than dynamo's default of 8 recompiles
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
            # the cache is written in place: static addresses keep CUDA graphs on under reduce-overhead
            for t in (self.k, self.v, self.held, self.attn_counts):
                torch._dynamo.mark_static_address(t)
        # hidden transfer's fused pass (`attach`): its maps, the blocks where its rows join, this forward's joins
        self.transfer = None
        self.join_at: dict[int, list[int]] = {}
        self.cur_join: tuple[torch.Tensor, torch.Tensor] | None = None
        # the probe's tap (`_tap`): [L, B, largest bucket, H * d] fp32, each layer's `attend` result, or None
        self.tap: torch.Tensor | None = None
        # queue a decode step (or round) before reading the last one's tokens (`_tokens`,
        # `DeviceRounds.run`): on a GPU the host's work then overlaps the device's; on a CPU nothing would
        self.run_ahead = dev.type == "cuda"

    # ------------------------------------------------------------------------------------- the step
    @torch.no_grad()  # (inference only; `attend` writes its GEMMs with out=, which autograd refuses)
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                path: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, join_src: torch.Tensor | None = None,
                join_step: torch.Tensor | None = None, head_rows: int | None = None, pseudo: tuple[int, int] = (0, 0)
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The capturable step. tokens, positions, slots [B, N] (long); start (a long scalar): the first slot of
        this forward, every held slot before it being committed text at the position of its index; the rows'
        structure, shared by the batch: path [N, N] (row i's ancestors-or-self, root first, as row indices),
        depth [N] (row i sees the committed slots and path[i, :depth[i] + 1], at positions start..), real [N]
        (False: padding); path entries -1 are positions the row does not see. Hidden transfer's fused pass
        (`attach`): join_src, join_step [N]: at block t_i, the rows of step i (join_step == i) take W_i of the
        residual of row join_src. head_rows (a Python int, static): only the first head_rows rows go through
        the LM head. pseudo (Python ints, static; (0, 0): none): with hidden transfer's rows, the first pseudo
        row and the pseudo rows a step (`TreeTensors.pseudo`), and each block runs the rows present there
        (`live_rows`). Returns
        (logits [B, head_rows or N, V], the final residual before the last norm [B, N, d]).
        Writes the rows' K/V at their slots; `held` is left as it is (what a forward commits is the caller's:
        `decode`, `verify`). No host read, no data-dependent branch. A call depends on the held slots before
        `start` only, so running it twice gives the same result (a CUDA graph's warm-up does)."""
        B, N = tokens.shape
        # row i's key at position start + j sits at the slot of row path[i, j] of this forward
        path_slots = slots.gather(1, path.clamp_min(0).reshape(1, N * N).expand(B, N * N)).view(B, N, N)
        h = self.blocks(tokens, positions, slots, start, torch.where(path >= 0, path_slots, self.none), depth, real,
                        join_src, join_step, pseudo=pseudo)
        m = self.model
        with self.kernels():
            return m.output(m.norm(h if head_rows is None else h[:, :head_rows])), h

    @torch.no_grad()
    def blocks(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
               path_slots: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, join_src: torch.Tensor | None = None,
               join_step: torch.Tensor | None = None, *, stop: int | None = None, run=None,
               pseudo: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """`forward`'s blocks, with the rows' keys given by slot: path_slots [B, N, Wp] (long), the slot holding
        row i's key at position start + j for j <= depth[i] (-1: it sees none there), so a row may see keys
        that no row of this forward wrote (a drafter's level reads the levels before it: speculative/static.py).
        stop, run (static): only blocks l < stop with run(l) run (`Transformer.run_blocks`; skipped blocks pass
        the residual on). pseudo: `forward`'s. Returns the residual leaving the last block run [B, N, d], before
        the final norm."""
        m = self.model
        B, N = tokens.shape
        S = self.slot_ids.shape[0]
        p = self.slot_ids
        # Each row's keys in position order: keys[b, i, p] is the slot that holds row i's key at position p,
        # kmask[b, i, p] 0 where the row sees it (row_attention.reference_keys; with the row-attention kernel,
        # its own kernel). Padding sees the scratch slot alone (a finite softmax).
        if self.attention == "triton":
            keys, kmask = row_attention.row_keys(path_slots, depth, real, self.held, start, self.scratch)
        else:
            keys, kmask = row_attention.reference_keys(path_slots, depth, real, self.held, start, self.scratch, p)
        # `attend`'s split of the values, the same at every layer (built once per forward, not once per layer):
        # below s0 = position - (W - 1) the shared GEMM, from s0 on a W-key window per row in position order
        # (the row-attention kernel reads `keys` itself, and no split: none of its kernels are launched there)
        split = None
        if self.attention != "triton":
            s0 = (positions - (self.window - 1)).clamp_min(0)  # [B, N]
            W = self.window  # (<= the largest bucket: row_ids holds 0..W-1)
            wpos = (s0[..., None] + self.row_ids[:W]).clamp_max(S - 1)  # [B, N, W]: positions s0 .. s0 + W - 1
            split = (p < s0[..., None], wpos, keys.gather(2, wpos))  # (below [B, N, S], the window's keys)
        # (join_src first: a plain forward never reads the transfer, so a compiled one does not guard on it)
        join = None if join_src is None or self.transfer is None else (join_src, join_step)
        # every row's state, of which `_present` gives the blocks the rows present (cur_pos: the row-attention
        # kernel reads each row's keys up to its own position)
        self._rows_state = (m.rope_cos[positions][:, None], m.rope_sin[positions][:, None], keys, kmask, positions,
                            slots, self.batch_ids[:B].expand_as(slots), split, join)
        self.cur_live = None if join is None or not pseudo[1] else live_rows(
            *pseudo, N, self.join_at, m.cfg.n_layers, self.buckets)
        R = N if self.cur_live is None else self.cur_live[0]
        self._present(R)
        self.cur_start = start  # (the row-attention kernel reads committed text at its own slots)
        self.cur_carry = None
        with self.kernels():
            h = self._settle(m.run_blocks(m.embed(tokens[:, :R], positions[:, :R]), self._block, stop=stop, run=run))
            return h if stop is not None else self._join(m.cfg.n_layers, h)  # rows that join after the last block

    def _present(self, R: int) -> None:
        """The forward's per-row state (`blocks`) for its first R rows, the rows present at the next block
        (`live_rows`); the mask by slot, if a kernel reads it, is built again for them (`slot_mask`)."""
        cos, sin, keys, kmask, pos, slots, rows_b, split, join = self._rows_state
        self.cur_cos, self.cur_sin = cos[:, :, :R], sin[:, :, :R]
        self.cur_keys, self.cur_kmask, self.cur_pos, self.cur_slots, self.rows_b = (
            t[:, :R] for t in (keys, kmask, pos, slots, rows_b))
        self.cur_split = None if split is None else tuple(t[:, :R] for t in split)
        self.cur_join = None if join is None else (join[0][:R], join[1][:R])
        self.cur_mask = None  # (built on first use: only q4's C kernels read it)

    def kernels(self) -> contextlib.ExitStack:
        """The context a forward runs in (and a device round, speculative/static.py, whose draft modules then
        take them too): with attention="triton", the row-wise kernels (ops/fused_rows.py: RMSNorm, SwiGLU's
        product, RoPE with the store); with linear="triton", every F.linear goes to the row-linear kernel
        (ops/row_linear.py: a TorchFunctionMode), and with both, each norm (with the residual add before it)
        and SwiGLU's product are the next projection's prologue (fused_rows.fuses_linear: Block.forward,
        FeedForward.down); with linear="c", every fp32 or bf16 F.linear goes to the CPU's C kernel
        (kernels.linear_rows, through the same mode). The model's own code runs unchanged but for asking where
        those apply."""
        stack = contextlib.ExitStack()  # (empty: the PyTorch ops, nothing entered)
        if self.attention == "triton":
            stack.enter_context(fused_rows.active(linear=self.linear == "triton"))
        if self.linear == "triton":
            stack.enter_context(row_linear.RowLinears())
        elif self.linear == "c":
            stack.enter_context(row_linear.RowLinears(c_kernels.linear_rows, c_kernels.takes_linear))
        return stack

    def slot_mask(self) -> torch.Tensor:
        """This forward's visibility by slot, additive [B, 1, N, S]: what the C kernels of a direct view read
        (`StaticView.finish`). Built once per forward, on first use, from the position-order keys (a 0/1 sum:
        exact in any order), so the PyTorch path never pays for it."""
        if self.cur_mask is None:
            keys = self.cur_keys
            by_slot = torch.zeros(keys.shape, device=keys.device).scatter_add_(
                2, keys, (self.cur_kmask == 0).to(torch.float32))
            self.cur_mask = torch.where(by_slot > 0, 0.0, float("-inf"))[:, None]
        return self.cur_mask

    def attend(self, q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + mask) v for q [B, H, N, d] over the cache layer kl, vl [B, Hk, S, d], in
        fp32, with every reduction over a row's keys in POSITION order, so that a row's result is the same bits
        whether its keys were written by plain decoding (slots in position order) or sit in a tree's slots
        (a node's ancestors need not be adjacent): SIMD reductions assign terms to lanes by index, so the same
        nonzero terms at other indices round otherwise (seen: 6e-8 apart in fp32 and bf16, and a bf16 greedy
        output that left plain decoding's). The scores q.k are layout-free (one dot product each); they are
        gathered into position order for the softmax (one kernel: the max, the exponentials, their sum and the
        division, in position order). The weighted sum of values splits at s0 = position - (W - 1) (W: the
        largest bucket, at most MAX_TAIL), below which every key of every row is committed text at its own slot:
        one GEMM against the shared values there, and above it a W-key window of values gathered per row in
        position order.

        The rows run in groups of g = `attn_rows` rows (None: one group of all N), group-major, each group's
        rows ordered (row, head in the group), and the scores and the weighted sum below s0 are one GEMM per
        group: with attn_rows set, every bucket runs them in one shape, so a BLAS that picks its kernel by the
        row count M cannot give a row other bits in another bucket. The window's products run in chunks of at
        most WINDOW_ROWS rows (an H200's batched GEMM changed kernel by the count of products, issue 42). The
        softmax, the gathers and the masks run once over all groups (row-wise or elementwise kernels: exact at
        any row count). `layer`: where the probe's tap (`tap`) records the fp32 result. Returns [B, H, N, d] (a
        view of [B, N, H, d], the layout the output projection reads)."""
        B, H, N, d = q.shape
        tapped = self.tap is not None and layer is not None
        if self.attention == "triton":  # the same formula as one kernel, each row reduced alone (ops/row_attention.py)
            # (stored in q's dtype unless tapped: one rounding, the bits of the cast below, one kernel fewer)
            out = row_attention.row_attention(q, kl, vl, self.cur_keys, self.cur_kmask, self.cur_pos,
                                              dtype=torch.float32 if tapped else q.dtype, counts=self.attn_counts,
                                              start=self.cur_start)
        else:
            out = self._attend_ops(q, kl, vl)
        out = out.view(B, N, H * d)
        if tapped:
            self.tap[layer, :, :N].copy_(out)
        return out.to(q.dtype).view(B, N, H, d).transpose(1, 2)

    def _attend_ops(self, q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor) -> torch.Tensor:
        """`attend` in PyTorch ops (its docstring): the fp32 result [B, N, H * d]."""
        B, H, N, d = q.shape
        Hk, S = kl.shape[1], kl.shape[2]
        rep, W = H // Hk, self.window
        g = self.attn_rows or N
        G, R, f32 = N // g, g * rep, torch.float32
        kf, vf = kl.float(), vl.float()
        below, wpos, wslots = self.cur_split  # [B, N, S] bool, [B, N, W] positions and slots (`blocks`)

        def by_group(t: torch.Tensor) -> torch.Tensor:  # [B, N, X] -> [G, B, 1, g, 1, X]
            return t.view(B, G, g, t.shape[-1]).transpose(0, 1)[:, :, None, :, None]

        # the queries group-major, [G, B * Hk, g * rep, d] (head h = kv head h // rep, as SDPA's GQA): one copy
        qg = torch.empty(G, B, Hk, g, rep, d, device=q.device, dtype=f32)
        qg.copy_(q.view(B, Hk, rep, G, g, d).permute(3, 0, 1, 4, 2, 5))
        qg = qg.view(G, B * Hk, R, d)
        scores = torch.empty(G, B * Hk, R, S, device=q.device, dtype=f32)
        kT = kf.reshape(B * Hk, S, d).transpose(1, 2)
        for i in range(G):
            torch.bmm(qg[i], kT, out=scores[i])
        shape = (G, B, Hk, g, rep, S)
        # mask + scale * score in one kernel: the scaled score rounds once, as a multiply then + 0 would
        s_pos = torch.add(by_group(self.cur_kmask), scores.view(shape).gather(-1, by_group(self.cur_keys).expand(
            shape)), alpha=d ** -0.5)
        prob = torch.softmax(s_pos, -1)  # one kernel; masked keys: exp(-inf) = 0
        pb = (prob * by_group(below)).view(G, B * Hk, R, S)
        vb = vf.reshape(B * Hk, S, d)
        res = torch.empty(G, B * Hk, R, d, device=q.device, dtype=f32)
        for i in range(G):
            torch.bmm(pb[i], vb, out=res[i])
        # the window: per row, its W probabilities [rep, W] and values [W, d], gathered in position order, in
        # chunks of c rows (at most WINDOW_ROWS; each a batched GEMM of B * c * Hk products), laid out
        # [G, chunk, B, c, ...] so that each chunk's operands are contiguous
        c = min(g, WINDOW_ROWS)
        while g % c:  # (a bucket that is no multiple of WINDOW_ROWS: the largest chunk that divides it)
            c -= 1
        nc = g // c
        chunked = (G, nc, B, c)
        v_win = vf[None, None, :, None].expand(*chunked, Hk, S, d).gather(5, wslots.view(B, G, nc, c, W).permute(
            1, 2, 0, 3, 4)[..., None, :, None].expand(*chunked, Hk, W, d))
        # (window positions past the cache were clamped to S - 1, the scratch slot's position, which no row
        # sees: their probability is 0, and the scratch slot's values are finite)
        p_win = prob.view(G, B, Hk, nc, c, rep, S).permute(0, 3, 1, 4, 2, 5, 6).gather(-1, wpos.view(
            B, G, nc, c, W).permute(1, 2, 0, 3, 4)[..., None, None, :].expand(*chunked, Hk, rep, W))
        win = torch.empty(G, nc, B * c * Hk, rep, d, device=q.device, dtype=f32)
        for i in range(G):
            for j in range(nc):
                torch.bmm(p_win[i, j].view(B * c * Hk, rep, W), v_win[i, j].view(B * c * Hk, W, d), out=win[i, j])
        out = (win.view(*chunked, Hk, rep, d).transpose(1, 2)
               + res.view(G, B, Hk, nc, c, rep, d).permute(0, 1, 3, 4, 2, 5, 6))  # [G, B, nc, c, Hk, rep, d]
        return out.transpose(0, 1).reshape(B, N, H * d)  # (a copy only when B > 1 and G or the chunks are > 1)

    def _block(self, layer: int, block, h: torch.Tensor, gate: torch.Tensor | None,
               key_bias: torch.Tensor | None) -> torch.Tensor:
        # Each block leaves its last residual add to the next (defer / carry): with the row-wise kernels that
        # add and the next block's first norm are one kernel, 29 fewer a SmolLM2 step (benchmarks/step_kernels.py)
        h, self.cur_carry = block(self._join(layer, h), self.cur_cos, self.cur_sin, None, None, self.views[layer],
                                  carry=self.cur_carry, defer=True)
        return h

    def _settle(self, h: torch.Tensor) -> torch.Tensor:
        """h with the residual term that `_block` left pending (`cur_carry`: Block.forward's defer / carry)
        added: the residual itself."""
        carry, self.cur_carry = self.cur_carry, None
        return h if carry is None else h + carry

    def _join(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Hidden transfer (arXiv 2404.12022 sec. 3.4): entering block t_i, the pseudo rows of step i become
        W_i h of their anchor row. Before it they are placeholders that no other row reads (a tree row never
        sees a pseudo row; a pseudo row sees its anchor's earlier steps, which exist wherever it does, as
        t_1 <= t_2 <= ...), so the static shape costs compute there, not correctness. With `pseudo` given,
        the forward runs only the rows present at each block (`live_rows`): here the next bucket's rows join, as
        placeholders (zeros) that the joining steps' rows then fill."""
        grow = self.cur_live is not None and self.cur_live[layer] > h.shape[1]
        if self.cur_join is None or (layer not in self.join_at and not grow):
            return h
        h = self._settle(h)  # (the anchors' residual)
        if grow:
            B, R, d = h.shape
            h = torch.cat([h, h.new_zeros(B, self.cur_live[layer] - R, d)], 1)
            self._present(self.cur_live[layer])
        if layer not in self.join_at:
            return h
        src, step = self.cur_join
        anchors = h.index_select(1, src)
        for i in self.join_at[layer]:
            h = torch.where((step == i)[None, :, None], self.transfer.transfer(anchors, i).to(h.dtype), h)
        return h

    def detach(self) -> None:
        """Verification rounds without hidden transfer's pseudo rows again."""
        self._use_transfer(None)

    def attach(self, drafter) -> None:
        """Run hidden transfer's fused pass in this step's verification rounds (`verify(fused=True)`): the
        drafter's maps and the blocks where each step's rows join. Captured rounds are kept per transfer."""
        self._use_transfer(drafter.transfer)

    def _use_transfer(self, transfer) -> None:
        """The transfer whose joins the verification rounds run (None: none). A captured or compiled round
        bakes in the joins it ran, so `_runner` keys verification rounds by the transfer: switching between
        drafters (a benchmark's rows, prompt after prompt) replays what each captured instead of capturing it
        again inside a timed generation. Plain forwards never read it (`blocks`)."""
        if transfer is not self.transfer:
            # keep the rounds of this transfer and of the one it replaces (a benchmark alternates two), no more:
            # each captured round holds a memory pool, and a drafter made per prompt would pile them up
            keep = {_transfer_key(transfer), _transfer_key(self.transfer)}
            self._runners = {k: v for k, v in self._runners.items() if k[0] != "verify" or k[-1] in keep}
            self.transfer, self.join_at = transfer, {} if transfer is None else transfer.steps_at(transfer.k)

    def verify_round(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                     vis: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, real: torch.Tensor,
                     is_node: torch.Tensor, path: torch.Tensor, join_src: torch.Tensor, join_step: torch.Tensor,
                     prow: torch.Tensor, tree_rows: int = 0, head_rows: int = 0, pseudo: tuple[int, int] = (0, 0)
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One speculative round at batch 1, all on the device: the forward over [root, nodes, padding] (and,
        with hidden transfer attached, the pseudo rows of its anchors), the greedy acceptance of the
        deepest path whose every node is the base's argmax at its parent (ties: the first in row order;
        ops/acceptance.py), the compaction of the root and that path to slots start.., and their `held`.
        tree_rows (static): the first T rows hold the tree's (past its root and nodes, and after them, pseudo rows
        and padding, never accepted); vis, parent and is_node describe them; head_rows (static, >= T): the rows the LM head reads
        (`round_layout`); pseudo (static): `TreeTensors.pseudo`. Returns (packed [T + 1] = [accepted count a, path
        tokens (T - 1, the first a real), bonus], path rows [T] (-1 beyond a), logits [1, T, V], hidden [1, N, d],
        and the next draft's logits [k, V'] from the pseudo rows the last accepted row drafts from (`prow`), or an
        empty tensor)."""
        T = tree_rows or tokens.shape[1]
        logits, hidden = self.forward(tokens, positions, slots, start, path, depth, real, join_src, join_step,
                                      head_rows=head_rows or T, pseudo=pseudo)
        logits = logits[:, :T]
        target = logits[0].argmax(-1)  # [T]: torch's first-maximum rule, as generate's greedy choice
        # the acceptance (ops/acceptance.py: one kernel where the step runs its kernels, else its PyTorch formula)
        accept = acceptance.accept if self.attention == "triton" else acceptance.reference
        packed, rows, src, dst, keep, best = accept(tokens[0, :T], target, parent, is_node, vis, depth, path,
                                                    slots[0], start)
        # Compaction: the kept rows' K/V move to start..start+T-1 (index_select copies first, so overlapping
        # source and destination slots are safe); only the first a + 1 of them become held.
        self.k.index_copy_(3, dst, self.k.index_select(3, src))
        self.v.index_copy_(3, dst, self.v.index_select(3, src))
        self.held[0].index_copy_(0, dst, keep)
        draft = hidden.new_empty(0)  # (no kernel)
        if self.transfer is not None:  # the next draft: the pseudo rows of the last accepted row's anchor

            anchor_rows = hidden[0].index_select(0, prow.index_select(0, best)[0])  # [k, d]
            draft = head_logits(self.transfer, self.model, self.model.norm(anchor_rows))
        return packed, rows, logits, hidden, draft

    # ---------------------------------------------------------------------------------- dispatching
    def bucket_for(self, n: int) -> int:
        return bucket_for(n, self.buckets)

    def _runner(self, kind: str, N: int, tree_rows: int = 0, head_rows: int = 0, pseudo: tuple[int, int] = (0, 0)):
        """The callable that runs `kind` ("forward" / "decode" / "verify") at bucket N (and, for "verify",
        with the first `tree_rows` rows the tree's, the LM head over the first `head_rows`, and hidden transfer's
        rows laid out as `pseudo` says), per `graphs`."""
        key = (kind, N, tree_rows, head_rows, pseudo, _transfer_key(self.transfer) if kind == "verify" else None)
        fn = self._runners.get(key)
        if fn is None:
            base = {"forward": self.forward, "decode": self.decode_fn}.get(kind) or functools.partial(
                self.verify_round, tree_rows=tree_rows, head_rows=head_rows, pseudo=pseudo)
            fn = self._runners[key] = self.capture(base)
        return fn

    def capture(self, fn):
        """`fn` (a function of device tensors with no host read) run as `graphs` says: eagerly, through a
        torch.cuda.CUDAGraph captured on its first call, or through torch.compile(fullgraph=True) (with CUDA
        graphs, mode="reduce-overhead", on CUDA). What the step's own calls and a device round
        (speculative/static.py) are run through."""
        if self.graphs == "compile":
            return torch.compile(fn, mode="reduce-overhead" if self.device.type == "cuda" else None,
                                 fullgraph=True, dynamic=False)
        if self.graphs == "cudagraph":
            return _CudaGraph(fn)
        return fn

    def _scalar(self, x: int) -> torch.Tensor:
        return torch.tensor(int(x), dtype=torch.long, device=self.device)

    def reset(self) -> None:
        """Forget every committed slot (a new sequence). Buffers and captured graphs stay."""
        self.held.zero_()

    def _constants(self, dev: torch.device) -> None:
        """What every forward reads, made once, not per forward: a captured step replays each tensor made inside
        it as a kernel (a Python number in torch.where is one too: scalar_tensor)."""
        B, top = self.batch, max(self.buckets)
        self.batch_ids = torch.arange(B, device=dev)[:, None]
        self.row_ids = torch.arange(top, device=dev)  # (a bucket's rows)
        self.none = torch.tensor(-1, device=dev)  # (a row's key where it sees none)
        self.zero, self.scratch_at = torch.tensor(0, device=dev), torch.tensor(self.scratch, device=dev)
        self.pad_zeros = torch.zeros(B, top, dtype=torch.long, device=dev)  # (`_pad`'s padding)
        self.pad_scratch = torch.full((B, top), self.scratch, dtype=torch.long, device=dev)
        # the row-attention kernel's counters (ops/row_attention.py: zero between its launches), for every launch
        self.attn_counts = torch.zeros(B * top * self.model.cfg.n_kv_heads, dtype=torch.int32, device=dev)

    # ------------------------------------------------------------------------------- what generation calls
    def _pad(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, N: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, n = tokens.shape
        if n == N:
            return tokens, positions, slots
        zeros = self.pad_zeros[:B, :N - n]  # padding rows: token 0 at position 0, written to the scratch slot
        return (torch.cat([tokens, zeros], 1), torch.cat([positions, zeros], 1),
                torch.cat([slots, self.pad_scratch[:B, :N - n]], 1))

    def _chain(self, n: int, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(path, depth, real) of n rows causal among themselves (a prompt chunk, a decoded token) in bucket N."""
        key = ("chain", n, N)
        t = self._trees.get(key)
        if t is None:
            i = torch.arange(N)
            path = torch.where(i[None, :] <= i[:, None], i[None, :], 0)
            t = self._trees[key] = (path.to(self.device), torch.where(i < n, i, 0).to(self.device),
                                    (i < n).to(self.device))
        return t

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit `tokens` [B, P] (one prompt length for the batch) at slots and positions start..start+P-1,
        in chunks of the largest bucket. Returns (logits [B, P, V], hidden [B, P, d]) of every row."""
        B, P = tokens.shape
        if B != self.batch:
            raise ValueError(f"{B} prompts for a step of batch {self.batch}")
        if start + P > self.max_len:
            raise ValueError(f"{start + P} slots needed, the step holds {self.max_len}")
        self._within_context(start + P - 1)
        N = self.window  # every row within W - 1 positions of its chunk's start (`attend`)
        outs, hids = [], []
        for a in range(0, P, N):
            n = min(N, P - a)
            Nb = self.bucket_for(n)
            idx = torch.arange(start + a, start + a + n, device=self.device)[None].expand(B, n)
            t, p, s = self._pad(tokens[:, a:a + n].to(self.device), idx, idx, Nb)
            # (under graphs="compile" the prefill runs eagerly: one compile per bucket would cost every prompt
            # length's chunk sizes a compile, and prefill is one call per chunk, not per token)
            run = self.forward if self.graphs == "compile" else self._runner("forward", Nb)
            logits, hidden = run(t, p, s, self._scalar(start + a), *self._chain(n, Nb))
            self.held[:, start + a:start + a + n] = True
            outs.append(logits[:, :n].clone())
            hids.append(hidden[:, :n].clone())
        return torch.cat(outs, 1), torch.cat(hids, 1)

    def decode_fn(self, tokens: torch.Tensor, pos: torch.Tensor, path: torch.Tensor, depth: torch.Tensor,
                  real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The capturable decode step (`_runner("decode")`): tokens [B] committed at position and slot `pos` (a
        long scalar) in row 0 of the smallest bucket (path, depth, real: its `_chain(1, N)`), padded by `_pad`.
        Returns (logits [B, V], final residual [B, d], the greedy next tokens [B]). The padding, `held` and the
        argmax run inside, so a captured decode is one replay and no host read."""
        B = tokens.shape[0]
        at = pos.view(1, 1).expand(B, 1)  # (the position is the slot)
        toks, positions, slots = self._pad(tokens.view(B, 1), at, at, real.shape[0])
        logits, hidden = self.forward(toks, positions, slots, pos, path, depth, real)
        self.held.index_fill_(1, pos.view(1), True)
        logits = logits[:, 0]
        return logits, hidden[:, 0], logits.argmax(-1)  # (torch's first maximum, as generate's greedy choice)

    def _within_context(self, last: int) -> None:
        """Refuse a call whose last position is past the model's context, before anything is written: a step may
        hold more slots than the context (a round's rows past the accepted ones), but RoPE's tables end at it (an
        IndexError on the CPU, a device assert on CUDA). forward_cached's rule and message."""
        ctx = self.model.cfg.max_seq_len
        if last >= ctx:
            raise ValueError(f"position {last} is beyond the model's context of {ctx} tokens")

    def _decode(self, tokens: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= pos < self.max_len:
            raise ValueError(f"position {pos} outside the step's {self.max_len} slots")
        self._within_context(pos)
        N = self.buckets[0]
        # (`slot_ids[pos]`, a view, is the position on the device: a host-made tensor would be a copy to the
        # device per token, which waits for the GPU's queue to drain)
        return self._runner("decode", N)(tokens.reshape(self.batch).to(self.device), self.slot_ids[pos],
                                         *self._chain(1, N))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit one token per row, tokens [B] at position and slot `pos`; returns (logits [B, V], hidden
        [B, d]). Runs in the smallest bucket, the step of verification."""
        logits, hidden, _ = self._decode(tokens, pos)
        return logits.clone(), hidden.clone()  # (a captured graph's outputs are overwritten)

    @torch.no_grad()
    def greedy(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """`decode`, returning only the greedy next tokens [B], on the device: nothing is read to the host, so
        the caller can queue the next step before it reads this one's token (`static_stream`)."""
        return self._decode(tokens, pos)[2].clone()

    def tree_tensors(self, parent: Sequence[int], depth: Sequence[int], k: int = 0, masked: bool = False,
                     anchors: Sequence[int] | None = None) -> TreeTensors:
        """The device layout of a tree given by its nodes' parents (-1: the root) and depths, with k steps of
        hidden transfer's pseudo rows for each of the `anchors` (tree rows; None: every one; `masked`: a pseudo
        row does not see its earlier steps). A row that is no anchor drafts from its anchor (`anchor_shifts`)."""
        n = len(parent)
        anchors = tuple(range(n + 1)) if anchors is None or not k else tuple(anchors)
        A = len(anchors)
        T, N, head_rows = round_layout(n, k, self.buckets, A)
        key = ("tree", tuple(parent), k, masked, N, anchors)
        t = self._trees.get(key)
        if t is not None:  # (a host round asks every round: the layout, and its shifts, are built once)
            return t
        shifts = anchor_shifts(parent, depth, anchors)
        par = [0] + [p + 1 for p in parent]
        dep = torch.zeros(N, dtype=torch.long)
        dep[1:n + 1] = torch.as_tensor(list(depth), dtype=torch.long)
        vis = torch.eye(N, dtype=torch.bool)
        path = torch.full((N, N), -1, dtype=torch.long)
        path[:, 0] = torch.arange(N)  # padding: itself (never real)
        path[0, 0] = 0
        for r in range(1, n + 1):  # rows come after their parents (breadth-first)
            vis[r] |= vis[par[r]]
            vis[r, 0] = True
            chain = vis[r, :n + 1].nonzero().flatten()  # ancestors-or-self in row order = by depth
            path[r, :len(chain)] = chain
        parent_t = torch.zeros(N, dtype=torch.long)
        parent_t[1:n + 1] = torch.as_tensor(par[1:], dtype=torch.long)
        real = torch.zeros(N, dtype=torch.bool)
        real[:n + 1] = True
        is_node = real.clone()
        is_node[0] = False
        join_src = torch.zeros(N, dtype=torch.long)
        join_step = torch.zeros(N, dtype=torch.long)
        prow = torch.zeros(N, max(k, 1), dtype=torch.long)

        def row(j: int, i: int) -> int:  # anchor j's pseudo row of step i
            return n + 1 + (i - 1) * A + j

        for i in range(1, k + 1):
            for j, a in enumerate(anchors):
                r = row(j, i)
                real[r], join_src[r], join_step[r] = True, a, i
                da = int(dep[a])
                dep[r] = da + i
                path[r] = -1
                path[r, :da + 1] = path[a, :da + 1]
                for s in range(1 if not masked else i, i + 1):  # its anchor's earlier steps, then itself
                    path[r, da + s] = row(j, s)
        for a, (j, delta) in enumerate(shifts if k else ()):
            prow[a] = torch.tensor([row(j, min(i + delta, k)) for i in range(1, k + 1)])
        dev = self.device
        t = TreeTensors(n, T, k, head_rows, max(T, n + 1 + A * k), int(dep.max()), (n + 1, A) if k else (0, 0),
                        vis.to(dev), parent_t.to(dev), dep.to(dev), real.to(dev), is_node.to(dev), path.to(dev),
                        join_src.to(dev), join_step.to(dev), prow.to(dev))
        if len(self._trees) > 256:  # dynamic trees change every round: keep the memo bounded
            self._trees.clear()
        self._trees[key] = t
        return t

    @torch.no_grad()
    def verify(self, root: int, nodes: Sequence[int], tree: TreeTensors, last_pos: int, start: int
               ) -> tuple[list[int], int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Verify [root, nodes] (root at position last_pos, node i at last_pos + its depth) written at slots
        start.., accept on the device, compact. One host read. Returns (accepted tokens, bonus, path rows
        [a + 1] (device), logits [a + 1, V], hidden [a + 1, d]) of the root and the accepted nodes, and the
        next draft's logits [k, V'] when the tree carries hidden transfer's pseudo rows (else None)."""
        N, T, n = tree.vis.shape[0], tree.tree_rows, tree.n_nodes
        if start + tree.rows_used > self.max_len:
            raise ValueError(f"the step holds {self.max_len} slots; a round at slot {start} needs "
                             f"{start + tree.rows_used}")
        if tree.reach >= self.window:
            raise ValueError(f"a round's rows reach {tree.reach} positions past its root; the step's attention "
                             f"window holds {self.window - 1}")
        self._within_context(last_pos + tree.reach)
        dev = self.device
        tokens = torch.zeros(1, N, dtype=torch.long)
        tokens[0, 0] = int(root)
        tokens[0, 1:n + 1] = torch.as_tensor(list(nodes), dtype=torch.long)
        positions = (last_pos + tree.depth).masked_fill(~tree.real, 0)[None]
        slots = torch.where(tree.real, start + torch.arange(N, device=dev), self.scratch)[None]
        packed, rows, logits, hidden, draft = self._runner("verify", N, T, tree.head_rows, tree.pseudo)(
            tokens.to(dev), positions, slots, self._scalar(start), tree.vis, tree.parent, tree.depth,
            tree.real, tree.is_node, tree.path, tree.join_src, tree.join_step, tree.prow)
        host = packed.tolist()  # the one read of the round
        a = host[0]
        keep = rows[:a + 1]
        return (host[1:1 + a], host[-1], keep, logits[0, keep], hidden[0, keep],
                draft.clone() if tree.k and draft.numel() else None)

    @torch.no_grad()
    def row_invariant(self, n_probe: int = 3, seed: int = 0) -> bool:
        """Whether a row's logits, and its fp32 attention at every layer (`_tap`), are the same bits in every
        bucket and at every place in it: a probe over random tokens, with random keys and values committed in
        every slot before the row's (restores nothing: call before use, or `reset` after). Every slot, because a
        kernel that splits the reduction over the keys (split-K) rounds differently only where more than one of
        its parts holds nonzero terms: with 8 committed keys and zeros after them, as this probe had, such a
        split is invisible. First each linear's rows on cancelling operands (`_linears_match`), where the logits
        hide a bf16 GEMM's order. Places: the row at the start, middle and end of each bucket beside random padding
        rows, then N copies of it filling the bucket (every place at once). Then, at batch 1, verification
        rounds against plain decoding in every bucket (`_rounds_match_plain`); a step of several sequences
        (batch > 1) runs no rounds, so its verdict covers forwards alone."""
        g = torch.Generator().manual_seed(seed)
        self._tap(True)
        try:
            ok = (self._linears_match(g) and self._forwards_match(g, n_probe)
                  and (self.batch != 1 or self._rounds_match_plain(g)))
        finally:
            self.reset()
            self._tap(False)
        return ok

    def _tap(self, on: bool) -> None:
        """Turn the probe's tap on or off: with it on, `attend` also writes each layer's fp32 result to `tap`,
        and the probe compares those bits too. In bf16 the cast after `attend` hides most differences of an
        fp32 ulp or two (a row's bf16 output moves only where one crosses a rounding boundary), so a probe of
        the logits alone passed an H200's bf16 step whose fp32 attention GEMMs were not row-invariant, while
        128-token generations left plain decoding (issue 42). Runners are rebuilt either way (a captured graph
        bakes in whether it taps)."""
        cfg = self.model.cfg
        self.tap = torch.zeros(cfg.n_layers, self.batch, max(self.buckets), cfg.n_heads * cfg.head_dim,
                               device=self.device) if on else None
        self._runners.clear()

    def _linears_match(self, g: torch.Generator, rows: int = 64) -> bool:
        """Whether each of the model's linears (one per weight shape; as the step runs them, `kernels`) gives a
        row the same bits in every bucket as in the first, on rows built so that the order of the sum shows.
        Row r aims at output column j = r mod N: two of its inputs are w[j, k2] 2^a and -w[j, k1] 2^a (bf16 and
        fp32 hold them exactly), whose products with w[j, k1] and w[j, k2] cancel exactly, each about 2^26,
        beside terms of about 1. A sum that adds the small terms after both large ones keeps them; one that adds
        some to a partial sum holding one large term loses them in its rounding (an fp32 ulp at 2^26 is 8). So
        two orders of the sum give column j results apart by several units, where on random rows they are apart
        by an fp32 ulp or two, which a bf16 output's rounding hides nearly always. Seen on an AMX Xeon: PyTorch's
        bf16 linear at one row and at three or more gave other bf16 bits on about 1 element in 40,000 of random
        rows (64 x 32 and 64 x 64 weights), which the logits and the attention's fp32 tap did not show, and the
        tiny model's speculative output left plain output on 1 of 3 prompts (62nd session)."""
        mods: dict[tuple, torch.nn.Linear] = {}  # (shape, dtype) -> the first linear of it
        for mod in self.model.modules():
            if isinstance(mod, torch.nn.Linear) and mod.weight.dtype in (torch.float32, torch.bfloat16):
                mods.setdefault((tuple(mod.weight.shape), mod.weight.dtype), mod)
        M = max(self.buckets)
        with torch.no_grad(), self.kernels():
            for mod in mods.values():
                w = mod.weight.detach()
                N, K = w.shape
                x = torch.randn(M, K, generator=g).to(w.dtype)
                if K >= 2:
                    j = torch.arange(M) % N
                    k1 = torch.randint(0, K, (M,), generator=g)
                    k2 = (k1 + 1 + torch.randint(0, K - 1, (M,), generator=g)) % K
                    w1, w2 = (w[j.to(w.device), kk.to(w.device)].float().cpu() for kk in (k1, k2))  # (not all of w)
                    big = (w1 * w2).abs().clamp_min(2.0 ** -60)
                    scale = torch.exp2(26 - torch.floor(torch.log2(big)))
                    ok = (w1 != 0) & (w2 != 0)
                    r = torch.arange(M)
                    x[r[ok], k1[ok]] = (w2 * scale)[ok].to(w.dtype)
                    x[r[ok], k2[ok]] = (-w1 * scale)[ok].to(w.dtype)
                x = x.to(w.device)[None]  # [1, M, K]: a forward's rows
                b0 = self.buckets[0]
                n = min(rows, M)
                ref = torch.cat([mod(x[:, i:i + b0]) for i in range(0, n, b0)], 1)[:, :n]
                for m in self.buckets[1:]:
                    if not torch.equal(mod(x[:, :m])[:, :min(m, n)], ref[:, :min(m, n)]):
                        return False
        return True

    def _forwards_match(self, g: torch.Generator, n_probe: int) -> bool:
        """The probe's first half (`row_invariant`): one random row's logits and tapped attention in every
        bucket, at a few places beside random padding rows, then as N copies filling the bucket."""
        V = self.model.cfg.vocab_size
        ctx = min(self.max_len, self.model.cfg.max_seq_len) - 1  # the probe row's position and slot
        self._commit_random(self._random_kv(g, ctx), ctx)
        probe = torch.randint(0, V, (self.batch, 1), generator=g).to(self.device)
        ref = ref_tap = None
        for N in self.buckets:
            for place in sorted({0, N // 2, N - 1})[:n_probe]:
                toks = torch.randint(0, V, (self.batch, N), generator=g).to(self.device)
                toks[:, place] = probe[:, 0]
                pos = torch.full((self.batch, N), ctx, dtype=torch.long, device=self.device)
                slots = torch.full((self.batch, N), self.scratch, dtype=torch.long, device=self.device)
                slots[:, place] = ctx  # the probe row's own slot; the others are padding
                path = torch.zeros(N, N, dtype=torch.long, device=self.device)
                path[place, 0] = place
                real = torch.arange(N, device=self.device) == place
                logits, _ = self._runner("forward", N)(toks, pos, slots, self._scalar(ctx), path,
                                                      torch.zeros(N, dtype=torch.long, device=self.device), real)
                row, tapped = logits[:, place].clone(), self.tap[:, :, place].clone()
                if ref is None:
                    ref, ref_tap = row, tapped
                elif not (torch.equal(row, ref) and torch.equal(tapped, ref_tap)):
                    return False
            # and every place at once: N copies of the probe row (each sees the committed keys and itself; they
            # write the same K/V to its slot), every one of which must give the same bits
            ar = torch.arange(N, device=self.device)
            path = torch.zeros(N, N, dtype=torch.long, device=self.device)
            path[:, 0] = ar
            at = torch.full((self.batch, N), ctx, device=self.device)  # (the position and the slot)
            logits, _ = self._runner("forward", N)(probe.expand(self.batch, N).contiguous(), at, at, self._scalar(ctx),
                                                  path, torch.zeros_like(ar), torch.ones_like(ar, dtype=torch.bool))
            if not (bool((logits == ref[:, None]).all()) and bool((self.tap[:, :, :N] == ref_tap[:, :, None]).all())):
                return False
        return True

    def _rounds_match_plain(self, g: torch.Generator, depth: int = 3, pseudo: int = 3) -> bool:
        """The probe's second half, on the path generation takes: plain decoding's logits against a
        verification round's, bit for bit, in every bucket a round of this step can use, through the step's own
        runners (so captured where the step is). Random keys and values are committed in the slots before a
        short random prompt, as deep as each round leaves room for (so that the round's rows have keys below
        `attend`'s window, in its GEMM over the cache, once the step holds more than W slots). Plain decoding
        commits `depth` greedy tokens after the prompt; a round then verifies them from the prompt's last token
        as a chain, its tree filled with wrong leaves under the root, and must accept the chain with plain
        decoding's logits at every row. (A row of the chain at depth j sees its ancestors through this
        forward's own K/V, as a draft's rows do; the first half's probe row sees committed keys only.) Then
        the same with `pseudo` steps of hidden transfer's pseudo rows per tree row (round_layout: more rows than
        the tree's, the head over the tree's alone), here placeholders that no transfer fills: the tree rows
        never see them. A round this step cannot hold at all is not run."""
        V, P = self.model.cfg.vocab_size, 4
        top = max(self.buckets)
        layouts = [(N - 1, 0) for N in self.buckets]  # (nodes, pseudo steps): every bucket filled by a tree
        fits = [b - 1 for b in self.buckets if b * (pseudo + 1) <= top] or [15]
        layouts += [(n, pseudo) for n in fits if pseudo]
        plans = []  # (the committed slots before the prompt, nodes, tree)
        for n, k in layouts:
            if n < depth:
                continue
            try:
                tt = self.tree_tensors([j - 1 for j in range(depth)] + [-1] * (n - depth),
                                       list(range(1, depth + 1)) + [1] * (n - depth), k)
            except ValueError:  # more rows than the largest bucket: a round this step cannot run
                continue
            C = min(self.max_len - tt.rows_used - (P - 1), self.model.cfg.max_seq_len - P - depth - k - 1)
            if C >= 0:
                plans.append((C, n, tt))
        if not plans:
            return True
        prompt = torch.randint(0, V, (1, P), generator=g)
        noise = self._random_kv(g, max(C for C, _, _ in plans))
        refs: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        transfer = self.transfer
        self._use_transfer(None)  # (placeholders: no transfer joins the pseudo rows)
        try:
            for C, n, tt in plans:
                if C not in refs:  # plain decoding after the same committed slots and prompt
                    self._commit_random(noise, C)
                    want, chain = [self.prefill(prompt, C)[0][0, -1]], []
                    taps = [self.tap[:, 0, P - 1].clone()]  # (the prompt is one chunk: P rows)
                    for j in range(depth):
                        chain.append(int(want[-1].argmax(-1)))
                        want.append(self.decode(torch.tensor([chain[-1]]), C + P + j)[0][0])
                        taps.append(self.tap[:, 0, 0].clone())
                    refs[C] = (want, chain, torch.stack(taps, 1))
                want, chain, taps = refs[C]
                nodes = chain + [(chain[0] + 1 + i % (V - 1)) % V for i in range(n - depth)]
                self._commit_random(noise, C)
                self.prefill(prompt[:, :-1], C)
                last = C + P - 1
                accepted, _, _, logits, _, _ = self.verify(int(prompt[0, -1]), nodes, tt, last, last)
                if accepted != chain or not all(torch.equal(a, b) for a, b in zip(logits, want)):
                    return False
                if not torch.equal(self.tap[:, 0, :depth + 1], taps):  # root, then the chain's rows 1..depth
                    return False
        finally:
            self.reset()
            self._use_transfer(transfer)
        return True

    def _random_kv(self, g: torch.Generator, n: int) -> list[torch.Tensor]:
        """Random keys and values for the first n slots of every layer (the probe's committed text)."""
        return [torch.randn(t[:, :, :, :n].shape, generator=g).to(t.device, t.dtype) for t in (self.k, self.v)]

    def _commit_random(self, kv: list[torch.Tensor], n: int) -> None:
        """A new sequence whose first n slots are committed with the first n of `kv` (`_random_kv`)."""
        self.reset()
        for t, x in zip((self.k, self.v), kv):
            t[:, :, :, :n] = x[:, :, :, :n]
        self.held[:, :n] = True


# ======================================================================================= generation
def step_for(model: Transformer, need: int, step: DecodeStep | None, **kw) -> DecodeStep:
    """`step` (reset) when it holds `need` slots, else a new step of exactly that many."""
    if step is not None:
        if step.model is not model or step.batch != 1:
            raise ValueError("the step given was built for another model or batch size")
        if step.max_len < need:
            raise ValueError(f"the step given holds {step.max_len} slots; this call needs {need}")
        step.reset()
        return step
    return DecodeStep(model, max_len=need, **kw)


@torch.no_grad()
def static_stream(model: Transformer, prompt: Sequence[int], cfg=None, *, step: DecodeStep | None = None,
                  **step_kw) -> Iterator[int]:
    """Yield one prompt's new tokens as they are decoded through the static step (a stop token is yielded
    and ends it; at most max_new_tokens, and no more than the context allows). Greedy decoding takes the
    argmax of the step's logits, sampling `generate.sample_next` with a seeded generator. `step`: a step to
    reuse (its captured graphs too); else one sized to the call. `step_kw` go to DecodeStep (buckets,
    graphs)."""

    cfg = cfg or GenerationConfig()
    model.eval()
    prompt = validate_prompts(model, [prompt])[0]
    P = len(prompt)
    budget = min(cfg.max_new_tokens, model.cfg.max_seq_len - P + 1)
    if budget <= 0:
        return
    # the prompt's slots and one per new token but the last, which is never fed (`_tokens`, run-ahead too): a
    # step of the whole context serves every generation within it
    st = step_for(model, P + budget - 1, step, **step_kw)
    logits = st.prefill(torch.tensor([prompt], device=st.device))[0][:, -1]
    if cfg.temperature == 0:
        yield from _tokens(st, logits.argmax(-1), P, budget, cfg.stop_tokens, st.greedy)
        return
    gen = cfg.generator(st.device)

    def sample(logits: torch.Tensor) -> torch.Tensor:  # (on the device: no host read)
        return sample_next(logits.float(), cfg.temperature, cfg.top_k, cfg.top_p, gen)

    yield from _tokens(st, sample(logits), P, budget, cfg.stop_tokens, lambda t, pos: sample(st.decode(t, pos)[0]))


def _tokens(st: DecodeStep, tok: torch.Tensor, P: int, budget: int, stop: Sequence[int],
            step: Callable[[torch.Tensor, int], torch.Tensor]) -> Iterator[int]:
    """Decoding from `tok` [1] (the token at position P, on the device), `step(tok, pos)` giving the next token
    on the device (greedy: `DecodeStep.greedy`; sampling: a draw from `decode`'s logits): one host read per
    token. With `st.run_ahead` the step that decodes token i is queued before token i is read, so on a GPU the
    host's work for the next step overlaps the running one, as when no token is read at all (the CUDA-graph
    recipe's loop). The step queued behind a stop token is undone: its slot is released, leaving the cache as
    without run-ahead (a sampler's generator, local to the call, has then drawn once more). The same steps, so
    the same tokens."""
    nxt = None
    for i in range(budget):
        last = i == budget - 1
        if st.run_ahead and not last:
            nxt = step(tok, P + i)  # queued before the read below
        t = int(tok[0])  # the one host read of the step
        if t in stop or last:
            if nxt is not None:
                st.held[:, P + i] = False  # (the queued step committed the stop token; plain decoding does not)
            yield t
            return
        yield t
        tok = nxt if nxt is not None else step(tok, P + i)


def static_generate(model: Transformer, prompts: Sequence[Sequence[int]], cfg=None, *,
                    step: DecodeStep | None = None, **step_kw) -> list[list[int]]:
    """`generate.generate` through the static step (`static_stream`), one prompt at a time (batch 1): the same
    contract, new tokens per prompt."""

    return [list(static_stream(model, p, cfg, step=step, **step_kw)) for p in validate_prompts(model, prompts)]


class _CudaGraph:
    """`fn` captured in a torch.cuda.CUDAGraph on its first call (after warm-up on a side stream), replayed
    after copying the arguments into the graph's static input buffers. The warm-up and capture run on the
    first call's own inputs, so the first call's effect on the cache happens three times over: harmless, as
    the step's writes are idempotent (the same K/V at the same slots, the same `held` values)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.graph = None
        self.inputs: list[torch.Tensor] = []
        self.outputs = None

    def __call__(self, *args: torch.Tensor):
        if self.graph is None:
            self.inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.fn(*self.inputs)
        else:
            for dst, src in zip(self.inputs, args):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
        self.graph.replay()
        return self.outputs


__all__ = ["DecodeStep", "bucket_for", "round_layout", "live_rows", "round_slots", "any_round_slots", "StaticView",
           "static_stream", "static_generate", "TreeTensors", "BUCKET_CANDIDATES", "GRAPH_MODES", "StepKernels",
           "invariant_buckets", "unsupported"]

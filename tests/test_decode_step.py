"""The static-shape decode step (midlayer/engine/decode_step.py, issue 42): capturable (torch.compile fullgraph, no
graph break), row-invariant where the probe says so, equal to the dynamic engine where both are exact, and
lossless: speculative output equals plain output token for token, in fp32 and in q4."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from tiny_models import (device_drafters, make_tiny, noisy_transfer, NoisyOracle, OracleDrafter, RandomDrafter,
                         RowWiseBLAS)

from midlayer.engine.decode_step import (any_round_slots, ATTN_ROWS, BUCKET_CANDIDATES, DecodeStep, STEP_CANDIDATES,
                                        StepKernels, bucket_for, invariant_buckets, static_generate)
from midlayer.speculative.static import static_speculative_generate
from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads
from midlayer.speculative.eagle import EagleDrafter, EagleHead
from midlayer.engine.generate import GenerationConfig, forward_cached, generate
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.engine.quantization import compress_weights
from midlayer.speculative.protocol import Draft
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.protocol import Drafter
from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
from midlayer.speculative.layer_skip import LayerSkipDrafter
from midlayer.speculative.verify import speculative_generate

V = 96
DIMS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=160, multiple_of=32)
TREES = [DraftTree.chain(3), DraftTree.greedy_from_accuracies([[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]], 12)]


@pytest.fixture(scope="module")
def models() -> dict:
    base = make_tiny(DIMS, False)
    return {"fp32": compress_weights(copy.deepcopy(base), "fp32"), "q4": compress_weights(copy.deepcopy(base), "q4")}


def _room(drafter, tree: DraftTree) -> int:
    """The slots past the committed text that a round of `drafter` on `tree` needs under any bucket set the probe
    may choose: its buckets depend on the machine's BLAS (from 8 rows on an AMD EPYC, from 32 on an AVX-512
    Xeon, where hidden transfer's rounds then take more slots)."""
    from midlayer.speculative.static import fused_steps, round_nodes

    return any_round_slots(round_nodes(drafter, tree), fused_steps(drafter))


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 5, 70)]


# ------------------------------------------------------------------------------------- capturability
SIXTEEN = [-1, -1, -1, 0, 0, 1, 2, 3, 5, 6]


@pytest.mark.parametrize("parents,attn_rows,linear,attention", [
    ([-1, -1, 0, 1, 2], None, "torch", "torch"), (SIXTEEN, None, "torch", "torch"), (SIXTEEN, 8, "torch", "torch"),
    (SIXTEEN, None, "c", "torch"), (SIXTEEN, None, "c", "c")],
    ids=["N8", "N16", "N16-grouped", "N16-c-linear", "N16-c-attention"])
def test_step_and_round_trace_without_graph_breaks(models, parents, attn_rows, linear, attention):
    """The proxy for CUDA-graph capture: torch.compile(fullgraph=True) fails on any graph break (a host read,
    a data-dependent branch, a ctypes call). Dynamo's own tracing decides that; the eager backend keeps the
    test fast. The traced round returns what the eager round returns: the same decisions, and logits and K/V
    to float rounding (on the CPU the eager step's RMSNorm and SwiGLU are C calls; traced, they are PyTorch's
    ops: kernels._eligible). linear="c": the C linear is a custom op in the trace (kernels.linear_rows);
    attention="c": so are RoPE with the store and the attention (kernels.rope_store, attention_fused)."""
    model = models["fp32"]
    res = []
    for compiled in (False, True):
        st = DecodeStep(model, max_len=64, buckets=(8, 16), attn_rows=attn_rows, linear=linear, attention=attention)
        st.prefill(torch.arange(10)[None] % V)
        depth = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        tt = st.tree_tensors(parents, depth)
        N = tt.vis.shape[0]
        tokens = (torch.arange(N) * 7 % V)[None]
        pos = (10 + tt.depth)[None]
        slots = torch.where(tt.real, 10 + torch.arange(N), st.scratch)[None]
        fwd = torch.compile(st.forward, backend="eager", fullgraph=True) if compiled else st.forward
        rnd = torch.compile(st.verify_round, backend="eager", fullgraph=True) if compiled else st.verify_round
        with torch.no_grad():
            logits, _ = fwd(tokens, pos, slots, torch.tensor(10), tt.path, tt.depth, tt.real)
            packed = rnd(tokens, pos, slots, torch.tensor(10), tt.vis, tt.parent, tt.depth, tt.real, tt.is_node,
                         tt.path, tt.join_src, tt.join_step, tt.prow)[0]
        res.append((logits, packed, st.held.clone(), st.k.clone()))
    for a, b in zip(*res):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a, b)


def test_medusa_draft_step_traces_without_graph_breaks(models):
    model = models["fp32"]
    heads = MedusaHeads(DIMS["dim"], 3)
    torch.nn.init.normal_(heads.heads[0].weight, std=0.1)
    h = torch.randn(4, DIMS["dim"])
    with torch.no_grad():
        eager = heads.logits(model, h)
        traced = torch.compile(lambda x: heads.logits(model, x), backend="eager", fullgraph=True)(h)
    torch.testing.assert_close(eager, traced, atol=1e-5, rtol=1e-5)  # (the C RMSNorm eagerly, PyTorch's traced)


DEVICE_KINDS = ["eagle-2", "eagle", "medusa", "hidden-transfer", "early-exit", "layer-skip"]


@pytest.mark.parametrize("kind", DEVICE_KINDS + ["hidden-transfer, 2 anchors"])
def test_a_device_round_traces_without_graph_breaks(models, kind):
    """A whole device round (speculative/static.py: the draft, the verification, the acceptance, the
    compaction and what the next round drafts from) under torch.compile(fullgraph=True): the same round as
    eagerly, from the same state. (Hidden transfer with 2 anchors: 32 rows at every block where every row's
    pseudo rows take 16, 32 and 64.)"""
    from midlayer.speculative.static import DeviceRounds

    model = models["fp32"]
    ht = kind.startswith("hidden-transfer")
    drafter = device_drafters(model)["hidden-transfer" if ht else kind]
    drafter.anchors = 2 if kind.endswith("anchors") else 0
    tree = TREES[1]
    prompt = _prompts()[2][:20]
    res = []
    for compiled in (False, True):
        step = DecodeStep(model, max_len=96, buckets=(8, 16, 32, 64))
        if ht:
            step.attach(drafter)
        rounds = DeviceRounds.for_step(step, drafter, tree)
        assert not ht or rounds.draft.pseudo == (13, 13 if not drafter.anchors else 2)
        _, hidden = step.prefill(torch.tensor([prompt[:-1]]))
        draft = None
        if ht:  # the first round: the root alone, whose pseudo rows are the first draft
            *_, draft = step.verify(prompt[-1], [], step.tree_tensors([], [], 3), len(prompt) - 1, len(prompt) - 1)
            hidden = hidden[0]
        carry = rounds.draft.first(list(prompt), hidden if ht else hidden[0], draft)
        fn = torch.compile(rounds.round, backend="eager", fullgraph=True) if compiled else rounds.round
        with torch.no_grad():
            out = fn(step._scalar(prompt[-1]), step._scalar(len(prompt) - 1), *carry)
        res.append((out, step.k.clone(), step.held.clone()))
    (a, ka, ha), (b, kb, hb) = res
    assert torch.equal(a[0], b[0]) and torch.equal(ha, hb)  # the same acceptance, tokens and commits
    for x, y in zip(a[1:], b[1:]):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)  # (the C RMSNorm eagerly, PyTorch's traced)
        else:
            assert torch.equal(x, y)
    torch.testing.assert_close(ka, kb, atol=1e-4, rtol=1e-4)


def _token_paths(nodes: list[int], parent_rows: list[int]) -> frozenset:
    """A draft tree as the set of its nodes' token paths from the root (parent_rows: row numbering, root 0)."""
    paths: dict[int, tuple] = {0: ()}
    for i, t in enumerate(nodes):
        paths[i + 1] = paths[parent_rows[i + 1]] + (t,)
    return frozenset(paths[r] for r in range(1, len(nodes) + 1))


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_device_rounds_draft_what_the_host_drafts(models, fmt, kind):
    """Round by round, the device rounds verify the trees the host rounds (`propose`) verify: the same token
    paths (EAGLE's static tree, and EAGLE-2's dynamic one: its expansion and reranking on the device; early
    exit's and layer skip's level-by-level fill through the step's own blocks), so the same acceptance;
    and both give plain greedy decoding's tokens. The self-speculative drafters' host rounds are the dynamic
    engine's (`speculative_generate`: their `propose` runs the model on its KV cache). (The host prunes the
    last rounds to the budget, the device does not: those rounds are not compared.)"""
    from midlayer.speculative.static import DeviceRounds
    from midlayer.speculative.verify import draft_node_tokens, round_tree

    model = models[fmt]
    drafter = device_drafters(model)[kind]
    tree = TREES[1]
    cfg = GenerationConfig(max_new_tokens=40)
    for prompt in _prompts():
        ref = static_generate(model, [prompt], cfg)[0]
        trees: dict[bool, list] = {}
        for device in (False, True):
            seen, pruned = trees[device] = [], []
            step = DecodeStep(model, max_len=len(prompt) + 40 + _room(drafter, tree))
            propose = drafter.propose

            def host(ctx):
                d = propose(ctx)
                t = round_tree(d, ctx.tree)
                seen.append(_token_paths(draft_node_tokens(d, t)[0].tolist(), [0] + (t.parent + 1).tolist()))
                pruned.append(ctx.tree.max_depth < tree.max_depth and len(seen) > 1)
                return d

            drafter.propose = host
            if device:
                if kind == "hidden-transfer":
                    step.attach(drafter)
                dd = DeviceRounds.for_step(step, drafter, tree).draft
                made = type(dd).draft

                def on_device(*args):
                    nodes, fields = made(dd, *args)
                    seen.append(_token_paths(nodes.tolist(), fields[1].tolist()))
                    return nodes, fields

                dd.draft = on_device
            try:
                if drafter.reads_cache and not device:
                    out, stats = speculative_generate(model, prompt, drafter, tree, 40)
                else:
                    out, stats = static_speculative_generate(model, prompt, drafter, tree, 40, step=step,
                                                             device_rounds=device)
            finally:
                del drafter.propose
            assert out == ref
            assert len(seen) == stats.base_forwards
        host, pruned = trees[False]
        n = pruned.index(True) if True in pruned else len(host)  # the host prunes the rounds near the budget
        assert n > 5 and host[:n] == trees[True][0][:n]


@pytest.mark.parametrize("kind", ["plain", "sampling", "eagle-2", "medusa", "hidden-transfer"])
def test_run_ahead_gives_the_same_tokens_and_cache(models, kind):
    """Run-ahead (`DecodeStep.run_ahead`, the default on CUDA) queues the next decode step (greedy or sampled)
    or device round before it reads the last one's tokens. The tokens and the rounds' stats are those without it; where a stop
    token ends the generation behind a queued step, that step's commits are undone: the same held slots and
    the same K/V in them."""
    from midlayer.speculative.static import DeviceRounds

    model = models["fp32"]
    drafter = device_drafters(model)[kind] if kind in DEVICE_KINDS else None
    prompt, n = _prompts()[2][:30], 30
    sampling = dict(temperature=0.8, seed=5) if kind == "sampling" else {}
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=n, **sampling))[0]
    for stop in [(), (ref[9],), (ref[0],)]:
        res, calls = [], []
        for ahead in (False, True):
            st = DecodeStep(model, max_len=len(prompt) + n + (_room(drafter, TREES[1]) if drafter else 64))
            st.run_ahead = ahead
            count = [0]
            if drafter is None:
                name = "decode" if sampling else "greedy"
                fn = getattr(st, name)
                setattr(st, name, lambda *a: (count.__setitem__(0, count[0] + 1), fn(*a))[1])
                out = static_generate(model, [prompt], GenerationConfig(max_new_tokens=n, stop_tokens=stop,
                                                                        **sampling), step=st)[0]
                stats = ()
            else:
                if kind == "hidden-transfer":
                    st.attach(drafter)
                rounds = DeviceRounds.for_step(st, drafter, TREES[1])
                runner = rounds.runner
                rounds.runner = lambda *a: (count.__setitem__(0, count[0] + 1), runner(*a))[1]
                out, s = static_speculative_generate(model, prompt, drafter, TREES[1], n, stop, step=st)
                stats = (s.base_forwards, s.accept_hist)
            held = st.held.clone()
            res.append((out, stats, held, st.k[:, :, :, held[0]].clone()))
            calls.append(count[0])
        (out0, stats0, held0, k0), (out1, stats1, held1, k1) = res
        assert out1 == out0 and stats1 == stats0 and torch.equal(held1, held0) and torch.equal(k1, k0)
        assert out0 == ref[:len(out0)] and len(out0) == (ref.index(stop[0]) + 1 if stop else n)
        assert calls[0] > 0 or stop == (ref[0],)  # (hidden transfer's first round, on the host, may end it)
        if stop and calls[0]:
            assert calls[1] == calls[0] + 1  # one step or round was queued behind the stop, and undone


@pytest.mark.parametrize("kind", ["eagle-2", "hidden-transfer"])
def test_device_rounds_through_the_triton_kernels_are_lossless(models, kind, monkeypatch):
    """With attention="triton" a device round runs inside the step's kernels (`DecodeStep.kernels`): the
    verification's forward through the row-wise kernels and the row attention, and the draft's own layer
    (EAGLE's) through them too: its norms, and RoPE with the store into the draft cache (kv_cache.SlotView). The
    tokens are plain decoding's on the same step. (Triton's interpreter
    on a CPU: tests/conftest.py, where hidden transfer runs a chain, a 32-row round with its pseudo rows.)"""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    from midlayer.model.layers import RMSNorm
    from midlayer.ops import fused_rows
    from midlayer.speculative.static import DeviceRounds

    model = models["fp32"]
    drafter = device_drafters(model)[kind]
    prompt, n = _prompts()[2][:20], 10
    st = DecodeStep(model, max_len=63, buckets=(8, 16, 32), attention="triton")  # (64 slots: one chunk of keys)
    plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=n), step=st)[0]
    if kind == "hidden-transfer":
        st.attach(drafter)
    tree = TREES[0] if kind == "hidden-transfer" else TREES[1]
    rounds = DeviceRounds.for_step(st, drafter, tree)
    runner, in_round, seen, calls = rounds.runner, [False], [], [0]

    def round_(*a):  # (EAGLE's layer also runs outside the rounds: over the prompt, on the host)
        in_round[0] = True
        calls[0] += 1
        try:
            return runner(*a)
        finally:
            in_round[0] = False

    rounds.runner = round_
    norms = [m for m in drafter.layer.modules() if isinstance(m, RMSNorm)] if kind == "eagle-2" else []

    def hook(*a) -> None:
        if in_round[0]:
            seen.append(fused_rows._ACTIVE)

    rope, stores = fused_rows.rope_store, []

    def rope_store(qkv, cos, sin, n_heads, kc, vc, slots):  # (which cache each round's RoPE + store writes)
        if in_round[0]:
            stores.append(kc.shape[2])
        return rope(qkv, cos, sin, n_heads, kc, vc, slots)

    monkeypatch.setattr(fused_rows, "rope_store", rope_store)

    hooks = [m.register_forward_hook(hook) for m in norms]
    try:
        out, stats = static_speculative_generate(model, prompt, drafter, tree, n, step=st)
    finally:
        for h in hooks:
            h.remove()
    assert out == plain and stats.base_forwards < n
    assert all(seen) and (len(seen) > 0) == (kind == "eagle-2")  # (EAGLE's layer in a round: in the kernels)
    # the base's blocks write the step's cache; EAGLE's layer its own draft cache, as many times as its levels
    levels = tree.max_depth if kind == "eagle-2" else 0
    assert (stores.count(st.k.shape[3]), len(stores)) == (model.cfg.n_layers * calls[0],
                                                          (model.cfg.n_layers + levels) * calls[0])


@pytest.mark.parametrize("kind", ["eagle-2", "eagle"])
def test_eagles_draft_layer_attends_through_the_row_kernel_as_through_its_mask(models, kind, monkeypatch):
    """Where the step attends through its kernel, EAGLE's draft layer does too (`EagleRounds._keys`: each row's
    positions in order, a committed entry at its own slot, its ancestors-or-self at theirs): every round, the
    dynamic tree (EAGLE-2) or the static tree's tokens drafted so equal those drafted through the slot mask (the
    attention's other way) from the same state, and the kernel ran on the draft cache at every level. (Triton's
    interpreter on a CPU; `test_device_rounds_through_the_triton_kernels_are_lossless`: EAGLE-2's output so.)"""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    from midlayer.ops import row_attention
    from midlayer.speculative.static import DeviceRounds

    model = models["fp32"]
    drafter = device_drafters(model)[kind]
    tree = TREES[1]
    assert DeviceRounds.for_step(DecodeStep(model, max_len=40, buckets=(16,), attention="triton"), drafter,
                                 tree).draft.kernel
    # (the verifications through PyTorch's ops, which the draft does not read: the interpreter's time on the draft)
    st = DecodeStep(model, max_len=40, buckets=(16,))  # (a 12-node round: 13 rows)
    rounds = DeviceRounds.for_step(st, drafter, tree)
    draft, real_attention, launches, compared = rounds.draft, row_attention.row_attention, [], []
    assert not draft.kernel

    def counting(q, kl, *a, **kw):
        launches.append(kl.shape[2])
        return real_attention(q, kl, *a, **kw)

    monkeypatch.setattr(row_attention, "row_attention", counting)
    real_draft = type(draft).draft

    def both(self, *args):  # the mask's way first (the reference), then the kernel's, whose draft the round takes
        self.kernel = False
        try:
            ref = real_draft(self, *args)
        finally:
            self.kernel = True
        n = len(launches)
        out = real_draft(self, *args)
        assert launches[n:] == [self.kc.shape[2]] * tree.max_depth  # (the committed rows, then each level)
        assert torch.equal(out[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(out[1], ref[1]))
        compared.append(out[0].tolist())
        return out

    monkeypatch.setattr(type(draft), "draft", both)
    static_speculative_generate(model, _prompts()[2][:12], drafter, tree, 6, step=st)  # (lossless: the test above)
    assert len(compared) >= 2 and len(set(map(tuple, compared))) > 1


# ------------------------------------------------------------------------------------ row invariance
@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_a_row_is_the_same_bits_in_every_bucket_and_place(models, fmt):
    """In fp32 and q4 the CPU's buckets chosen by the probe are row-invariant here: a row's logits do not depend
    on how many rows share its forward or where it sits (the probe runs each bucket with the row at its start,
    middle and end, beside random rows), also at another cache size. q4's kernels are row-invariant at any row
    count, so plain decoding runs one row. In fp32 the choice is the machine BLAS's: the CPU's fp32 GEMV at one
    row rounds otherwise than 8 rows (on every CPU seen), so fp32 never runs one row through the BLAS; an AMD
    EPYC's MKL gave the tiny model's rows the same bits from 8 rows up, an AVX-512 Xeon's from 16, where the C
    fp32 linear (linear="c", from one row) is chosen. In fp32 the attention is the C kernels' where they are
    built (attention="c"; q4 attends through them in any case). Every cheaper candidate fails the probe."""
    from midlayer.engine.decode_step import c_attention_runs, kernels_run

    model = models[fmt]
    chosen, ok = invariant_buckets(model)
    assert ok
    cpu = [c for c in STEP_CANDIDATES if kernels_run(c, model)]  # (what the probe tries here)
    assert chosen in cpu
    if fmt == "q4":
        assert chosen == cpu[0] and chosen.buckets[0] == 1 and chosen.attention == "torch"
    else:
        assert chosen.attention == ("c" if c_attention_runs(model) else "torch")
        assert chosen.buckets[0] >= 8 or chosen.linear == "c"
        for c in cpu[:cpu.index(chosen)]:
            assert not DecodeStep(model, max_len=model.cfg.max_seq_len, buckets=c.buckets, attn_rows=c.attn_rows,
                                  attention=c.attention, linear=c.linear).row_invariant()
    buckets, rows = chosen.buckets, chosen.attn_rows
    st = DecodeStep(model, max_len=32, buckets=buckets, attn_rows=rows, attention=chosen.attention,
                    linear=chosen.linear)
    assert st.invariant is None and st.row_invariant()


def test_the_probe_catches_a_bucket_that_is_not_row_invariant(models):
    """The fp32 GEMM of one row (a GEMV) and of two rows round differently from 8 rows on this CPU: a step
    with buckets (1, 2, 8) is not row-invariant, and the probe says so. (If a BLAS ever made them agree this
    test would tell us the probe has nothing to catch.)"""
    assert not DecodeStep(models["fp32"], max_len=32, buckets=(1, 2, 8)).row_invariant()


class OrderByCount:
    """A stand-in bf16 BLAS whose linear sums a row's products in fp32 in the order of k, then rounds to bf16,
    except at one row, where it sums them in the reverse order: the same terms, another order, as PyTorch's bf16
    linear on an AMX Xeon at one row against three or more (62nd session). On random rows the two orders are an
    fp32 ulp or two apart, which the bf16 rounding hides nearly always."""

    def __init__(self) -> None:
        self._linear = torch.nn.functional.linear

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if torch._C._is_torch_function_mode_enabled():  # (a mode that routes F.linear sees the stand-in as it)
            return torch.overrides.handle_torch_function(torch.nn.functional.linear, (x, w), x, w, b)
        rows = x.reshape(-1, x.shape[-1])
        terms = rows.float()[:, None, :] * w.float()[None]  # [M, N, K]: each product exact in fp32
        out = torch.zeros(terms.shape[:2])
        for k in range(terms.shape[-1]) if rows.shape[0] > 1 else reversed(range(terms.shape[-1])):
            out = out + terms[..., k]  # (one fp32 add after another: PyTorch's cumsum adds in double on a CPU)
        out = out + (0 if b is None else b.float())
        return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def test_the_probe_sees_a_bf16_linear_that_sums_one_row_in_another_order(monkeypatch):
    """A bf16 linear that sums a lone row in another order than a bucket of rows (`OrderByCount`) passes the
    probe's forwards (logits and the attention's fp32 tap) in buckets from one row: the bf16 rounding hides
    the order. On rows built to cancel (`DecodeStep._linears_match`: two products of about 2^26 that cancel
    exactly beside terms of about 1), the two orders differ by units, and the probe fails those buckets and
    takes those from 8 rows. The tiny model's speculative output then equals plain output, token for token,
    where on the one-row buckets it need not."""
    monkeypatch.setattr(torch.nn.functional, "linear", OrderByCount().linear)
    model = make_tiny(DIMS, False).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    lone = DecodeStep(model, max_len=150, buckets=(1, 8, 16), attention="torch", linear="torch")
    lone._tap(True)  # (as `row_invariant` runs it)
    assert lone._forwards_match(g, 3)  # (what the probe was: blind to it)
    lone.reset()
    lone._tap(False)
    assert not lone._linears_match(g) and not lone.row_invariant()
    assert DecodeStep(model, max_len=150, buckets=(8, 16), attention="torch", linear="torch").row_invariant()
    kernels, ok = invariant_buckets(model, 150)
    assert ok and 1 not in kernels.buckets
    prompt = _prompts()[2]
    step = DecodeStep(model, max_len=150)
    plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=24), step=step)[0]
    for tree in TREES:
        out, _ = static_speculative_generate(model, prompt, NoisyOracle(prompt + plain, V), tree, 24, step=step)
        assert out == plain


def test_the_c_linear_mends_a_blas_that_rounds_rows_by_count(monkeypatch):
    """Under a BLAS whose fp32 linears round a row otherwise from 16 rows (RowWiseBLAS(from_rows=16)), as an
    AVX-512 Xeon's MKL does, the probe fails PyTorch's linears from one row and from 8, and chooses the CPU's C
    fp32 linear from one row (linear="c": kernels.linear_rows, row-invariant by construction), before the
    buckets of 32 rows and up; through that step every drafter's rounds give plain greedy output, token for
    token. A step asked for the C linear where it
    cannot run (a q4 model) is refused."""
    from midlayer.engine.decode_step import c_linear_runs

    RowWiseBLAS(from_rows=16).install(monkeypatch)
    model = make_tiny(DIMS, False)
    assert c_linear_runs(model)
    assert not DecodeStep(model, max_len=150, buckets=BUCKET_CANDIDATES[1]).row_invariant()
    assert invariant_buckets(model, 150) == (StepKernels(BUCKET_CANDIDATES[0], linear="c"), True)
    prompt = _prompts()[2]
    plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=24))[0]
    for kind, drafter in device_drafters(model).items():
        step = DecodeStep(model, max_len=len(prompt) + 24 + _room(drafter, TREES[1]), buckets=BUCKET_CANDIDATES[0],
                          linear="c")
        if kind == "hidden-transfer":
            step.attach(drafter)
        out, stats = static_speculative_generate(model, prompt, drafter, TREES[1], 24, step=step)
        assert out == plain, kind
    with pytest.raises(ValueError, match="linear='c'"):
        DecodeStep(compress_weights(copy.deepcopy(model), "q4"), max_len=32, buckets=(8,), linear="c")


def test_the_c_attention_replaces_attends_ops_and_stays_lossless(models, monkeypatch):
    """attention="c" runs the step's attention through the q4 format's C calls (Attention._forward_kernels: RoPE
    with the store, then the attention over the visible keys in slot order) for an fp32 model: `attend`'s
    PyTorch ops never run; the logits of a prompt and of plain decoding are `attend`'s, the naive reference, to
    fp32 rounding (the same formula, its sums in another order). Under a BLAS that rounds a row otherwise from
    16 rows the probe chooses it with the C linear from one row, and every drafter's rounds through that step
    give plain greedy output, token for token. A bf16 model's bf16 K/V too (the kernels round its stores to
    bf16 as torch does, and widen its reads exactly): its logits are `attend`'s to bf16 rounding, and its rounds
    give plain greedy output. A model whose projections are not fused is refused by name."""
    from midlayer.engine.decode_step import c_attention_runs
    from midlayer.ops import kernels

    if not kernels.available():
        pytest.skip(f"the C kernels are not built here: {kernels.unavailable_reason()}")
    model = models["fp32"]
    assert c_attention_runs(model)
    prompt = _prompts()[2]

    def decode(attention: str) -> tuple[list[torch.Tensor], list[int]]:
        st = DecodeStep(model, max_len=100, buckets=(8, 16), attention=attention)
        logits = [st.prefill(torch.tensor([prompt]))[0][0]]
        toks = [int(logits[0][-1].argmax())]
        for i in range(6):
            logits.append(st.decode(torch.tensor([toks[-1]]), len(prompt) + i)[0][0])
            toks.append(int(logits[-1].argmax()))
        return logits, toks

    ref, ref_toks = decode("torch")

    def attend_ran(*args):
        raise AssertionError("attend's PyTorch ops ran in a step with attention='c'")

    monkeypatch.setattr(DecodeStep, "_attend_ops", attend_ran)
    got, toks = decode("c")
    assert toks == ref_toks
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    RowWiseBLAS(from_rows=16).install(monkeypatch)
    assert invariant_buckets(copy.deepcopy(model), 150) == (StepKernels(BUCKET_CANDIDATES[0], attention="c",
                                                                        linear="c"), True)
    kw = dict(buckets=BUCKET_CANDIDATES[0], attention="c", linear="c")
    plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=24), **kw)[0]
    for kind, drafter in device_drafters(model).items():
        step = DecodeStep(model, max_len=len(prompt) + 24 + _room(drafter, TREES[1]), **kw)
        if kind == "hidden-transfer":
            step.attach(drafter)
        assert static_speculative_generate(model, prompt, drafter, TREES[1], 24, step=step)[0] == plain, kind
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert c_attention_runs(bf16)
    monkeypatch.undo()
    model = bf16
    ref, _ = decode("torch")
    monkeypatch.setattr(DecodeStep, "_attend_ops", attend_ran)
    got, _ = decode("c")
    for a, b in zip(got, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    kw = dict(buckets=BUCKET_CANDIDATES[0], attention="c")
    plain = static_generate(bf16, [prompt], GenerationConfig(max_new_tokens=24), **kw)[0]
    drafter = device_drafters(bf16)["eagle-2"]
    step = DecodeStep(bf16, max_len=len(prompt) + 24 + _room(drafter, TREES[1]), **kw)
    assert static_speculative_generate(bf16, prompt, drafter, TREES[1], 24, step=step)[0] == plain
    other = make_tiny(DIMS, False)
    assert not c_attention_runs(other)
    with pytest.raises(ValueError, match="attention='c'"):
        DecodeStep(other, max_len=32, buckets=(8,), attention="c")


class _SplitK:
    """A stand-in for a GPU BLAS that picks its kernel by the row count M (cuBLAS's split-K for small M): an
    fp32 product reducing over 48 or more terms is summed in two halves when it has at most 32 rows, in one
    pass when it has more: the same terms, rounded otherwise. The step's linears (F.linear) and its score GEMM
    (over the head dimension, 16) keep the real kernel; its weighted sum over the cache's slots and its window
    product (over W = 64 keys) get this one."""

    def __init__(self) -> None:
        self.matmul, self.bmm = torch.matmul, torch.bmm

    def product(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        K = a.shape[-1]
        if a.dtype != torch.float32 or K < 48 or a.shape[-2] > 32:
            r = self.matmul(a, b)
        else:
            r = self.matmul(a[..., :K // 2], b[..., :K // 2, :]) + self.matmul(a[..., K // 2:], b[..., K // 2:, :])
        return r if out is None else out.copy_(r)


def test_the_probe_sees_a_split_reduction_and_grouped_attention_mends_it(models, monkeypatch):
    """A weighted sum over the slots run in a kernel chosen by M (_SplitK, as cuBLAS may) is invisible to a
    probe that commits 8 keys and leaves zeros in the other slots (a split rounds zeros exactly). The probe,
    now over a cache committed in every slot, fails the one-GEMM attention under it; the buckets with the
    weighted sum in fixed groups of ATTN_ROWS rows pass, and `invariant_buckets` chooses them; and their
    output is still plain greedy output, token for token, under that kernel."""
    fake = _SplitK()
    monkeypatch.setattr(torch, "matmul", fake.product)
    monkeypatch.setattr(torch, "bmm", fake.product)
    model = make_tiny(DIMS, False)  # (unfused, so attention runs `attend`, not the CPU's C kernel)
    assert not DecodeStep(model, max_len=150, buckets=BUCKET_CANDIDATES[1]).row_invariant()
    assert DecodeStep(model, max_len=150, buckets=BUCKET_CANDIDATES[2], attn_rows=ATTN_ROWS).row_invariant()
    assert invariant_buckets(model, 150) == (StepKernels(BUCKET_CANDIDATES[2], ATTN_ROWS), True)
    prompt = _prompts()[2]
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=24))[0]
    for drafter in (OracleDrafter(prompt + ref, V), NoisyOracle(prompt + ref, V)):
        out, stats = static_speculative_generate(model, prompt, drafter, TREES[1], 24)
        assert out == ref and stats.row_invariant


class _Nudge:
    """A stand-in for a BLAS whose fp32 batched GEMM rounds its results an ulp otherwise when it has more than
    16 rows (another kernel for larger M, as cuBLAS's SGEMM on an H200: issue 42)."""

    def __init__(self) -> None:
        self.bmm = torch.bmm

    def product(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r = self.bmm(a, b)
        if a.dtype == torch.float32 and a.shape[-2] > 16:
            r = torch.nextafter(r, torch.full_like(r, float("inf")))
        return r if out is None else out.copy_(r)


def test_the_probes_tap_sees_what_bf16s_cast_hides(monkeypatch):
    """In a bf16 model `attend` runs in fp32 and casts its result to bf16, which hides a difference of an fp32
    ulp unless it crosses a bf16 rounding boundary. Under _Nudge a probe row's bf16 logits in buckets 8 and 16
    are the same bits while its fp32 attention is not (a probe of the logits alone passed such a step on an
    H200, and 128-token generations then left plain decoding). The probe taps the fp32 result, so it fails the
    one-GEMM buckets and passes attention in fixed groups of 32 rows (every GEMM of 64 rows: nudged alike)."""
    monkeypatch.setattr(torch, "bmm", _Nudge().product)
    model = make_tiny(DIMS, False).to(torch.bfloat16)  # (unfused: attention runs `attend`)
    step, ctx = DecodeStep(model, max_len=40, buckets=(8, 16)), 30
    step._tap(True)
    step._commit_random(step._random_kv(torch.Generator().manual_seed(0), ctx), ctx)
    seen = []
    for N in step.buckets:  # the probe row at place 0, beside padding, with keys below the window (W = 16)
        slots = torch.full((1, N), step.scratch)
        slots[0, 0] = ctx
        logits, _ = step.forward(torch.full((1, N), 5), torch.full((1, N), ctx), slots, step._scalar(ctx),
                                 torch.zeros(N, N, dtype=torch.long), torch.zeros(N, dtype=torch.long),
                                 torch.arange(N) == 0)
        seen.append((logits[0, 0].clone(), step.tap[:, 0, 0].clone()))
    assert torch.equal(seen[0][0], seen[1][0]) and not torch.equal(seen[0][1], seen[1][1])
    assert not step.row_invariant()
    assert DecodeStep(model, max_len=40, buckets=(32, 64), attn_rows=32).row_invariant()


class _ByCount(_Nudge):
    """A BLAS whose fp32 batched GEMM rounds otherwise (an ulp up) when it holds more than 64 products: an
    H200's cuBLAS gave the window's products of a row other bits from 192 products up (64 rows of SmolLM2's 3
    kv heads), and not up to 96 (benchmarks/row_invariance.py, issue 42)."""

    def product(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r = self.bmm(a, b)
        if a.dtype == torch.float32 and a.dim() == 3 and a.shape[0] > 64:
            r = torch.nextafter(r, torch.full_like(r, float("inf")))
        return r if out is None else out.copy_(r)


def test_the_window_products_run_in_chunks_of_window_rows(monkeypatch):
    """The window's products (one per row and kv head: 128 in a 64-row bucket of the tiny model) in chunks of
    WINDOW_ROWS = 32 rows (64 products) each: under _ByCount the probe passes the buckets 8 .. 64, and hidden
    transfer's 64-row rounds (a 12-node tree with 3 steps of pseudo rows) give plain greedy output. With the
    chunks as large as the bucket (one batched GEMM, as before), the probe fails the same buckets. (_ByCount
    over RowWiseBLAS: the products by count are the only rounding that depends on the bucket.)"""
    from midlayer.engine import decode_step
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    RowWiseBLAS().install(monkeypatch)
    monkeypatch.setattr(torch, "bmm", _ByCount().product)
    model, buckets = make_tiny(DIMS, False), (8, 16, 32, 64)  # (unfused: attention runs `attend`)
    step = DecodeStep(model, max_len=220, buckets=buckets)
    assert step.row_invariant()
    for prompt in _prompts()[1:]:
        plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=30), step=step)[0]
        drafter = HiddenTransferDrafter(model, _transfer([1, 1, 2], False))
        assert static_speculative_generate(model, prompt, drafter, TREES[1], 30, step=step)[0] == plain
    monkeypatch.setattr(decode_step, "WINDOW_ROWS", 64)
    assert not DecodeStep(model, max_len=220, buckets=buckets).row_invariant()


@pytest.mark.parametrize("where", ["32 rows up", "pseudo rows"])
def test_the_probe_compares_a_round_with_plain_decoding(models, monkeypatch, where):
    """A step whose verification rounds give other bits than plain decoding (a round's logits moved by 1e-6,
    as a kernel chosen by the round's shape would) passes the probe's first half, which runs forwards alone,
    and fails its second, which verifies a chain of plain decoding's own tokens in every bucket, also with
    hidden transfer's pseudo rows in the round (more rows than the tree's). Either way the buckets (8, 16)
    pass (no round of 32 rows, none with pseudo rows, fits them) and (8, 16, 32) fail (a 32-row round; a tree
    of 8 rows with 3 steps of pseudo rows); with no candidate left, `invariant_buckets` says so. (The q4
    model: its kernels give a row the same bits at any row count, on every CPU, so the nudge alone decides.)"""
    verify_round = DecodeStep.verify_round

    def off(self, tokens, *args, **kw):
        packed, rows, logits, hidden, draft = verify_round(self, tokens, *args, **kw)
        N, T = tokens.shape[1], kw.get("tree_rows") or tokens.shape[1]
        moved = N >= 32 if where == "32 rows up" else T < N
        return packed, rows, logits + 1e-6 * moved, hidden, draft

    monkeypatch.setattr(DecodeStep, "verify_round", off)
    model = copy.deepcopy(models["q4"])
    assert DecodeStep(model, max_len=300, buckets=(8, 16)).row_invariant()  # (no pseudo-row round fits)
    assert not DecodeStep(model, max_len=300, buckets=(8, 16, 32)).row_invariant()  # (8 tree rows + 24 pseudo)
    assert invariant_buckets(model, 300) == (StepKernels(BUCKET_CANDIDATES[-1]), False)
    assert DecodeStep(model, max_len=300).invariant is False


def test_the_probes_rounds_reach_the_attentions_gemm_over_the_cache(monkeypatch):
    """The rounds run after random keys committed as deep as each round leaves room for, so their rows have
    keys below `attend`'s window (the GEMM over the cache, which a small-row probe near position 0 never
    feeds), in plain decoding and in the rounds with and without pseudo rows. (On RowWiseBLAS: the buckets
    8 .. 64 are then row-invariant on every CPU.)"""
    RowWiseBLAS().install(monkeypatch)
    seen = []
    attend = DecodeStep.attend

    def spy(self, q, kl, vl, layer=None):
        seen.append((q.shape[2], bool(self.cur_split[0].any())))
        return attend(self, q, kl, vl, layer)

    monkeypatch.setattr(DecodeStep, "attend", spy)
    step = DecodeStep(make_tiny(DIMS, False), max_len=150, buckets=(8, 16, 32, 64))  # (unfused: `attend` runs)
    step._tap(True)  # (as `row_invariant` does)
    assert step._rounds_match_plain(torch.Generator().manual_seed(0))
    deep = {N for N, below in seen if below}
    assert {8, 16, 32, 64} <= deep  # plain decoding (8), rounds of 16 to 64 rows, pseudo rows among them


def test_the_probe_runs_in_the_steps_mode_where_it_can(models, monkeypatch):
    """A step compiled by torch.compile is probed eagerly (its kernels would cost a compile per bucket), and
    the verdict is kept per mode: an eager and a compile step share it; a captured step (CUDA only) is probed
    through captured graphs."""
    seen = []
    probe = DecodeStep.row_invariant
    monkeypatch.setattr(DecodeStep, "row_invariant", lambda self: (seen.append(self.graphs), probe(self))[1])
    model = copy.deepcopy(models["fp32"])
    # (candidates probed until one passes: two or more, as the CPU's fp32 GEMV at one row is not the bits of 8
    # rows, and an AVX-512 Xeon's MKL fails the next one too)
    assert DecodeStep(model, max_len=40, graphs="compile").invariant
    n = len(seen)
    assert n >= 2 and seen == ["eager"] * n
    assert DecodeStep(model, max_len=40).invariant and len(seen) == n  # (memoised: no new probe)
    with pytest.raises(ValueError, match="needs the model on CUDA"):  # a captured step's probe is captured
        invariant_buckets(model, 40, "cudagraph")


@pytest.mark.parametrize("buckets,attn_rows,max_len", [((4, 8, 16), 4, 40), ((4, 8, 16), None, 12),
                                                       ((8, 48), None, 60)])
def test_attend_is_the_formula_below_and_in_the_window(monkeypatch, buckets, attn_rows, max_len):
    """`attend`'s PyTorch ops (an unfused model) against the naive formula (row_attention.reference, fp64) at
    every call, and the step's logits against the cache-free forward: W = 16 (the largest bucket), so rows at
    positions past W have keys below the window (the GEMM over the cache, split at position - (W - 1)); groups
    of 4 rows; a cache smaller than the window (12 slots: the window's clamp); a bucket of 48 rows, no multiple
    of WINDOW_ROWS (the chunks' rule); and a round whose accepted branch sits at rows 2 and 5. (A split one key
    lower, or the queries' heads mapped to kv heads h % Hk, stayed within every other test's tolerance; the
    48-row bucket crashed without the chunk rule.)"""
    from midlayer.ops import row_attention

    model = make_tiny(DIMS, False)
    errs = []
    attend_ops = DecodeStep._attend_ops

    def spy(self, q, kl, vl):
        out = attend_ops(self, q, kl, vl)
        want = row_attention.reference(q, kl, vl, self.cur_keys, self.cur_kmask)
        real = self.cur_keys[:, :, 0] != self.scratch  # [B, N]: padding rows see the scratch slot alone
        errs.append(float((out.double() - want.reshape(out.shape)).abs().amax(-1)[real].max()))
        return out

    monkeypatch.setattr(DecodeStep, "_attend_ops", spy)
    st = DecodeStep(model, max_len=max_len, buckets=buckets, attn_rows=attn_rows)
    P = max_len - 8
    seq = torch.randint(0, V, (P + 3,), generator=torch.Generator().manual_seed(1)).tolist()
    a, _ = st.prefill(torch.tensor([seq[:P]]))
    steps = [st.decode(torch.tensor([t]), P + i)[0] for i, t in enumerate(seq[P:P + 2])]
    ref = model(torch.tensor([seq[:P + 2]])).logits[0]
    torch.testing.assert_close(a[0], ref[:P], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps), ref[P:], atol=2e-5, rtol=1e-5)
    st.reset()
    st.prefill(torch.tensor([seq[:P - 2]]))
    tree = DraftTree([(0,), (1,), (2,), (1, 0), (1, 1)])
    tt = st.tree_tensors(tree.parent.tolist(), tree.depth.tolist())
    st.verify(seq[P - 2], [1, seq[P - 1], 2, 3, seq[P]], tt, P - 2, P - 2)
    assert errs and max(errs) < 1e-5, max(errs)


@pytest.mark.parametrize("attn_rows", [8, ATTN_ROWS])
def test_grouped_attention_matches_the_naive_forward_and_is_lossless(models, attn_rows):
    """The weighted sum in groups of attn_rows rows (a 32-row prefill chunk as 4 GEMMs of 8 rows, or one of 32)
    equals the cache-free forward to float rounding, and speculative decoding on such a step, hidden
    transfer's pseudo rows included (a 12-node tree with 3 steps: 64 rows), gives its plain greedy output."""
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    model = models["fp32"]
    seq = _prompts()[2][:40]
    buckets = tuple(b for b in BUCKET_CANDIDATES[0] if b % attn_rows == 0)
    st = DecodeStep(model, max_len=64, buckets=buckets, attn_rows=attn_rows)
    a, _ = st.prefill(torch.tensor([seq[:30]]))
    steps = [st.decode(torch.tensor([t]), 30 + i)[0] for i, t in enumerate(seq[30:])]
    ref = model(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(a[0], ref[:30], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps), ref[30:], atol=2e-5, rtol=1e-5)
    step = DecodeStep(model, max_len=220, buckets=buckets, attn_rows=attn_rows)
    for prompt in _prompts()[1:]:
        plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=30), step=step)[0]
        for drafter in (NoisyOracle(prompt + plain, V), HiddenTransferDrafter(model, _transfer([1, 1, 2], False))):
            assert static_speculative_generate(model, prompt, drafter, TREES[1], 30, step=step)[0] == plain


def test_bucket_rule_and_bad_settings(models):
    assert bucket_for(1, (8, 16)) == 8 and bucket_for(9, (16, 8)) == 16
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        bucket_for(17, (8, 16))
    with pytest.raises(ValueError, match="buckets must be positive"):
        DecodeStep(models["fp32"], buckets=(0, 8))
    with pytest.raises(ValueError, match="attn_rows must be a positive row count that divides"):
        DecodeStep(models["fp32"], buckets=(16, 32), attn_rows=32)
    with pytest.raises(ValueError, match="graphs must be one of"):
        DecodeStep(models["fp32"], graphs="fast")
    with pytest.raises(ValueError, match="needs the model on CUDA"):
        DecodeStep(models["fp32"], graphs="cudagraph")
    with pytest.raises(ValueError, match="gated models"):
        DecodeStep(make_tiny({**DIMS, "n_layers": 4}, True))
    with pytest.raises(ValueError, match="sliding-window"):
        DecodeStep(make_tiny({**DIMS, "sliding_window": 8}, False))


# ------------------------------------------------------------------------- against the reference paths
def test_step_logits_equal_the_dynamic_engine_in_q4(models):
    """q4's kernels are row-invariant and its attention sums over the visible keys only, so the static step
    (8-row buckets, attention over the whole static cache) and the dynamic engine (one row, attention over
    the cache's length) give the same bits: prefill and every decode step."""
    model = models["q4"]
    prompt = _prompts()[2]
    st = DecodeStep(model, max_len=100)
    cache = KVCache.for_model(model.cfg, 1, 100, dtype=kv_dtype(model))  # both hold q4's fp16 K/V
    a, _ = st.prefill(torch.tensor([prompt]))
    b = forward_cached(model, torch.tensor([prompt]), cache, torch.arange(len(prompt))[None])
    assert torch.equal(a, b)
    tok = int(a[0, -1].argmax())
    for i in range(6):
        pos = len(prompt) + i
        la, _ = st.decode(torch.tensor([tok]), pos)
        lb = forward_cached(model, torch.tensor([[tok]]), cache, torch.tensor([[pos]]), last_only=True)
        assert torch.equal(la, lb)
        tok = int(la[0].argmax())


def test_step_logits_match_the_naive_forward_in_fp32(models):
    """fp32: the step equals the cache-free forward over the whole sequence to float rounding."""
    model = models["fp32"]
    seq = _prompts()[2][:40]
    st = DecodeStep(model, max_len=64)
    a, _ = st.prefill(torch.tensor([seq[:30]]))
    steps = [st.decode(torch.tensor([t]), 30 + i)[0] for i, t in enumerate(seq[30:])]
    ref = model(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(a[0], ref[:30], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps), ref[30:], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_static_greedy_equals_generate(models, fmt):
    cfg = GenerationConfig(max_new_tokens=40)
    prompts = _prompts()
    assert static_generate(models[fmt], prompts, cfg) == [generate(models[fmt], [p], cfg)[0] for p in prompts]


def test_static_generate_respects_stop_tokens_budget_and_context(models):
    model = models["fp32"]
    prompt = _prompts()[1]
    full = static_generate(model, [prompt], GenerationConfig(max_new_tokens=20))[0]
    stop = full[7]
    cut = static_generate(model, [prompt], GenerationConfig(max_new_tokens=20, stop_tokens=(stop,)))[0]
    assert cut == full[:full.index(stop) + 1]
    long = [i % V for i in range(DIMS["max_seq_len"] - 3)]
    assert len(static_generate(model, [long], GenerationConfig(max_new_tokens=50))[0]) == 4  # the context's end


def test_a_reused_step_gives_the_same_tokens(models):
    model = models["fp32"]
    cfg = GenerationConfig(max_new_tokens=12)
    step = DecodeStep(model, max_len=100)
    prompts = _prompts()
    assert static_generate(model, prompts, cfg, step=step) == static_generate(model, prompts, cfg)
    with pytest.raises(ValueError, match="holds 100 slots"):
        static_generate(model, [list(range(95))], cfg, step=step)


def test_sampling_repeats_with_its_seed(models):
    cfg = GenerationConfig(max_new_tokens=15, temperature=0.9, seed=3)
    a = static_generate(models["fp32"], _prompts()[:2], cfg)
    assert a == static_generate(models["fp32"], _prompts()[:2], cfg)
    assert a != static_generate(models["fp32"], _prompts()[:2], GenerationConfig(max_new_tokens=15))


# ------------------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("fmt", ["fp32", "q4"])
@pytest.mark.parametrize("tree", TREES, ids=["chain3", "sparse12"])
def test_speculative_equals_plain_token_for_token(models, fmt, tree):
    """Greedy speculative decoding through the static step gives plain decoding's tokens exactly, whatever
    the drafts: all right (oracle), right at some depths and ranks (noisy oracle), wrong (random)."""
    model = models[fmt]
    cfg = GenerationConfig(max_new_tokens=40)
    for prompt in _prompts():
        ref = static_generate(model, [prompt], cfg)[0]
        hist = []
        for drafter in (OracleDrafter(prompt + ref, V), NoisyOracle(prompt + ref, V), RandomDrafter(V, 0)):
            out, stats = static_speculative_generate(model, prompt, drafter, tree, 40)
            assert out == ref
            assert stats.new_tokens == len(ref) and sum(stats.accept_hist) == stats.base_forwards
            hist.append(stats.accept_hist)
        if len(ref) == 40:
            assert hist[0][tree.max_depth] > 0  # the oracle's chains are accepted whole
            assert sum(hist[1][1:tree.max_depth]) > 0  # the noisy oracle's are accepted in part


def test_speculative_with_trained_style_drafters(models):
    """Medusa (zero-init heads: each predicts the base's next token) and EAGLE, static and dynamic (EAGLE-2)
    trees: the same tokens as plain decoding, in q4."""
    model = models["q4"]
    torch.manual_seed(0)
    eagle = EagleHead.for_model(model)
    cfg = GenerationConfig(max_new_tokens=30)
    for prompt in _prompts():
        ref = static_generate(model, [prompt], cfg)[0]
        medusa, _ = static_speculative_generate(model, prompt, MedusaDrafter(model, MedusaHeads(DIMS["dim"], 3)),
                                                TREES[1], 30)
        assert medusa == ref
        for dynamic_k in (0, 2):
            out, _ = static_speculative_generate(model, prompt, EagleDrafter(model, eagle, dynamic_k=dynamic_k),
                                                 TREES[1], 30)
            assert out == ref


def test_speculative_refuses_drafters_that_need_the_dynamic_cache(models):
    class NeedsCache(Drafter):
        def propose(self, ctx):
            return Draft(node_tokens=[0])

    with pytest.raises(ValueError, match="does not draft for the static step"):
        static_speculative_generate(models["fp32"], [1, 2], NeedsCache(), DraftTree.chain(1), 4)
    # the self-speculative drafters draft on the static step through its blocks, in device rounds only
    model = models["fp32"]
    for drafter in (LayerSkipDrafter(model, [1]), EarlyExitDrafter(model, EarlyExitHead(DIMS["dim"], 1))):
        with pytest.raises(ValueError, match="in device rounds only"):
            static_speculative_generate(model, [1, 2], drafter, DraftTree.chain(2), 4, device_rounds=False)
    # learned skipping drafts with the gated twin, which the static step does not run
    from midlayer.speculative.skip_gates import GatedDrafter, SkipGates

    four = make_tiny({**DIMS, "n_layers": 4}, False)
    with pytest.raises(ValueError, match="does not draft for the static step"):
        static_speculative_generate(four, [1, 2], GatedDrafter(four, SkipGates.for_model(four)), DraftTree.chain(1), 4)


def test_verification_keeps_exactly_the_plain_cache(models):
    """After every round the held slots and their K/V are bit for bit plain decoding's (q4, noisy drafts)."""
    model = models["q4"]
    prompt = _prompts()[1]
    cfg = GenerationConfig(max_new_tokens=24)
    ref = static_generate(model, [prompt], cfg)[0]
    plain = DecodeStep(model, max_len=80)
    plain.prefill(torch.tensor([prompt + ref[:-1]]))
    spec = DecodeStep(model, max_len=80)
    out, _ = static_speculative_generate(model, prompt, NoisyOracle(prompt + ref, V), TREES[1], 24, step=spec)
    assert out == ref
    n = len(prompt) + len(ref) - 1
    assert bool(spec.held[:, :n].all()) and bool(plain.held[:, :n].all())
    # beyond: the rows of the last round past the budget, then nothing (no slot of a rejected node is held)
    assert int(spec.held.sum()) <= n + TREES[1].max_depth and not spec.held[:, n + TREES[1].max_depth:].any()
    assert torch.equal(spec.k[:, :, :, :n], plain.k[:, :, :, :n])
    assert torch.equal(spec.v[:, :, :, :n], plain.v[:, :, :, :n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tree_row_has_plain_decodings_bits(models, dtype):
    """The accepted path on the tree's second branch, its rows not adjacent (rows 2 and 5 of the round, slots
    start + 2 and start + 5): the root's and the nodes' logits are plain decoding's bit for bit, and so are
    the K/V compacted to the front. (Before attention reduced in position order, the same keys at other slots
    rounded otherwise: a bf16 greedy output of SmolLM2 with EAGLE-2 left plain decoding's.)"""
    model = copy.deepcopy(models["fp32"]).to(dtype)
    prompt = _prompts()[2][:20]
    P = len(prompt)
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=3))[0]
    room = P + any_round_slots(5, 0)  # (the probe's buckets: a 5-node round may take a bucket of 32 rows)
    plain = DecodeStep(model, max_len=room)
    want = [plain.prefill(torch.tensor([prompt]))[0][0, -1]]
    want += [plain.decode(torch.tensor([ref[i]]), P + i)[0][0] for i in range(2)]
    spec = DecodeStep(model, max_len=room)
    spec.prefill(torch.tensor([prompt[:-1]]))
    tree = DraftTree([(0,), (1,), (2,), (1, 0), (1, 1)])  # rows: root 0, then (0,) (1,) (2,) (1,0) (1,1)
    junk = [(t + 1) % V for t in ref]
    nodes = [junk[0], ref[0], (ref[0] + 2) % V, junk[1], ref[1]]
    tt = spec.tree_tensors(tree.parent.tolist(), tree.depth.tolist())
    accepted, bonus, rows, logits, _, _ = spec.verify(prompt[-1], nodes, tt, P - 1, P - 1)
    assert accepted == ref[:2] and bonus == ref[2] and rows.tolist() == [0, 2, 5]
    for got, exp in zip(logits, want):
        assert torch.equal(got, exp)
    n = P + 2  # the prompt, the root's successor and the next token are held, at their own positions
    assert torch.equal(spec.k[:, :, :, :n], plain.k[:, :, :, :n]) and torch.equal(spec.v[:, :, :, :n], plain.v[:, :, :, :n])


@pytest.mark.parametrize("kind", ["eagle-2", "medusa", "hidden-transfer", "early-exit"])
def test_a_bf16_bases_drafts_load_in_bf16_and_run_lossless(tmp_path, kind):
    """`bench static` and the GPU check (benchmarks/static_step_check.py) run a bf16 base's drafts in bf16
    (static_bench.static_methods: load_drafter(dtype=)). EAGLE's drafter copies its draft layer when it is built,
    so a module cast after that kept the copy in fp32 beside a bf16 fc, and every EAGLE row of their bf16 tables
    failed in its first linear (found by a CPU dry run of scripts/static_check.sh, 59th session). Every saved
    drafter's weights, EAGLE's layer among them, are bf16 now, and both kinds of round give static plain
    decoding's tokens."""
    from torch import nn

    from midlayer.engine.quantization import fuse_projections
    from midlayer.experiments.static_bench import static_methods
    from midlayer.speculative.registry import save_draft

    def modules(d) -> list:
        return [m for m in (getattr(d, a, None) for a in ("head", "heads", "transfer", "layer"))
                if isinstance(m, nn.Module)]

    base = make_tiny(DIMS, False)  # (as loaded: bf16 is its dtype, not a weight format)
    path = save_draft(tmp_path / kind, modules(device_drafters(base)[kind])[0], base=base)
    model = fuse_projections(copy.deepcopy(base).to(torch.bfloat16))  # (as the bench runs it)
    (drafter, tree), = static_methods(model, {kind: str(path)}, 6).values()
    assert {p.dtype for m in modules(drafter) for p in m.parameters()} == {torch.bfloat16}
    prompt = _prompts()[2][:20]
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=8))[0]
    for on_device in (True, False)[:1 if drafter.reads_cache else 2]:  # (early exit: device rounds only)
        out, stats = static_speculative_generate(model, prompt, drafter, tree, 8, device_rounds=on_device)
        assert out == ref and stats.base_forwards > 0, on_device


# ------------------------------------------------------------------------- hidden transfer's fused pass
def _transfer(layers: list[int], masked: bool, seed: int = 0):
    return noisy_transfer(DIMS["dim"], layers, masked, seed)


@pytest.mark.parametrize("masked", [False, True], ids=["not-masked", "masked"])
def test_fused_pass_drafts_what_the_dynamic_engine_drafts(models, masked):
    """The static round's pseudo rows (joining at blocks 1, 2 and after the last, t = L = 3) give the draft
    logits of the dynamic engine's separate pass for the same anchor, to float rounding."""
    from midlayer.speculative.hidden_transfer import pseudo_logits_cached

    model = models["fp32"]
    ht = _transfer([1, 2, 3], masked)
    prompt = _prompts()[2][:30]
    P = len(prompt)
    st = DecodeStep(model, max_len=P + any_round_slots(0, 3))
    st.attach(type("D", (), {"transfer": ht})())
    st.prefill(torch.tensor([prompt[:-1]]))
    tt = st.tree_tensors([], [], k=3, masked=masked)
    *_, draft = st.verify(prompt[-1], [], tt, P - 1, P - 1)
    cache = KVCache.for_model(model.cfg, 1, 80)
    store = {1: None, 2: None}
    _, hidden = forward_cached(model, torch.tensor([prompt]), cache, torch.arange(P)[None], capture=store,
                               return_hidden=True, all_hidden=True)
    anchor = {1: store[1][0, -1], 2: store[2][0, -1], 3: hidden[0, -1]}
    ref = pseudo_logits_cached(model, ht, cache, P - 1, anchor, 3, draft_head=True)
    torch.testing.assert_close(draft, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
@pytest.mark.parametrize("masked", [False, True], ids=["not-masked", "masked"])
def test_fused_hidden_transfer_is_lossless(models, fmt, masked):
    """Hidden transfer riding the static step's rounds: plain greedy output, token for token, chain and tree.
    Every round after the first drafts from the previous round's pseudo rows (ctx.draft_logits). (A random
    transfer on a random model drafts badly: acceptance is exercised by the other drafters' tests.)"""
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    model = models[fmt]
    drafter = HiddenTransferDrafter(model, _transfer([1, 1, 2], masked))
    seen = []
    propose = drafter.propose
    drafter.propose = lambda ctx: (seen.append(ctx.draft_logits is not None), propose(ctx))[1]
    cfg = GenerationConfig(max_new_tokens=40)
    for prompt in _prompts():
        ref = static_generate(model, [prompt], cfg)[0]
        for tree in TREES:
            for device in (False, True):
                seen.clear()
                out, stats = static_speculative_generate(model, prompt, drafter, tree, 40, device_rounds=device)
                assert out == ref
                if device:  # only the first round, with no draft yet, on the host; the others on the device
                    assert seen == [False] and stats.base_forwards > 1
                else:
                    assert seen[0] is False and all(seen[1:]) and len(seen) == stats.base_forwards


def test_separate_hidden_transfer_is_refused_by_the_static_step(models):
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    drafter = HiddenTransferDrafter(models["fp32"], _transfer([1, 2], False), fused=False)
    with pytest.raises(ValueError, match="does not draft for the static step"):
        static_speculative_generate(models["fp32"], [1, 2, 3], drafter, DraftTree.chain(2), 4)


def test_fused_hidden_transfer_in_one_bucket_near_the_context_and_after_on_a_shared_step(models):
    """One bucket for every forward (the probe's fallback: the tree rows are rounded up to 8 and the head
    reads every row); the context's end, where the pseudo rows no longer fit and the rounds verify without
    them; and a step shared with Medusa afterwards, which must not keep hidden transfer's rows."""
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    model = models["fp32"]
    drafter = HiddenTransferDrafter(model, _transfer([1, 2, 2], False))
    prompt = _prompts()[1]
    cfg = GenerationConfig(max_new_tokens=30)
    ref = static_generate(model, [prompt], cfg, buckets=(64,))[0]
    out, _ = static_speculative_generate(model, prompt, drafter, TREES[1], 30, buckets=(64,))
    assert out == ref
    ctx = DIMS["max_seq_len"]
    near = [i % V for i in range(ctx - 6)]
    ref = static_generate(model, [near], cfg)[0]
    out, _ = static_speculative_generate(model, near, drafter, TREES[1], 30)
    assert out == ref and len(ref) == 7
    step = DecodeStep(model, max_len=len(prompt) + 20 + _room(drafter, TREES[1]))
    static_speculative_generate(model, prompt, drafter, TREES[1], 20, step=step)
    assert step.transfer is not None
    seen = []
    medusa = MedusaDrafter(model, MedusaHeads(DIMS["dim"], 3))
    propose = medusa.propose
    medusa.propose = lambda ctx: (seen.append(ctx.draft_logits), propose(ctx))[1]
    out, _ = static_speculative_generate(model, prompt, medusa, TREES[1], 20, step=step)
    assert step.transfer is None and all(d is None for d in seen)
    assert out == static_generate(model, [prompt], GenerationConfig(max_new_tokens=20))[0]


def test_round_layout_and_slots():
    from midlayer.engine.decode_step import round_layout, round_slots

    assert round_layout(5, 0, (8, 16, 32, 64)) == (8, 8, 8)
    assert round_layout(7, 0, (8, 16)) == (8, 8, 8)  # a tree that fills a bucket exactly (root + 7 nodes) takes it
    assert round_layout(15, 0, (8, 16, 32)) == (16, 16, 16)
    assert round_layout(12, 3, (8, 16, 32, 64, 128, 256)) == (16, 64, 16)
    assert round_layout(12, 3, (64,)) == (16, 64, 64)  # one bucket: the head reads all 64 rows
    assert round_slots(12, 3, (64,)) == 13 * 4  # the root and 12 nodes, then 3 steps of 13 pseudo rows
    # pseudo rows for some anchors only: right after the tree's 25 rows, so 2 anchors x 3 steps fit its bucket
    assert round_layout(24, 3, (8, 16, 32, 64, 128, 256), 2) == (32, 32, 32)
    assert round_layout(24, 3, (8, 16, 32, 64, 128, 256)) == (32, 128, 32)
    assert round_layout(12, 3, (8, 16, 32, 64, 128, 256), 4) == (16, 32, 16)
    assert round_layout(12, 3, (32,), 4) == (16, 32, 32)  # (one bucket: the tree rows rounded up to 8)
    # the tree's rows do not depend on the anchors, so fewer anchors never need more rows or slots
    assert round_slots(24, 3, (8, 16, 32, 64, 128, 256), 2) == 32 and round_slots(19, 3, (8, 200, 256), 2) == 200
    assert round_layout(64, 3, (1, 8, 16, 32, 64, 128, 256), 2) == (128, 128, 128)  # 65 + 6 rows
    with pytest.raises(ValueError, match="needs 260 rows"):  # (every row's pseudo rows: 65 x 4)
        round_layout(64, 3, (1, 8, 16, 32, 64, 128, 256))
    with pytest.raises(ValueError, match="largest bucket"):
        round_layout(40, 3, (64,))


def test_live_rows_by_hand():
    """The rows present at each block of a hidden-transfer round (arXiv 2404.12022 sec. 3.4: step i's pseudo rows
    enter at block t_i), a prefix of the round's bucket rounded up to a bucket, then every row after the last."""
    from midlayer.engine.decode_step import live_rows

    every = (1, 8, 16, 32, 64, 128, 256)
    smol = {14: [1], 19: [2, 3]}  # SmolLM2's transfer: t = 14, 19, 19 of 30 blocks
    # a 24-node tree, pseudo rows for all 25 tree rows: 25, 50 and 100 rows present
    assert live_rows(25, 25, 128, smol, 30, every) == (32,) * 14 + (64,) * 5 + (128,) * 12
    assert live_rows(13, 13, 64, smol, 30, every) == (16,) * 14 + (32,) * 5 + (64,) * 12  # 12 nodes
    assert live_rows(1, 1, 8, smol, 30, every) == (1,) * 14 + (8,) * 17  # the first round: the root alone below 14
    # anchors: 24 nodes with 2 (25, 27, 31 rows), 12 nodes with 4 (13, 17, 25)
    assert live_rows(25, 2, 32, smol, 30, every) == (32,) * 31
    assert live_rows(13, 4, 32, smol, 30, every) == (16,) * 14 + (32,) * 17
    # two steps laid out (near the context's end) of a three-step transfer: 3 x 13 rows in the bucket of 64
    assert live_rows(13, 13, 64, smol, 30, every) == live_rows(13, 13, 64, {14: [1], 19: [2]}, 30, every)
    assert live_rows(8, 8, 16, {0: [1]}, 2, every) == (16, 16, 16)  # a step joining at block 0
    assert live_rows(8, 8, 16, {2: [1]}, 2, every) == (8, 8, 16)  # ... and after the last block (t = L)
    assert live_rows(13, 13, 64, smol, 30, (64,)) == (64,) * 31  # one bucket: every row at every block


def test_anchors_end_probabilities_and_shifts_by_hand():
    """Hidden transfer's anchors (the rows whose pseudo rows ride a round): where a round's accepted path ends,
    under the accuracies' model (P(end = r) = P(r accepted) (1 - the sum of its children's accuracies)), and which
    anchor, how many depths up, a row drafts from when it is none."""
    from midlayer.engine.decode_step import anchor_shifts

    tree = DraftTree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])  # rows 1..5 in this order
    acc = [[0.5, 0.2], [0.4, 0.1], [0.3]]
    # root 1 - .5 - .2; (0,) .5 (1 - .4 - .1); (1,) .2; (0, 0) .5 .4 (1 - .3); (0, 1) .5 .1; (0, 0, 0) .5 .4 .3
    want = [0.3, 0.25, 0.2, 0.14, 0.05, 0.06]
    got = tree.end_probabilities(acc)
    assert got == pytest.approx(want, abs=1e-12) and sum(got) == pytest.approx(1.0)
    assert tree.likeliest_ends(acc, 3) == (0, 1, 2) and tree.likeliest_ends(acc, 4) == (0, 1, 2, 3)
    assert tree.likeliest_ends(acc, 1) == (0,)
    parent, depth = tree.parent.tolist(), tree.depth.tolist()
    assert parent == [-1, -1, 0, 0, 2] and depth == [1, 1, 2, 2, 3]
    assert anchor_shifts(parent, depth, (0, 1)) == [(0, 0), (1, 0), (0, 1), (1, 1), (1, 1), (1, 2)]
    assert anchor_shifts(parent, depth, (0, 3)) == [(0, 0), (0, 1), (0, 1), (1, 0), (0, 2), (1, 1)]
    assert anchor_shifts(parent, depth, range(6)) == [(r, 0) for r in range(6)]
    for bad in ((1, 2), (0, 0, 1), (0, 2, 1), (0, 6)):
        with pytest.raises(ValueError, match="anchors must be sorted distinct rows"):
            anchor_shifts(parent, depth, bad)
    with pytest.raises(ValueError, match="at least the root"):
        tree.likeliest_ends(acc, 0)


def test_a_round_with_anchors_is_laid_out_by_hand(models):
    """A chain of 2 nodes with 2 steps of pseudo rows for the root and node 0 (rows 0, 1): the pseudo rows follow
    the tree's 3 rows step by step, (anchor, step) (0, 1), (1, 1), (0, 2), (1, 2) at rows 3-6, in the bucket of 8
    (4 tree rows for the acceptance). Node 1 (row 2) is no anchor: it drafts depth 1 and 2 from row 1's step 2."""
    st = DecodeStep(models["fp32"], max_len=64, buckets=(1, 4, 8, 16))
    tt = st.tree_tensors([-1, 0], [1, 2], k=2, anchors=(0, 1))
    assert (tt.tree_rows, tt.vis.shape[0], tt.head_rows, tt.pseudo, tt.rows_used) == (4, 8, 4, (3, 2), 7)
    assert tt.join_src.tolist() == [0, 0, 0, 0, 1, 0, 1, 0] and tt.join_step.tolist() == [0, 0, 0, 1, 1, 2, 2, 0]
    assert tt.prow[:3].tolist() == [[3, 5], [4, 6], [6, 6]]
    assert tt.depth.tolist() == [0, 1, 2, 1, 2, 2, 3, 0] and tt.reach == 3
    assert tt.real.tolist() == [True] * 7 + [False] and tt.is_node.tolist() == [False, True, True] + [False] * 5
    assert tt.path[6, :4].tolist() == [0, 1, 4, 6] and tt.path[5, :3].tolist() == [0, 3, 5]
    every = st.tree_tensors([-1, 0], [1, 2], k=2)
    assert every.pseudo == (3, 3) and every.prow[:3].tolist() == [[3, 6], [4, 7], [5, 8]]
    assert every.join_src[3:9].tolist() == [0, 1, 2, 0, 1, 2] and every.vis.shape[0] == 16


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_a_round_past_its_anchors_drafts_from_its_anchors_later_steps(models, fmt):
    """With pseudo rows for the root and node 0 only (rows 0, 1), a round whose accepted path ends at node 3
    (row 4, a child of node 0) drafts depths 1, 2, 3 from row 1's steps 2, 3, 3: bit for bit the logits of the
    same pseudo rows in a round with every row an anchor. The round's accepted tokens, logits and residuals are
    those of that round too, in a bucket of 32 rows where it took 64."""
    model = models[fmt]
    prompt = _prompts()[2][:40]
    P = len(prompt)
    kernels = dict(attention="c", linear="c") if fmt == "fp32" else {}  # (row-invariant at every row count)
    st = DecodeStep(model, max_len=P + 80, buckets=(1, 8, 16, 32, 64), **kernels)
    assert st.row_invariant()
    st.attach(type("D", (), {"transfer": _transfer([1, 2, 2], False)})())
    parents = [-1, -1, -1, 0, 0, 1, 2, 3, 3, 4, 5, 6]
    depths = [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]
    few, every = st.tree_tensors(parents, depths, k=3, anchors=(0, 1)), st.tree_tensors(parents, depths, k=3)
    assert (few.vis.shape[0], every.vis.shape[0]) == (32, 64)
    plain = [int(t) for t in static_generate(model, [prompt], GenerationConfig(max_new_tokens=3))[0]]
    nodes = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3)).tolist()

    def round_(tt, path: list[int]) -> tuple:
        nodes[0], nodes[3] = path + [(plain[1] + 1) % V] * (2 - len(path))  # (a wrong token ends the path)
        st.reset()
        st.prefill(torch.tensor([prompt[:-1]]))
        return st.verify(prompt[-1], nodes, tt, P - 1, P - 1)

    got = round_(few, plain[:2])  # ends at node 3
    want = round_(every, plain[:2])
    assert got[:2] == want[:2] == (plain[:2], plain[2])
    for a, b in zip(got[2:5], want[2:5]):
        assert torch.equal(a, b)
    anchor = round_(every, plain[:1])[5]  # ends at node 0: row 1's own steps
    assert torch.equal(got[5], anchor[[1, 2, 2]])
    assert not torch.equal(want[5], anchor[[1, 2, 2]])  # (the round with every anchor drafts from row 4's own)


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_hidden_transfer_with_anchors_is_lossless(models, fmt):
    """Hidden transfer with pseudo rows for 1 or 3 of a 12-node tree's rows: plain greedy output, token for token,
    through the static step (device rounds and host rounds) and the dynamic engine's fused pass. The cost model
    counts the rows the round runs."""
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    model = models[fmt]
    tree = TREES[1]
    cfg = GenerationConfig(max_new_tokens=40)
    for m in (1, 3):
        drafter = HiddenTransferDrafter(model, _transfer([1, 1, 2], False), anchors=m)
        assert drafter.anchor_rows(tree) == tree.likeliest_ends(drafter.PRIOR_ACC, m)
        assert drafter.extra_slots(tree) == 3 * m  # (steps joining at blocks 1, 1 and 2)
        assert drafter.verify_forward(tree, 3) == ([13, 13 + 2 * m, 13 + 3 * m], 13)
        for prompt in _prompts():
            ref = static_generate(model, [prompt], cfg)[0]
            assert speculative_generate(model, prompt, drafter, tree, 40)[0] == ref
            for device in (False, True):
                assert static_speculative_generate(model, prompt, drafter, tree, 40, device_rounds=device)[0] == ref
    with pytest.raises(ValueError, match="anchors must be 0"):
        HiddenTransferDrafter(model, _transfer([1, 2], False), fused=False, anchors=2)


@pytest.mark.parametrize("m", [2, 3], ids=["ends-past-its-anchors", "ends-at-an-anchor"])
def test_the_dynamic_engines_fused_pass_with_anchors_drafts_the_steps_bits(models, m, monkeypatch):
    """The dynamic engine lays a round's pseudo rows out on its own (`fused_rows`: the anchors' rows and mask;
    `fused_draft`: the rows the last accepted row drafts from). In q4, whose kernels give both engines the same
    bits, a round accepted down to row 4 drafts what the static step's round drafts, bit for bit: with anchors
    (0, 1), from row 1's later steps; with (0, 1, 4), from row 4's own, whose rows see its path (root, rows 1
    and 4) and not row 2's. (The transfer's fp32 maps run on RowWiseBLAS: the dynamic engine maps the A anchors'
    rows, the step every row present, and this CPU's BLAS may round a row by the row count.)"""
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter
    from midlayer.speculative.verify import verify_tree

    RowWiseBLAS().install(monkeypatch)
    model = models["q4"]
    tree = TREES[1]
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]]  # (the tree's own: its likeliest ends are rows 0, 1, 4, 10)
    drafter = HiddenTransferDrafter(model, _transfer([1, 1, 2], False), anchors=m, acc=acc)
    anchors = drafter.anchor_rows(tree)
    assert anchors == (0, 1, 4)[:m] and tree.paths[3] == (0, 0)
    prompt = _prompts()[2][:40]
    P = len(prompt)
    plain = [int(t) for t in static_generate(model, [prompt], GenerationConfig(max_new_tokens=3))[0]]
    nodes = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    nodes[0], nodes[3] = plain[:2]  # (node 0, then its child node 3: row 4)
    st = DecodeStep(model, max_len=P + 80)
    st.attach(drafter)
    st.prefill(torch.tensor([prompt[:-1]]))
    tt = st.tree_tensors(tree.parent.tolist(), tree.depth.tolist(), 3, False, anchors)
    accepted, bonus, *_, draft = st.verify(prompt[-1], nodes, tt, P - 1, P - 1)
    cache = KVCache.for_model(model.cfg, 1, P + 80, dtype=kv_dtype(model))
    forward_cached(model, torch.tensor([prompt[:-1]]), cache, torch.arange(P - 1)[None])
    r = verify_tree(model, cache, prompt[-1], P - 1, tree, nodes, fused=drafter)
    assert accepted == r.accepted == plain[:2] and bonus == r.bonus == plain[2]
    assert torch.equal(draft, r.draft_logits)


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_a_fused_round_runs_each_block_on_the_rows_present_there(models, fmt, monkeypatch):
    """A round of hidden transfer's fused pass runs block l on the rows present there (`live_rows`: the tree's
    16 rows at block 0, with step 1's at block 1, all 64 at block 2 for t = 1, 2, 2), and gives the bits of
    the same round with every row at every block: the accepted tokens, their logits and residuals, and the
    next draft from the anchor's pseudo rows."""
    from midlayer.engine import decode_step

    model = models[fmt]
    prompt = _prompts()[2][:40]
    P = len(prompt)
    # (the C kernels, and the q4 format's: row-invariant by construction, at every row count)
    kernels = dict(attention="c", linear="c") if fmt == "fp32" else {}
    st = DecodeStep(model, max_len=P + 80, buckets=(1, 8, 16, 32, 64), **kernels)
    assert st.row_invariant()
    st.attach(type("D", (), {"transfer": _transfer([1, 2, 2], False)})())
    parents = [-1, -1, -1, 0, 0, 1, 2, 3, 3, 4, 5, 6]
    tt = st.tree_tensors(parents, [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3], k=3)
    assert (tt.tree_rows, tt.vis.shape[0]) == (16, 64)
    nodes = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = [int(t) for t in static_generate(model, [prompt], GenerationConfig(max_new_tokens=2))[0]]
    nodes[0], nodes[3] = plain  # (a path of two accepted nodes: node 0, then its child node 3)

    def round_() -> tuple:
        st.reset()
        st.prefill(torch.tensor([prompt[:-1]]))
        return st.verify(prompt[-1], nodes, tt, P - 1, P - 1)

    rows: list[int] = []
    hooks = [b.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[1])) for b in model.layers]
    try:
        got = round_()
        assert rows[-3:] == [16, 32, 64]
        monkeypatch.setattr(decode_step, "live_rows", lambda first, per, N, join_at, L, buckets: (N,) * (L + 1))
        rows.clear()
        want = round_()
        assert rows[-3:] == [64, 64, 64]
    finally:
        for h in hooks:
            h.remove()
    assert got[:2] == want[:2] and got[0] == plain[:2]
    for a, b in zip(got[2:], want[2:]):
        assert torch.equal(a, b)


def test_a_step_is_sized_by_the_round_its_drafter_runs(models):
    """EAGLE-2 asked for a dynamic tree larger than any bucket runs the round it really verifies (its best
    min(N, k + (D - 1) k^2) candidates), losslessly: the step was sized for no round at all and the round wrote
    past the cache (IndexError; a device assert on CUDA). A round no bucket set holds is round_layout's error
    naming the rows (it was "the step holds 17 slots; a round at slot 4 needs 29")."""
    from midlayer.engine.decode_step import any_round_slots
    from midlayer.speculative.static import dynamic_candidates, round_nodes

    model = models["fp32"]
    eagle = device_drafters(model)["eagle-2"]
    big = DraftTree.greedy_from_accuracies([[0.9 / (r + 1) for r in range(20)]] * 3, 256)
    assert len(big) == 256 and eagle.dynamic_k == 3 and dynamic_candidates(3, 3) == 3 + 2 * 9
    assert round_nodes(eagle, big) == 21 and round_nodes(eagle, TREES[1]) == 12
    prompt = _prompts()[1]
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=12))[0]
    assert static_speculative_generate(model, prompt, eagle, big, 12)[0] == ref
    with pytest.raises(ValueError, match="needs 404 rows, more than the largest bucket"):
        any_round_slots(100, 3)
    deep = DraftTree.greedy_from_accuracies([[0.9, 0.5]] * 6, 100)
    with pytest.raises(ValueError, match="more than the largest bucket"):
        static_speculative_generate(model, prompt, device_drafters(model)["hidden-transfer"], deep, 12)


def test_finish_reason_names_why_generation_ended(models):
    from midlayer.engine.generate import finish_reason

    model = models["fp32"]
    prompt = _prompts()[1]
    full = generate(model, [prompt], GenerationConfig(max_new_tokens=10))[0]
    assert finish_reason(model, prompt, full, GenerationConfig(max_new_tokens=10)) == "length"
    cfg = GenerationConfig(max_new_tokens=10, stop_tokens=(full[3],))
    cut = generate(model, [prompt], cfg)[0]
    assert finish_reason(model, prompt, cut, cfg) == "stop" and len(cut) <= 4
    near = [i % V for i in range(DIMS["max_seq_len"] - 3)]
    cfg = GenerationConfig(max_new_tokens=50)
    out = static_generate(model, [near], cfg)[0]
    assert len(out) == 4 and finish_reason(model, near, out, cfg) == "context"
    # cut before the context is full (a stop string, say): one more token would still have fit
    assert finish_reason(model, near, out[:3], cfg) == "stop"


def test_device_rounds_refuse_a_tree_deeper_than_the_attention_window(models):
    """A round's rows must lie within W - 1 positions of its root (`DecodeStep.attend`'s window): the device
    rounds refuse a deeper tree by name, as a host round does (`verify`), and a round just inside it is
    lossless (layer skip: it drafts in device rounds only)."""
    model = models["fp32"]
    drafter = LayerSkipDrafter(model, [1])
    prompt = _prompts()[1]
    step = DecodeStep(model, max_len=300, buckets=(8, 16, 32, 64, 128))
    with pytest.raises(ValueError, match="attention window holds 63"):
        static_speculative_generate(model, prompt, drafter, DraftTree.chain(64), 40, step=step)
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=70))[0]
    out, _ = static_speculative_generate(model, prompt, drafter, DraftTree.chain(63), 70, step=step)
    assert out == ref
    with pytest.raises(ValueError, match="outside the step.s 300 slots"):
        step.decode(torch.tensor([1]), 300)


def test_the_checks_diagnosis_names_the_first_difference(models):
    """benchmarks/static_step_check.py's `first_difference`, what a GPU session reads to localise a loss of
    losslessness: on a sound step it finds none; when a round's logits are moved it names that round's row
    with an equal final residual (the head's side); when a committed key is moved mid-run it names the slot
    and layer."""
    from tiny_models import benchmark

    check = benchmark("static_step_check")
    model = models["fp32"]
    prompt = _prompts()[2]
    ref = static_generate(model, [prompt], GenerationConfig(max_new_tokens=30))[0]
    tree = TREES[1]
    sound = DecodeStep(model, max_len=200)
    assert check.first_difference(model, sound, prompt, NoisyOracle(prompt + ref, V), tree, 30).startswith(
        "verified logits equal plain's at every compared position; tokens part at None")
    moved = DecodeStep(model, max_len=200)
    verify = moved.verify

    def shifted(*args):
        out = list(verify(*args))
        out[3] = out[3] + 1e-3 * (torch.arange(out[3].shape[0]) > 0)[:, None]  # the accepted nodes' logits
        return tuple(out)

    moved.verify = shifted
    line = check.first_difference(model, moved, prompt, NoisyOracle(prompt + ref, V), tree, 30)
    assert line.startswith(f"logits first differ at position {len(prompt)} (round 0, row ") and \
        "the final residual equal; K/V equal in every slot before it" in line
    bent = DecodeStep(model, max_len=200)
    verify_bent, calls = bent.verify, []

    def bend(*args):
        calls.append(1)
        if len(calls) == 3:
            bent.k[1, 0, 0, 10, 0] += 1e-3
        return verify_bent(*args)

    bent.verify = bend
    line = check.first_difference(model, bent, prompt, NoisyOracle(prompt + ref, V), tree, 30)
    assert "K first differs at slot 10 (layer 1)" in line and "the final residual differs too" in line


def test_probing_a_step_with_hidden_transfer_attached_keeps_its_rounds_whole(models):
    """The probe's rounds run without a transfer (placeholder pseudo rows). Probing a step that has one
    attached restores it and drops the rounds captured meanwhile, so that no later round (a CUDA graph or a
    compiled one bakes in what it ran) verifies without the transfer's joins; the fused pass then drafts what
    it drafts on a step never probed, and stays lossless."""
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    model = models["fp32"]
    prompt = _prompts()[1]
    drafter = HiddenTransferDrafter(model, _transfer([1, 1, 2], False))
    runs = []
    for probed in (False, True):
        step = DecodeStep(model, max_len=200)
        step.attach(drafter)
        if probed:
            assert step.row_invariant()
            assert step.transfer is drafter.transfer and not [k for k in step._runners if k[0] == "verify"]
        runs.append(static_speculative_generate(model, prompt, drafter, TREES[1], 30, step=step))
    assert runs[0][0] == runs[1][0] == static_generate(model, [prompt], GenerationConfig(max_new_tokens=30))[0]
    assert runs[0][1].accept_hist == runs[1][1].accept_hist


def test_verification_rounds_are_kept_per_transfer(models, monkeypatch):
    """Two fused passes of the same layout (two transfers), alternating on one step as a benchmark's rows do,
    prompt after prompt: each one's rounds are captured once, and a round only ever runs under the transfer it
    was captured with (a capture bakes in the joins it ran, so `_runner` keys verification rounds by the
    transfer). They used to be dropped at every switch, so on a GPU each timed generation of hidden transfer
    began by capturing its rounds again. Every output stays plain greedy output."""
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter

    model = models["fp32"]
    prompt = _prompts()[1]
    plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=30))[0]
    drafters = tuple(HiddenTransferDrafter(model, _transfer([1, 1, 2], False, seed)) for seed in (0, 1))
    step = DecodeStep(model, max_len=200)
    captured = []
    capture = DecodeStep.capture

    def spy(self, fn):  # a round's runner must only ever run under the transfer it was captured with
        at, inner = self.transfer, capture(self, fn)
        captured.append(fn)
        if not isinstance(fn, functools.partial):  # (a plain forward: no joins, any transfer)
            return inner

        def run(*args, **kw):
            assert self.transfer is at
            return inner(*args, **kw)
        return run

    monkeypatch.setattr(DecodeStep, "capture", spy)
    before = None
    for _ in range(2):
        for drafter in drafters:  # (drafted on the host: every round through the step's own verify runner)
            out, _ = static_speculative_generate(model, prompt, drafter, TREES[1], 30, step=step, device_rounds=False)
            assert out == plain
        before = len(captured) if before is None else before
    assert len(captured) == before > 0
    # a transfer moved (new weights' addresses) is a new key: its rounds are captured anew, not replayed
    held = [p.data for p in drafters[0].transfer.parameters()]  # (alive: the moved weights cannot reuse them)
    drafters[0].transfer.to(torch.float64).to(torch.float32)
    assert all(p.data_ptr() != h.data_ptr() for p, h in zip(drafters[0].transfer.parameters(), held))
    static_speculative_generate(model, prompt, drafters[0], TREES[1], 30, step=step, device_rounds=False)
    assert len(captured) > before
    # a third transfer: the rounds kept are those of the last two only (each captured round holds memory)
    third = HiddenTransferDrafter(model, _transfer([1, 1, 2], False, 2))
    static_speculative_generate(model, prompt, third, TREES[1], 30, step=step, device_rounds=False)
    assert {k[-1][0] for k in step._runners if k[0] == "verify"} == {drafters[0].transfer, third.transfer}


def test_a_drafts_bench_rows_share_its_transfer_and_capture_once(tmp_path, models, monkeypatch):
    """`bench static` runs hidden transfer at several tree sizes and anchor counts, prompt after prompt, between
    other drafters' rows, on one step. A draft's rows share its transfer (`static_methods(loaded=)`), so the step's
    rounds, captured once, are replayed. When each row loaded a transfer of its own, the step (which keeps the
    rounds of two transfers) captured hidden transfer's first round again inside every timed generation."""
    from midlayer.experiments.static_bench import static_methods
    from midlayer.speculative.registry import save_draft

    model = models["fp32"]
    path = str(save_draft(tmp_path / "ht", _transfer([1, 1, 2], False), base=make_tiny(DIMS, False)))
    prompt = _prompts()[1][:30]
    plain = static_generate(model, [prompt], GenerationConfig(max_new_tokens=12))[0]
    medusa = MedusaDrafter(model, MedusaHeads(DIMS["dim"], 3))
    captured = []
    capture = DecodeStep.capture
    monkeypatch.setattr(DecodeStep, "capture", lambda self, fn: (captured.append(fn), capture(self, fn))[1])
    counts = {}
    for loaded in ({}, None):
        rows = [static_methods(model, {"ht": path}, n, anchors=a, loaded=loaded)["ht"]
                for n, a in ((12, 0), (4, 0), (12, 2))]
        assert [d.anchors for d, _ in rows] == [0, 0, 2] and len({id(d) for d, _ in rows}) == 3
        assert len({id(d.transfer) for d, _ in rows}) == (1 if loaded is not None else 3)
        step = DecodeStep(model, max_len=len(prompt) + 12 + any_round_slots(12, 3))
        captured.clear()
        for n in range(2):
            for drafter, tree in rows + [(medusa, TREES[1])]:
                assert static_speculative_generate(model, prompt, drafter, tree, 12, step=step)[0] == plain
            counts[loaded is not None, n] = len(captured)
    assert counts[True, 1] == counts[True, 0] > 0  # shared: the second pass captures nothing
    assert counts[False, 1] > counts[False, 0]  # a transfer a row: its first round captured again


def test_bench_statics_table_by_hand():
    """`bench static`'s rows: ms/token against the recipe (a ratio of ms) and as a speed-up over our plain row
    (its ms / the row's: issue 42's "at least 1.6x" read off the table), tau and the equal outputs, by hand."""
    from midlayer.experiments.static_bench import RECIPE, _add_row, _static_rows, static_table

    rows: dict = {}
    plain = "midlayer static, cudagraph"
    for toks, other in (([1, 2, 3], [1, 2, 3]), ([4, 5, 6], [4, 5, 7])):
        _add_row(rows, RECIPE, toks, 0.002)  # 2 ms a token over the 2 tokens after the first
        _add_row(rows, plain, toks, 0.004)
        _add_row(rows, "eagle-2, device rounds", other, 0.0025, 3, 2)  # 3 tokens from 2 forwards
    got = {r["engine"]: r for r in _static_rows(rows, plain)}
    assert got[RECIPE]["ms_per_token"] == pytest.approx(2.0) and got[plain]["vs_recipe"] == pytest.approx(2.0)
    spec = got["eagle-2, device rounds"]
    assert (spec["vs_recipe"], spec["over_plain"], spec["tau"]) == (pytest.approx(1.25), pytest.approx(1.6), 1.5)
    assert (spec["equal_plain"], spec["n"], got[RECIPE]["equal_plain"]) == (1, 2, 2)
    table = static_table(dict(tables={"bf16": dict(rows=list(got.values()), invariant={})}), header=False)
    assert "| eagle-2, device rounds | 2.50 | 1.25x | 1.60x | 1.50 | 1/2 |" in table
    assert _static_rows(rows, None)[0]["over_plain"] is None  # (no plain row ran: no speed-up, no comparison)
    inv = dict(invariant={"cudagraph": True, "cudagraph, both kernels": None}, buckets={
        "cudagraph": (1, 8), "cudagraph, both kernels": (1, 8)}, linear={"cudagraph, both kernels": "triton"})
    table = static_table(dict(tables={"bf16": dict(rows=[], **inv)}), header=False)
    assert "bf16 (buckets cudagraph: (1, 8) row-invariant, cudagraph, both kernels: (1, 8) row-linear kernel " \
           "not probed)" in table
    cpu = dict(invariant={"eager": True}, buckets={"eager": (1, 8)}, attention={"eager": "c"}, linear={"eager": "c"})
    assert "fp32 (buckets eager: (1, 8) C attention C linear row-invariant)" in static_table(
        dict(tables={"fp32": dict(rows=[], **cpu)}), header=False)


def test_the_bench_times_the_linear_kernel_beside_a_chosen_cublas_step(monkeypatch):
    """Where the probe chose the row-attention kernel with PyTorch's (cuBLAS's) linears, `bench static` adds a
    plain row through both kernels: the chosen step's buckets and mode, linear="triton" (not probed). None
    where the chosen step runs the linear kernel already, attends in PyTorch ops, or the kernels do not run
    (on a CPU they are tried by pretending, as the probe's tests do)."""
    pytest.importorskip("triton")
    from midlayer.experiments import static_bench as sb

    model = compress_weights(make_tiny(DIMS, False), "fp32")
    monkeypatch.setattr(sb, "triton_kernels", lambda m: True)
    chosen = DecodeStep(model, max_len=40, buckets=(1, 8), attention="triton")
    alt = sb.linear_kernel_step(model, chosen, 40)
    assert (alt.buckets, alt.attention, alt.linear, alt.graphs, alt.max_len, alt.invariant) == (
        (1, 8), "triton", "triton", "eager", 40, None)
    assert sb.linear_kernel_step(model, alt, 40) is None
    assert sb.linear_kernel_step(model, DecodeStep(model, max_len=40, buckets=(1, 8)), 40) is None
    monkeypatch.setattr(sb, "triton_kernels", lambda m: False)
    assert sb.linear_kernel_step(model, chosen, 40) is None


@pytest.mark.parametrize("n", [-3, 2.5, True, "4"])
def test_a_bad_token_budget_is_refused_by_every_loop(models, n):
    """max_new_tokens: an integer >= 0 for plain decoding and both speculative loops alike (the speculative loops
    returned [] for -3; 2.5 failed inside torch)."""
    model, prompt = models["fp32"], _prompts()[0]
    msg = "max_new_tokens must be (an integer )?>= 0"
    with pytest.raises(ValueError, match=msg):
        GenerationConfig(max_new_tokens=n)
    drafter = OracleDrafter(prompt + [1] * 8, V)
    with pytest.raises(ValueError, match=msg):
        speculative_generate(model, prompt, drafter, TREES[0], n)
    with pytest.raises(ValueError, match=msg):
        static_speculative_generate(model, prompt, drafter, TREES[0], n)


def test_the_steps_calls_refuse_positions_past_the_context_before_writing():
    """A step may hold more slots than the model's context (static_speculative_generate sizes them so), but no
    position may pass the context: prefill, decode and verify refuse it as forward_cached does, with nothing
    written (they raised IndexError from RoPE's table, and a failed prefill had marked its first chunks held)."""
    model = make_tiny({**DIMS, "max_seq_len": 32}, False)
    st = DecodeStep(model, max_len=64, buckets=(4, 8, 16))
    msg = "position {} is beyond the model's context of 32 tokens"
    with pytest.raises(ValueError, match=msg.format(39)):
        st.prefill(torch.arange(40)[None] % V)
    assert not st.held.any()
    st.prefill(torch.arange(30)[None] % V)
    held = st.held.clone()
    with pytest.raises(ValueError, match=msg.format(33)):  # root at position 30, a chain 3 deep
        st.verify(5, [1, 2, 3], st.tree_tensors([-1, 0, 1], [1, 2, 3]), 30, 30)
    for pos in (32, 40):
        with pytest.raises(ValueError, match=msg.format(pos)):
            st.decode(torch.tensor([5]), pos)
    assert torch.equal(st.held, held)
    st.decode(torch.tensor([5]), 30)
    st.decode(torch.tensor([6]), 31)  # the context's last position


def test_prefill_takes_exactly_the_slots_the_step_holds():
    """A step of 8 slots (and its scratch slot, where padding rows write) within a context of 32: 8 prompt
    tokens fit, in one call or two; a 9th is refused by name with nothing written. Taken, it would have been
    written to the scratch slot and marked held, where every padding row writes."""
    model = make_tiny({**DIMS, "max_seq_len": 32}, False)
    st = DecodeStep(model, max_len=8, buckets=(4, 8))
    with pytest.raises(ValueError, match="9 slots needed, the step holds 8"):
        st.prefill(torch.arange(9)[None] % V)
    assert not st.held.any()
    st.prefill(torch.arange(4)[None] % V)
    with pytest.raises(ValueError, match="9 slots needed, the step holds 8"):
        st.prefill(torch.arange(5)[None] % V, start=4)
    st.prefill(torch.arange(4)[None] % V, start=4)
    assert st.held[0, :8].all() and not st.held[0, st.scratch]


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_step_of_the_whole_context_serves_generations_that_reach_its_end(run_ahead):
    """A step of the default size (the model's context) reused by static_generate: a generation that ends at the
    context's last position writes no more slots than the context (its last token is never fed), so it runs,
    greedy and sampled, and gives generate's tokens (it was refused: "this call needs 33"). Run-ahead (CUDA's
    loop, forced here) queues no step past that either."""
    model = make_tiny({**DIMS, "max_seq_len": 32}, False)
    st = DecodeStep(model, buckets=(4, 8, 16))
    st.run_ahead = run_ahead
    assert st.max_len == 32
    for P, n in ((20, 5), (28, 5), (30, 3), (32, 1)):
        prompt = [(7 * i + 3) % V for i in range(P)]
        for cfg in (GenerationConfig(max_new_tokens=n), GenerationConfig(max_new_tokens=n, temperature=1.0, seed=3)):
            want = generate(model, [prompt], cfg)[0]
            assert len(want) == min(n, 33 - P)
            assert static_generate(model, [prompt], cfg, step=st)[0] == want

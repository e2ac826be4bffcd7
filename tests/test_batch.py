"""Continuous batching (engine/batch.py, issue 45): sequences join a running batch between steps and leave it
when done, each in its own cache row with its own length. In the q4 format every sequence's tokens equal
single-request decoding token for token -- greedy and seeded sampling, dense and gated (real skipping), with
prompt-lookup drafts in the batch -- whatever joins or leaves around it."""

from __future__ import annotations

import math
import random

import time

import pytest
import torch

from midlayer.engine.batch import BatchSequence, ContinuousBatch, StepCost
from midlayer.engine.generate import GenerationConfig, generate
from midlayer.engine.quantization import compress_weights
from midlayer.ops import kernels
from midlayer.speculative.lookup import PromptLookupDrafter
from tiny_models import make_tiny, RowWiseBLAS

V = 97
DIMS = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=96, multiple_of=32)
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")
# windowed blocks beside a global one (Gemma 3's pattern): the batch bounds the windowed layers per row
WINDOWED = dict(sliding_window=6, full_attention_layers=(2,), rope_theta_local=1e4)


def _q4(gating: bool = False, **over):
    return compress_weights(make_tiny({**DIMS, **over}, gating, seed=1), "q4")


def _workload(seed: int = 0, n: int = 12):
    """Prompts of 1..38 tokens that repeat their own start (so lookup finds drafts), and per-prompt budgets."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    prompts = [p + p[:8] for p in prompts]
    cfgs = [GenerationConfig(max_new_tokens=rng.randint(1, 40), stop_tokens=(5,)) for _ in prompts]
    return prompts, cfgs


def _shared_workload(seed: int = 0, n: int = 12):
    """Prompts that share starts, as chat prompts share their template's system turn: a 20-token "system" start
    and a random rest; some repeat an earlier prompt whole, some extend one (a follow-up turn)."""
    rng = random.Random(seed)
    system = [rng.randrange(V) for _ in range(20)]
    prompts: list[list[int]] = []
    for i in range(n):
        if i >= 2 and i % 4 == 2:
            prompts.append(list(prompts[i - 2]))
        elif i >= 2 and i % 4 == 3:
            prompts.append(prompts[i - 1] + [rng.randrange(V) for _ in range(rng.randint(1, 6))])
        else:
            prompts.append(system + [rng.randrange(V) for _ in range(rng.randint(1, 12))])
    cfgs = [GenerationConfig(max_new_tokens=rng.randint(1, 24), stop_tokens=(5,)) for _ in prompts]
    return prompts, cfgs


def _run(batch: ContinuousBatch, prompts, cfgs, seed: int = 0, join_p: float = 0.5):
    """Feed the prompts in at random steps (a join probability per step); collect each one's tokens. Also the
    most rows that ever ran together."""
    rng = random.Random(seed)
    handles, got, pending, most = {}, {}, list(range(len(prompts))), 0
    while pending or len(batch):
        if pending and rng.random() < join_p:
            i = pending.pop(0)
            handles[batch.add(prompts[i], cfgs[i])] = i
            got[i] = []
        for seq, tokens, _ in batch.step():
            got[handles[seq.handle]] += tokens
        most = max(most, len(batch.running))
    return [got[i] for i in range(len(prompts))], most


@needs_kernels
@pytest.mark.parametrize("gating", [False, True])
@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("windowed", [False, True])
def test_joining_and_leaving_rows_give_single_request_tokens(gating, lookup, windowed):
    """Every sequence's tokens equal single-request decoding: dense and gated (real skipping: per-row sparse
    writes), with and without lookup drafts, and with windowed blocks beside a global one, whose buffers the
    batch bounds per row (sparse writes and masks over rows with offsets of their own)."""
    model = _q4(gating, **(WINDOWED if windowed else {}))
    prompts, cfgs = _workload()
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    drafter = PromptLookupDrafter(V)
    batch = ContinuousBatch(model, max_rows=5, propose=drafter.chain if lookup else None, k=4 if lookup else 0,
                            initial_len=8)  # 8 slots at first: the cache grows while rows hold keys
    out, most = _run(batch, prompts, cfgs)
    assert out == ref
    assert most == 5  # rows really ran together, up to the cap (and the rest waited)
    assert batch.cache.max_len > 8 and not batch.running and not batch.waiting


@needs_kernels
def test_lookup_drafts_are_accepted_and_save_forwards():
    """A repetitive prompt: the rows accept drafts, so they need fewer batched forwards than tokens. Each row's
    rounds are those a chain of lookup drafts gives against its reference tokens, computed here by hand."""
    model = _q4()
    unit = [11, 23, 35, 47, 59, 71]
    prompts = [unit * 4, unit[2:] * 5, unit * 3]
    cfgs = [GenerationConfig(max_new_tokens=24)] * 3
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    drafter = PromptLookupDrafter(V)
    batch = ContinuousBatch(model, max_rows=3, propose=drafter.chain, k=4)
    # draft every step, as deep as each row allows: by timed costs a loaded machine may not draft at all (a CI
    # run on 2 busy cores drafted nothing)
    batch._pays = lambda lengths: max(lengths)
    handles = [batch.add(p, c) for p, c in zip(prompts, cfgs)]
    got = {h: [] for h in handles}
    seqs = {}
    while len(batch):
        for seq, tokens, _ in batch.step():
            got[seq.handle] += tokens
            seqs[seq.handle] = seq
    assert [got[h] for h in handles] == ref
    for h in handles:  # each round commits accepted drafts + 1; the first token came from the prefill
        s = seqs[h]
        assert sum(s.accept_hist) == s.forwards
        assert sum((a + 1) * n for a, n in enumerate(s.accept_hist)) >= len(ref[handles.index(h)]) - 1
    assert [seqs[h].accept_hist for h in handles] == [_lookup_rounds(drafter, p, r, 24, 4)
                                                       for p, r in zip(prompts, ref)]
    accepted = sum(a * n for s in seqs.values() for a, n in enumerate(s.accept_hist))
    forwards = sum(s.forwards for s in seqs.values())
    assert accepted > 0 and forwards < sum(len(r) for r in ref) - 3


def _lookup_rounds(drafter: PromptLookupDrafter, prompt: list[int], ref: list[int], budget: int, k: int) -> list[int]:
    """By hand: the rounds of one greedy row fed chain lookup drafts, by accepted count. The prefill gives the first
    token; each round drafts up to min(k, what the budget leaves past the round's own token) tokens and keeps the
    longest prefix that matches the reference, plus one token."""
    hist, new = [0] * (k + 1), [ref[0]]
    while len(new) < len(ref):
        draft = drafter.chain(prompt + new, min(k, budget - len(new) - 1))
        a = 0
        while a < len(draft) and len(new) + a < len(ref) and draft[a] == ref[len(new) + a]:
            a += 1
        hist[a] += 1
        new += ref[len(new):len(new) + a + 1]
    return hist


@needs_kernels
def test_logprobs_come_from_the_logits_that_chose_each_token():
    """A row asking for logprobs gets, per new token, its log-probability and alternatives from the column of the
    forward that chose it -- the prefill's for the first, the pending token's or an accepted draft's after --
    in q4 the bits of one forward over prompt and answer (`token_logprobs` over its rows), with lookup drafts
    accepted and rejected, and rows joining and leaving around it."""
    from midlayer.engine.generate import forward_cached, token_logprobs
    from midlayer.model.kv_cache import KVCache, kv_dtype

    model = _q4()
    unit = [11, 23, 35, 47, 59, 71]
    prompts = [unit * 4, [3, 9, 27, 81, 4], unit[2:] * 5 + [8]]
    cfgs = [GenerationConfig(max_new_tokens=20, stop_tokens=(5,))] * 3
    batch = ContinuousBatch(model, max_rows=3, propose=PromptLookupDrafter(V).chain, k=4)
    batch._pays = lambda lengths: max(lengths)  # draft every step (not by timed costs: a loaded machine drafts less)
    handles = [batch.add(p, c, logprobs=3 if i != 1 else None) for i, (p, c) in enumerate(zip(prompts, cfgs))]
    seqs = {}
    while len(batch):
        for seq, _, _ in batch.step():
            seqs[seq.handle] = seq
    assert sum(a * n for s in seqs.values() for a, n in enumerate(s.accept_hist)) > 0  # drafts were accepted
    assert seqs[handles[1]].scores == []
    for h in (handles[0], handles[2]):
        s = seqs[h]
        ids = torch.tensor([s.tokens])
        cache = KVCache.for_model(model.cfg, 1, max_len=len(s.tokens), dtype=kv_dtype(model))
        logits = forward_cached(model, ids, cache, torch.arange(len(s.tokens))[None])
        ref = token_logprobs(logits[0, s.prompt_len - 1:-1], ids[0, s.prompt_len:], 3)
        assert len(s.scores) == len(s.new) and s.scores == ref
        assert all(max(alts.values()) == lp for lp, alts in s.scores)  # greedy: the chosen token is the top one
    with pytest.raises(ValueError, match="logprobs"):
        batch.add([1, 2], GenerationConfig(), logprobs=-1)


@needs_kernels
def test_medusa_heads_draft_in_the_batch_from_each_rows_own_hidden_state():
    """A row drafter is handed each row's final residuals as the row commits them (after a join: the prompt's;
    after a step: the pending token's and the accepted drafts'); Medusa heads read the last, the one that
    predicted the row's pending token. At every call the states handed over are the bits a fresh prefill of the
    row's tokens gives at those positions, and every output is the single-request greedy one."""
    from midlayer.engine.generate import forward_cached
    from midlayer.model.kv_cache import KVCache, kv_dtype
    from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads

    model = _q4()
    heads = MedusaHeads(DIMS["dim"], 3)
    g = torch.Generator().manual_seed(4)
    for lin in heads.heads:  # small random heads: drafts that are sometimes right, sometimes not
        lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.05
    drafter = MedusaDrafter(model, heads)
    unit = [11, 23, 35, 47, 59, 71]
    prompts, cfgs = _workload(seed=5, n=6)
    prompts, cfgs = prompts + [unit * 4, unit * 3], cfgs + [GenerationConfig(max_new_tokens=30)] * 2
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    checked = []
    chains = drafter.chains

    def spied(rows, starts, hidden, tokens, k):
        for r, s, h, t in zip(rows, starts, hidden, tokens):
            seq = batch.running[r]
            n = seq.length
            assert s + h.shape[0] == n and t == seq.tokens[s + 1:n + 1]
            cache = KVCache.for_model(model.cfg, 1, DIMS["max_seq_len"], dtype=kv_dtype(model))
            _, want = forward_cached(model, torch.tensor([seq.tokens[:n]]), cache, torch.arange(n)[None],
                                     last_only=True, return_hidden=True, all_hidden=True)
            assert torch.equal(h, want[0, s:])
            checked.append(n)
        return chains(rows, starts, hidden, tokens, k)
    drafter.chains = spied

    batch = ContinuousBatch(model, max_rows=4, row_drafter=drafter, k=3)
    batch._pays = lambda lengths: max(lengths)  # draft every step (by timed costs a loaded machine drafts less)
    out, most = _run(batch, prompts, cfgs, seed=2)
    assert out == ref and most == 4
    assert len(checked) > 20
    with pytest.raises(ValueError, match="one drafter"):
        ContinuousBatch(model, propose=PromptLookupDrafter(V).chain, row_drafter=drafter)


def _spy_chains(owner, name: str, seqs_of, reference) -> list[int]:
    """Wrap owner.<name>, where a drafter hands the batch its chains: after every call each chain must equal
    reference(seq, len(chain)), the chain the one-sequence drafter drafts for that row's sequence (seqs_of(*args):
    the sequences of the call's chains, in order). Returns the lengths checked, filled as the batch runs."""
    real, checked = getattr(owner, name), []

    def spied(*args):
        got = real(*args)
        seqs = seqs_of(*args)
        assert len(seqs) == len(got)
        for seq, chain in zip(seqs, got):
            assert chain == reference(seq, len(chain))
            checked.append(len(chain))
        return got
    setattr(owner, name, spied)
    return checked


def _perturbed(module, scale: float, seed: int, vocab: torch.Tensor | None):
    """A draft module with seeded noise of `scale` added to every weight (untrained, not its identity start),
    on a draft vocabulary when `vocab` is given."""
    from midlayer.engine.draft_vocab import set_draft_vocab

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    if vocab is not None:
        set_draft_vocab(module, vocab)
    return module


def _eagle(model, seed: int = 3, vocab: torch.Tensor | None = None):
    """An EAGLE drafter over `model` with a random (untrained, not identity) head, on a draft vocabulary."""
    from midlayer.speculative.eagle import EagleDrafter, EagleHead

    return EagleDrafter(model, _perturbed(EagleHead.for_model(model), 0.05, seed, vocab))


@needs_kernels
@pytest.mark.parametrize("vocab", [False, True])
def test_eagle_drafts_in_the_batch_the_chains_it_drafts_alone(vocab):
    """EAGLE in the batch (`EagleRows`): each row's draft KV cache row is fed the base states of the positions
    it committed, and moves when the batch moves the row. At every step each row's chain equals, bit for bit,
    the top-1 chain a fresh one-sequence `EagleDrafter` drafts from the same tokens and base states (on the full
    vocabulary and on a draft vocabulary of every third token); every output equals single-request greedy
    decoding, with rows joining, leaving and moving around."""
    from midlayer.engine.generate import forward_cached
    from midlayer.model.kv_cache import KVCache, kv_dtype
    from midlayer.speculative.eagle import EagleRows
    from midlayer.speculative.protocol import DraftContext
    from midlayer.speculative.tree import DraftTree

    model = _q4()
    drafter = _eagle(model, vocab=torch.arange(0, V, 3) if vocab else None)
    prompts, cfgs = _workload(seed=2, n=8) if not vocab else _shared_workload(seed=2, n=10)
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    rows = EagleRows(drafter, 4, initial_len=8)  # 8 slots at first: the draft cache grows too
    batch = ContinuousBatch(model, max_rows=4, row_drafter=rows, k=3, initial_len=8)
    batch._pays = lambda lengths: max(lengths)  # draft every step, as deep as each row allows

    def alone(seq, depth):
        ids = seq.tokens[:seq.length + 1]
        cache = KVCache.for_model(model.cfg, 1, max_len=seq.length, dtype=kv_dtype(model))
        _, h = forward_cached(model, torch.tensor([ids[:-1]]), cache, torch.arange(seq.length)[None],
                              return_hidden=True, all_hidden=True)
        drafter.reset()
        ctx = DraftContext(model, None, ids, h[0], None, {}, DraftTree.chain(depth), 0.0, None)
        return drafter.propose(ctx).node_tokens.tolist()
    checked = _spy_chains(rows, "chains", lambda rs, *_: [batch.running[r] for r in rs], alone)
    out, most = _run(batch, prompts, cfgs, seed=1)
    assert out == ref and most == 4
    assert len(checked) > 20 and max(checked) == 3 and rows.cache.max_len > 8


@needs_kernels
@pytest.mark.parametrize("gating", [False, True])
@pytest.mark.parametrize("drafter", [None, "lookup", "eagle", "hidden-transfer", "early-exit"])
def test_prompts_that_start_alike_reuse_the_prefix_and_stay_exact(gating, drafter):
    """Prefix reuse (`ContinuousBatch._prefix`): a joining prompt that starts as a running row's tokens, or as
    what its free row still holds from a sequence that left, takes that prefix's K/V and prefills only the rest.
    Every output still equals single-request decoding (q4), dense and gated (real skipping: the key biases move
    too), with every kind of drafter (EAGLE's draft rows move with the prefix); and prefixes were reused."""
    from midlayer.speculative.eagle import EagleRows
    from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
    from midlayer.speculative.hidden_transfer import HiddenTransferRows

    model = _q4(gating)
    prompts, cfgs = _shared_workload(seed=7)
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    kw = {None: lambda: {}, "lookup": lambda: dict(propose=PromptLookupDrafter(V).chain),
          "eagle": lambda: dict(row_drafter=EagleRows(_eagle(model), 3)),
          "hidden-transfer": lambda: dict(fused=HiddenTransferRows(_transfer(model, [1, 2, 2]))),
          "early-exit": lambda: dict(self_drafter=EarlyExitDrafter(model, EarlyExitHead(model.cfg.dim, 2)))}[drafter]()
    batch = ContinuousBatch(model, max_rows=3, k=3, **kw)
    if drafter is not None:
        batch._pays = lambda lengths: max(lengths)
    reused = []
    join = batch._join
    batch._join = lambda seqs, events: (join(seqs, events), reused.extend(x.reused for x in seqs))
    out, most = _run(batch, prompts, cfgs, seed=3)
    assert out == ref and most == 3
    assert sum(1 for r in reused if r >= 16) >= 6 and max(reused) > 20  # the system start, and whole prompts


@needs_kernels
def test_prompts_arriving_together_with_one_start_share_one_prefill_of_it():
    """Four prompts with one 20-token start arrive at once: the first joins, the others wait one step (`_defer`)
    and then join together, each reusing the start from the first's row. A prompt with another start is not held
    back. Outputs exact."""
    model = _q4()
    prompts, _ = _shared_workload(seed=3, n=2)
    system = prompts[0][:20]
    rng = random.Random(0)
    prompts = [system + [rng.randrange(V) for _ in range(5 + i)] for i in range(4)] + [[7, 8, 9] * 8]
    cfg = GenerationConfig(max_new_tokens=5)
    batch = ContinuousBatch(model, max_rows=5)
    handles = [batch.add(p, cfg) for p in prompts]
    got = {h: [] for h in handles}
    reused = {}
    first = True
    while len(batch):
        for seq, tokens, _ in batch.step():
            got[seq.handle] += tokens
            reused[seq.handle] = seq.reused
        if first:
            assert sorted(x.handle for x in batch.running) == [handles[0], handles[4]] and len(batch.waiting) == 3
            first = False
    assert [got[h] for h in handles] == [generate(model, [p], cfg)[0] for p in prompts]
    assert [reused[h] for h in handles] == [0, 20, 20, 20, 0]


@needs_kernels
def test_with_bounded_windows_a_prompt_waits_only_for_a_joiner_that_will_still_hold_the_start():
    """`_defer` with windowed layers bounded per row: B, sharing A's start, waits a step for A's row only if A's
    prompt and next step fit A's columns (A then keeps every key, and B reuses the start); a longer A drops keys in
    its own prefill and could lend nothing, so B joins at once beside it. Outputs exact either way."""
    model = _q4(**WINDOWED)  # W = 6; with k = 0 a row holds 5 + 6 = 11 columns
    rng = random.Random(0)
    start = [rng.randrange(6, V) for _ in range(5)]
    for rest, waits in ((3, True), (25, False)):
        a, b = ([*start, *(rng.randrange(6, V) for _ in range(rest))] for _ in range(2))
        cfg = GenerationConfig(max_new_tokens=4)
        batch = ContinuousBatch(model, max_rows=4, k=0, prefix_reuse=3)
        ha, hb = batch.add(a, cfg), batch.add(b, cfg)
        got = {ha: [], hb: []}
        seqs = {}
        for seq, tokens, _ in batch.step():
            got[seq.handle] += tokens
        assert (hb in [x.handle for x in batch.waiting]) == waits
        while len(batch):
            for seq, tokens, _ in batch.step():
                got[seq.handle] += tokens
                seqs[seq.handle] = seq
        assert [got[ha], got[hb]] == [generate(model, [p], cfg)[0] for p in (a, b)]
        assert seqs[hb].reused == (len(start) if waits else 0)


@needs_kernels
@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("drafter", [None, "lookup", "eagle", "hidden-transfer", "layer-skip"])
def test_random_arrivals_cancels_and_shared_starts_stay_exact(drafter, windowed):
    """A stress run: over five seeds, prompts with shared starts (repeats, follow-up turns) arrive at random
    steps into a batch of 1-4 rows, some are cancelled at random steps (a client gone), rows move, free rows
    remember and are reused, the cache grows from 8 slots, and every drafter kind drafts as deep as it can.
    Every sequence that ran to its end equals single-request greedy decoding; a cancelled one got a prefix of
    it. After every step, every running row and every free row's memory hold their tokens' K/V as a fresh
    prefill does. `windowed`: windowed blocks beside a global one, whose buffers in the batch hold 2 W - 1
    columns per row (plus the scratch ones) and drop each row's passed keys on their own: prompts longer than W
    are prefilled W at a time, rows' offsets differ, and a row that dropped keys a joiner's window would see is
    no donor for it (without that rule this test fails)."""
    from midlayer.speculative.eagle import EagleRows
    from midlayer.speculative.hidden_transfer import HiddenTransferRows
    from midlayer.speculative.layer_skip import LayerSkipDrafter

    model = _q4(**(WINDOWED if windowed else {}))
    prompts, cfgs = _shared_workload(seed=11, n=14)
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    seen_offsets: set[tuple[int, ...]] = set()
    for seed in range(5):
        rng = random.Random(seed)
        kw = {None: lambda: {}, "lookup": lambda: dict(propose=PromptLookupDrafter(V).chain),
              "eagle": lambda: dict(row_drafter=EagleRows(_eagle(model), 4, initial_len=8)),
              "hidden-transfer": lambda: dict(fused=HiddenTransferRows(_transfer(model, [1, 2, 3]))),
              "layer-skip": lambda: dict(self_drafter=LayerSkipDrafter(model, [2]))}[drafter]()
        batch = ContinuousBatch(model, max_rows=rng.randint(1, 4), k=3, initial_len=8, **kw)
        if drafter is not None:
            batch._pays = lambda lengths: max(lengths)
        handles, got, gone, pending = {}, {}, set(), list(range(len(prompts)))
        while pending or len(batch):
            if pending and rng.random() < 0.4:
                i = pending.pop(0)
                handles[batch.add(prompts[i], cfgs[i])] = i
                got[i] = []
            live = [h for h in handles if handles[h] not in gone and h in batch.by_handle]
            if live and rng.random() < 0.05:
                h = rng.choice(live)
                batch.cancel(h)
                gone.add(handles[h])
            for seq, tokens, _ in batch.step():
                got[handles[seq.handle]] += tokens
            _memory_is_a_prefill(model, batch)
            if windowed:
                c = batch.cache
                assert all(c.k_layers[layer].shape[2] <= 2 * 6 - 1 + batch.scratch for layer in c.local_layers)
                seen_offsets.add(tuple(c.row_offs[:len(batch.running)]))
        for i in range(len(prompts)):
            assert got[i] == ref[i] if i not in gone else got[i] == ref[i][:len(got[i])], (seed, i)
    if windowed:  # keys were dropped, and rows with different offsets ran in one forward
        assert any(len(set(offs)) > 1 for offs in seen_offsets) and max(max(o, default=0) for o in seen_offsets) > 6


def _memory_is_a_prefill(model, batch: ContinuousBatch) -> None:
    """Every running row (its committed tokens) and every free row that remembers a left sequence (`batch.memory`)
    holds, at every layer, the K/V a fresh prefill of those tokens gives (q4: the same bits), and their
    positions. A bounded windowed layer holds them from the row's offset on, from its column 0."""
    from midlayer.engine.generate import forward_cached
    from midlayer.model.kv_cache import KVCache, kv_dtype

    held = {row: tokens for row, (tokens, _) in batch.memory.items()}
    held.update({seq.row: seq.tokens[:seq.length] for seq in batch.running})
    c = batch.cache
    for row, tokens in held.items():
        n = len(tokens)
        fresh = KVCache.for_model(model.cfg, 1, max_len=n, dtype=kv_dtype(model))
        forward_cached(model, torch.tensor([tokens]), fresh, torch.arange(n)[None])
        for layer in range(model.cfg.n_layers):
            off = c.row_offset(row) if layer in c.local_layers else 0
            assert off <= max(n - 5, 0), (row, off, n)  # (W - 1 = 5 keys before the next query are kept)
            for mine, ref in ((c.k_layers, fresh.k), (c.v_layers, fresh.v)):
                assert torch.equal(mine[layer][row, :, :n - off], ref[layer, 0, :, off:n]), (row, layer)
        assert c.pos[row, :n].tolist() == list(range(n)), row


@needs_kernels
def test_a_free_row_remembers_what_it_held():
    """One row, requests one after another: the second finds the first's K/V still in the row (a system start
    and more) and prefills only the rest; `prefix_reuse=0` turns reuse off. Outputs exact either way."""
    model = _q4()
    prompts, _ = _shared_workload(seed=1, n=2)
    cfg = GenerationConfig(max_new_tokens=6)
    for threshold, want in ((16, 20), (0, 0)):
        batch = ContinuousBatch(model, max_rows=1, prefix_reuse=threshold)
        for p in prompts:
            seq, steps = batch.alone(p, cfg)
            assert [t for toks in steps for t in toks] == generate(model, [p], cfg)[0]
        assert seq.reused == want
    with pytest.raises(ValueError, match="prefix_reuse"):
        ContinuousBatch(model, prefix_reuse=-1)


def test_swap_rows_trades_each_rows_first_slots_and_leaves_the_rest():
    """`KVCache.swap_rows(a, b, la, lb)`: row a's first la slots (K, V, key biases, positions) become row b's and
    row b's first lb row a's; slots past those, and other rows, are untouched."""
    from midlayer.model.kv_cache import KVCache

    torch.manual_seed(0)
    c = KVCache(2, 3, 2, 4, 10)
    for t in (c.k, c.v, c.bias):
        t.copy_(torch.randn_like(t))
    c.pos.copy_(torch.randint(0, 99, c.pos.shape))
    before = [t.clone() for t in (c.k, c.v, c.bias, c.pos)]
    c.swap_rows(0, 2, 7, 4)
    for new, old, row_dim in zip((c.k, c.v, c.bias, c.pos), before, (1, 1, 1, 0)):
        def at(t, r, first, stop):
            return t.select(row_dim, r)[..., first:stop, :] if t.dim() == 5 else t.select(row_dim, r)[..., first:stop]
        assert torch.equal(at(new, 2, 0, 7), at(old, 0, 0, 7)) and torch.equal(at(new, 0, 0, 4), at(old, 2, 0, 4))
        assert torch.equal(at(new, 0, 4, 10), at(old, 0, 4, 10)) and torch.equal(at(new, 2, 7, 10), at(old, 2, 7, 10))
        assert torch.equal(new.select(row_dim, 1), old.select(row_dim, 1))


def test_rows_with_offsets_of_their_own_map_columns_to_slots_by_hand():
    """A bounded windowed layer with an offset per row (the continuous batch's cache): local_len 5, window 3, 2 scratch
    columns. `make_room_row` keeps the W - 1 = 2 keys before the new tokens, moved to the front; a forward whose
    rows' offsets differ maps columns to slots (`key_slots`) as worked out here by hand; copies carry the offset."""
    from midlayer.model.kv_cache import KVCache, LayerView

    c = KVCache(2, 3, 1, 1, 20, local=([1], 5, 3), spare=2, row_offsets=True)
    assert c.k_layers[0].shape[2] == 20 and c.k_layers[1].shape[2] == 7  # layer 1 windowed: 5 + 2 columns
    c.k_layers[1][0, 0, :5, 0] = torch.arange(5.0)  # row 0 holds slots 0..4 (value = slot) at columns 0..4
    c.make_room_row(0, 5, 1)  # slot 5 does not fit: keep slots 3, 4 (the next query's window) at columns 0, 1
    assert c.row_offs[0] == 3 and c.k_layers[1][0, 0, :2, 0].tolist() == [3.0, 4.0]
    c.make_room_row(0, 5, 3)  # 2 kept + 3 new = 5: fits, nothing moves
    assert c.row_offs[0] == 3
    with pytest.raises(ValueError, match="do not fit"):  # 2 kept + 4 new > 5: refused, nothing dropped
        c.make_room_row(0, 6, 4)
    assert c.row_offs[0] == 3 and c.k_layers[1][0, 0, :2, 0].tolist() == [3.0, 4.0]
    # a forward over rows at offsets 3, 0, 7 whose scratch slots start at 10, from column E = 5
    c.row_offs[1:] = [0, 7]
    view = c.rows(0, 3)
    assert view.row_offs == [3, 0, 7] and view.offset(1) is None and view.offset(0) == 0
    view.length = 12
    with pytest.raises(ValueError, match="scratch"):  # a forward over such rows must say where its scratch goes
        LayerView(view, 1, torch.zeros(3, 1, dtype=torch.long), valid=torch.ones(3, 1, dtype=torch.bool)).update(
            torch.zeros(3, 1, 1, 1), torch.zeros(3, 1, 1, 1))
    view.scratch = (10, 5)
    slots, hidden = view.key_slots()
    assert slots.tolist() == [[3, 4, 5, 6, 7, 10, 11], [0, 1, 2, 3, 4, 10, 11], [7, 8, 9, 10, 11, 10, 11]]
    assert hidden.tolist() == [[False] * 7, [False] * 7, [False, False, False, True, True, False, False]]
    same = c.rows(1, 2)  # one row (or rows at one offset): the cache's shared-offset path
    assert same.row_offs is None and same.local_off == 0 and same.offset(1) == 0
    c.copy_row(0, 2, 6)  # row 0's slots 0..5: the windowed layer from its offset 3 on, and the offset with it
    assert c.row_offs[2] == 3 and c.k_layers[1][2, 0, :2, 0].tolist() == [3.0, 4.0]
    with pytest.raises(ValueError, match="hold slots 3"):  # fewer slots than row 0 has dropped
        c.copy_row(0, 1, 2)


def _follow_up(model, seed: int):
    """Prompts A, B, C (18, 9 and 11 random tokens), D = A + A's answer + a new turn of 5, and their settings
    (A answers in 4 tokens, B runs 30, C 10, D 6); and A's answer."""
    rng = random.Random(seed)
    pa, pb, pc = ([rng.randrange(6, V) for _ in range(n)] for n in (18, 9, 11))
    cfgs = [GenerationConfig(max_new_tokens=n) for n in (4, 30, 10, 6)]
    answer = generate(model, [pa], cfgs[0])[0]
    return pa, pb, pc, pa + answer + [rng.randrange(6, V) for _ in range(5)], cfgs, answer


@needs_kernels
@pytest.mark.parametrize("drafter", [None, "eagle"])
def test_a_follow_up_turn_finds_its_previous_turn_after_others_joined(drafter):
    """Sequence A leaves from the first row while B runs: the rows swap, so A's K/V stay in the freed row
    (`_leave`). C, an unrelated prompt, then takes that row: A's K/V move to another free row first
    (`_keep_memory`). D, A's prompt and answer and a new turn, finds them there and prefills only its new part.
    Outputs equal single-request decoding (q4), with EAGLE's draft rows swapped and moved along."""
    from midlayer.speculative.eagle import EagleRows

    model = _q4()
    pa, pb, pc, pd, cfgs, answer = _follow_up(model, seed=5)
    kw = {} if drafter is None else dict(row_drafter=EagleRows(_eagle(model), 3))
    batch = ContinuousBatch(model, max_rows=3, k=3, **kw)
    if drafter is not None:
        batch._pays = lambda lengths: max(lengths)
    got, seqs = {}, {}

    def step() -> None:
        for seq, tokens, _ in batch.step():
            got[seq.handle] = got.get(seq.handle, []) + tokens
            seqs[seq.handle] = seq

    def until(handle) -> None:
        while handle in batch.by_handle:
            step()
    ha = batch.add(pa, cfgs[0])
    hb = batch.add(pb, cfgs[1])
    until(ha)
    assert [x.handle for x in batch.running] == [hb] and list(batch.memory) == [1]
    hc = batch.add(pc, cfgs[2])
    step()
    assert [x.handle for x in batch.running] == [hb, hc] and list(batch.memory) == [2]
    hd = batch.add(pd, cfgs[3])
    for h in (hb, hc, hd):
        until(h)
    assert [got[h] for h in (ha, hb, hc, hd)] == [generate(model, [p], c)[0] for p, c in zip((pa, pb, pc, pd), cfgs)]
    # D reuses A's prompt and answer but the last answer token (never fed); with EAGLE, as far as A's draft entries
    # go and one fewer (`_prefix`)
    shared = len(pa) + len(answer) - 1
    want = shared if drafter is None else min(shared - 1, seqs[ha].fed)
    assert seqs[hd].reused == want and want >= len(pa) and seqs[hc].reused == 0


@needs_kernels
@pytest.mark.parametrize("drafter", [None, "eagle"])
def test_memory_rows_keep_a_full_batchs_left_sequences_for_their_follow_ups(drafter):
    """A full batch (2 rows): A leaves and C, waiting, takes its row at once. Without memory rows A's K/V are gone
    when its follow-up D joins; with one memory row C's join moves them there first (`_keep_memory`), and D
    reuses A's prompt and answer. Outputs equal single-request decoding either way (q4), with EAGLE's draft rows
    moved along; a row drafter with fewer rows than the batch's cache is refused."""
    from midlayer.speculative.eagle import EagleRows

    model = _q4()
    pa, pb, pc, pd, cfgs, answer = _follow_up(model, seed=7)
    ref = [generate(model, [p], c)[0] for p, c in zip((pa, pb, pc, pd), cfgs)]
    shared = len(pa) + len(answer) - 1  # (the last answer token was never fed)
    for memory_rows in (0, 1):
        kw = {} if drafter is None else dict(row_drafter=EagleRows(_eagle(model), 2 + memory_rows))
        batch = ContinuousBatch(model, max_rows=2, k=3, memory_rows=memory_rows, **kw)
        if drafter is not None:
            batch._pays = lambda lengths: max(lengths)
        got, seqs = {}, {}
        handles = [batch.add(p, c) for p, c in zip((pa, pb, pc), cfgs)]
        while handles[0] in batch.by_handle or any(x.handle == handles[2] for x in batch.waiting):
            for seq, tokens, _ in batch.step():
                got[seq.handle] = got.get(seq.handle, []) + tokens
                seqs[seq.handle] = seq
        assert len(batch.running) == 2  # C took A's row at once: the batch stayed full
        handles.append(batch.add(pd, cfgs[3]))
        while len(batch):
            for seq, tokens, _ in batch.step():
                got[seq.handle] = got.get(seq.handle, []) + tokens
                seqs[seq.handle] = seq
        assert [got[h] for h in handles] == ref, memory_rows
        want = 0 if memory_rows == 0 else shared if drafter is None else min(shared - 1, seqs[handles[0]].fed)
        assert seqs[handles[3]].reused == want and (memory_rows == 0 or want >= len(pa))
    if drafter is not None:
        with pytest.raises(ValueError, match="row drafter keeps 2 rows"):
            ContinuousBatch(model, max_rows=2, memory_rows=1, row_drafter=EagleRows(_eagle(model), 2))
    with pytest.raises(ValueError, match="memory_rows >= 0"):
        ContinuousBatch(model, max_rows=2, memory_rows=-1)


@needs_kernels
def test_a_row_whose_drafts_stopped_paying_tries_again_and_finds_the_good_ones():
    """The depth rule's forgetting (`forget`): a proposer that is wrong for the first 12 steps and right after. The
    row's estimate falls until no draft pays, and the row stops drafting. Without forgetting (forget=1) it never
    drafts again; with it, its estimate drifts back to its prior, it tries again, finds the drafts right and
    takes them. The step's cost line is fixed (a = 1, b = 0.3: a draft pays while p > ~0.23), so the rule is
    deterministic. Output exact either way."""
    model = _q4()
    prompt, cfg = [3, 14, 15, 92, 65, 35], GenerationConfig(max_new_tokens=60)
    ref = generate(model, [prompt], cfg)[0]
    runs = {}
    for forget in (1.0, 0.9):
        steps = []

        def propose(tokens, k):
            t = len(tokens) - len(prompt)  # ref[t - 1] is the pending token, ref[t..] the right draft
            right = ref[t:t + k]
            return right if len(steps) > 12 else [(x + 1) % V for x in right]
        batch = ContinuousBatch(model, max_rows=1, k=3, propose=propose, accept_prior=lambda ids: 0.9,
                                forget=forget)
        batch.cost.line = lambda load=None: (1.0, 0.3)
        seq, it = batch.alone(prompt, cfg)
        out = []
        for toks in it:
            steps.append((seq.hits, seq.tries))
            out += toks
        assert out == ref
        runs[forget] = seq.accept_hist
    assert sum(runs[1.0][1:]) == 0  # it never took a draft token: wrong first, then never tried again
    assert sum(runs[0.9][1:]) >= 5 and runs[0.9][3] >= 3  # it tried again and took whole chains
    with pytest.raises(ValueError, match="forget"):
        ContinuousBatch(model, forget=0.0)


@needs_kernels
def test_eagle_in_the_batch_accepts_drafts_and_stays_exact():
    """An EAGLE head that predicts the base's own next feature (its identity start, fhat = f) drafts the token
    the base chose last: on prompts that loop, rows accept drafts and save forwards; the output is exact."""
    from midlayer.speculative.eagle import EagleDrafter, EagleHead, EagleRows

    model = _q4()
    drafter = EagleDrafter(model, EagleHead.for_model(model))
    _accepts_on_loops(model, row_drafter=EagleRows(drafter, 3), k=4)


def _all_at_once(batch: ContinuousBatch, prompts, cfgs):
    """Every prompt added at once, the batch stepped until empty: each one's new tokens and its sequence."""
    handles = [batch.add(p, c) for p, c in zip(prompts, cfgs)]
    got, seqs = {h: [] for h in handles}, {}
    while len(batch):
        for seq, tokens, _ in batch.step():
            got[seq.handle] += tokens
            seqs[seq.handle] = seq
    return [got[h] for h in handles], [seqs[h] for h in handles]


def _accepts_on_loops(model, **drafting) -> None:
    """Three prompts that loop, decoded together with a drafter that repeats what the base chose last, drafting
    every step (the rule follows measured step times): exact output, drafts accepted, forwards saved."""
    unit = [11, 23, 35, 47, 59, 71]
    prompts = [unit * 4, [7] * 12, unit[2:] * 5]
    cfgs = [GenerationConfig(max_new_tokens=24)] * 3
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    batch = ContinuousBatch(model, max_rows=3, **drafting)
    batch._pays = lambda lengths: max(lengths)
    out, seqs = _all_at_once(batch, prompts, cfgs)
    assert out == ref
    accepted = sum(a * n for s in seqs for a, n in enumerate(s.accept_hist))
    forwards = sum(s.forwards for s in seqs)
    assert accepted > 0 and forwards < sum(len(r) for r in ref) - 3


def _transfer(model, layers, seed: int = 0, vocab: torch.Tensor | None = None):
    """A hidden-transfer drafter over `model`: identity maps plus noise (so every part of the mask matters)."""
    from midlayer.speculative.hidden_transfer import HiddenTransfer, HiddenTransferDrafter

    return HiddenTransferDrafter(model, _perturbed(HiddenTransfer(model.cfg.dim, layers), 0.3, seed, vocab))


@needs_kernels
@pytest.mark.parametrize("vocab", [False, True])
def test_hidden_transfer_drafts_in_the_batch_the_chains_it_drafts_alone(vocab, monkeypatch):
    """Hidden transfer in the batch (`HiddenTransferRows`, the fused pass of arXiv 2404.12022 sec. 3.4): each
    step's forward carries the pseudo rows of every column of every row, and the rows of each row's anchor (its
    last accepted token) are its next chain. Every chain equals, bit for bit, the top-1 chain the one-sequence
    drafter's separate pass (`pseudo_logits_cached`) drafts from a fresh prefill of the same tokens (full
    vocabulary and a draft vocabulary); every output equals single-request greedy decoding, with rows joining,
    leaving and moving, drafts of different lengths (padding columns) and the cache growing. The transfer's
    maps are fp32 products, whose rounding a BLAS may choose by the row count (an AVX-512 Xeon's MKL flipped a
    near-tie of the draft-vocabulary chain): they run on RowWiseBLAS, so that the fused pass's own
    arithmetic is what is compared."""
    from midlayer.engine.draft_vocab import draft_vocab
    from midlayer.engine.generate import forward_cached
    from midlayer.model.kv_cache import KVCache, kv_dtype
    from midlayer.speculative.drafting import topk_lists
    from midlayer.speculative.hidden_transfer import HiddenTransferRows, pseudo_logits_cached

    RowWiseBLAS().install(monkeypatch)
    model = _q4()
    drafter = _transfer(model, [1, 2, 2], vocab=torch.arange(0, V, 3) if vocab else None)
    prompts, cfgs = _workload(seed=2, n=8)
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    rows = HiddenTransferRows(drafter)
    batch = ContinuousBatch(model, max_rows=4, fused=rows, k=3, initial_len=8)
    batch._pays = lambda lengths: max(lengths)  # draft every step, as deep as each row allows
    t = drafter.transfer

    def alone(seq, _):
        n = seq.length  # tokens[:n] are in the cache; the anchor is position n - 1
        cache = KVCache.for_model(model.cfg, 1, max_len=n + t.k, dtype=kv_dtype(model))
        capture = {b: None for b in set(t.layers)}
        forward_cached(model, torch.tensor([seq.tokens[:n]]), cache, torch.arange(n)[None], capture=capture)
        logits = pseudo_logits_cached(model, t, cache, n - 1, {b: h[0, -1] for b, h in capture.items()}, t.k,
                                      draft_head=True)
        return [c[0] for c in topk_lists(logits, [1] * t.k, draft_vocab(t))]
    # the rows `_decode` asked for, in order: those still going
    checked = _spy_chains(rows, "chains", lambda *_: [s for s in batch.running if not s.done], alone)
    out, most = _run(batch, prompts, cfgs, seed=1)
    assert out == ref and most == 4
    assert len(checked) > 20 and max(checked) == 3 and batch.cache.max_len > 8


@needs_kernels
def test_hidden_transfer_in_the_batch_accepts_drafts_and_stays_exact():
    """Identity maps after the last block (t_i = L) make each pseudo state a copy of the anchor's final state, so
    every chain repeats the pending token: accepted where the base repeats a token, rejected elsewhere. Rows
    accept drafts and save forwards; the output is exact; the step's cost line counts the pseudo rows."""
    from midlayer.speculative.hidden_transfer import HiddenTransfer, HiddenTransferDrafter, HiddenTransferRows

    model = _q4()
    L = model.cfg.n_layers
    rows = HiddenTransferRows(HiddenTransferDrafter(model, HiddenTransfer(model.cfg.dim, [L, L, L])))
    assert rows.rows_per_column == 0.0  # rows that join after the last block run no block
    _accepts_on_loops(model, fused=rows, k=3)


def _self_drafters(model, vocab: bool):
    """Early exit (a perturbed exit map at block 2, optionally on a draft vocabulary of every third token), layer
    skip (blocks 1-2 passed through) and skip gates (fresh gates: the gated twin skips nothing)."""
    from midlayer.engine.draft_vocab import set_draft_vocab
    from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
    from midlayer.speculative.layer_skip import LayerSkipDrafter
    from midlayer.speculative.skip_gates import GatedDrafter, SkipGates

    head = EarlyExitHead(model.cfg.dim, 2)
    with torch.no_grad():
        head.proj.weight.add_(0.2 * torch.randn(head.proj.weight.shape, generator=torch.Generator().manual_seed(5)))
    if vocab:
        set_draft_vocab(head, torch.arange(0, V, 3))
    return {"early-exit": EarlyExitDrafter(model, head), "layer-skip": LayerSkipDrafter(model, [1, 2]),
            "skip-gates": GatedDrafter(model, SkipGates.for_model(model))}


@needs_kernels
@pytest.mark.parametrize("kind", ["early-exit", "layer-skip", "skip-gates"])
def test_self_drafters_draft_in_the_batch_the_chains_they_draft_alone(kind):
    """Early exit, layer skip and skip gates in the batch (`self_drafter`): a partial forward of the base's own
    blocks per chain token over every row at its own slot. Each chain equals, bit for bit, the chain the
    one-sequence drafter drafts from a fresh prefill of the same tokens; every output equals single-request
    greedy decoding, with rows joining, leaving and moving; the draft K/V never outlives its step (a layer-skip
    draft writes only some layers)."""
    from midlayer.engine.generate import forward_cached
    from midlayer.model.kv_cache import KVCache, kv_dtype
    from midlayer.speculative.protocol import DraftContext
    from midlayer.speculative.tree import DraftTree

    model = _q4()
    drafter = _self_drafters(model, vocab=kind == "early-exit")[kind]
    prompts, cfgs = _workload(seed=2, n=8)
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    batch = ContinuousBatch(model, max_rows=4, self_drafter=drafter, k=3, initial_len=8)
    batch._pays = lambda lengths: max(lengths)  # draft every step, as deep as each row allows

    def alone(seq, depth):
        ids = seq.tokens[:seq.length + 1]
        cache = KVCache.for_model(model.cfg, 1, max_len=seq.length + 8, dtype=kv_dtype(model))
        forward_cached(model, torch.tensor([ids[:-1]]), cache, torch.arange(seq.length)[None])
        ctx = DraftContext(model, cache, ids, torch.zeros(0, model.cfg.dim), None, {}, DraftTree.chain(depth), 0.0,
                           None)
        return list(drafter.propose(ctx).node_tokens)
    checked = _spy_chains(batch, "_self_chains", lambda cut, rows: [batch.running[i] for i in rows], alone)
    out, most = _run(batch, prompts, cfgs, seed=1)
    assert out == ref and most == 4
    assert len(checked) > 20 and max(checked) == 3


@needs_kernels
def test_a_self_drafter_that_is_the_base_is_always_right_in_the_batch():
    """Layer skip of no block is the base itself: every drafted token is accepted, so each row takes 1 + D tokens
    a forward, until its budget; outputs exact. Its draft forwards fit a cost line of their own."""
    from midlayer.speculative.layer_skip import LayerSkipDrafter

    model = _q4()
    prompts, cfgs = _workload(seed=5, n=6)
    cfgs = [GenerationConfig(max_new_tokens=c.max_new_tokens) for c in cfgs]  # no stop token
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    batch = ContinuousBatch(model, max_rows=3, self_drafter=LayerSkipDrafter(model, []), k=3)
    batch._pays = lambda lengths: max(lengths)
    out, seqs = _all_at_once(batch, prompts, cfgs)
    assert out == ref
    for seq in seqs:  # every round accepts its whole draft: rejections never happen
        judged = sum(n for a, n in enumerate(seq.accept_hist) if a > 0)
        assert seq.tries - 2.0 == seq.hits - 1.0 and seq.forwards == sum(seq.accept_hist) and judged > 0
    assert batch.draft_cost.line() is not None


def test_the_fused_drafters_rows_are_priced_into_the_depth():
    """`_pays` with a fused drafter, by hand, one row, p = 0.5. Plain line a = 1, b = 0.1: without fused rows
    D = 1 gives 1.5 / 1.2 = 1.25 tokens/s against 1 / 1.1 = 0.909 for D = 0. With w = 3 more rows per column and
    no forward yet timed with them, D = 1 costs 1 + 0.1 * 2 * 4 = 1.8: 1.5 / 1.8 = 0.833 < 0.909, no draft. Once
    the forwards that carried them fit a line of their own, a = 1, b = 0.15: 1.5 / 1.3 = 1.154, a draft."""
    class Fused:
        k, rows_per_column = 3, 3.0

    model = make_tiny(DIMS, False)
    for fused, want in ((None, 1), (Fused(), 0)):
        batch = ContinuousBatch(model, propose=None if fused else (lambda toks, n: [0] * n), fused=fused, k=1)
        batch.cost.add(1, 1.1)
        batch.cost.add(2, 1.2)
        seq = BatchSequence(0, [1], 1, GenerationConfig(), 1, None, hits=1.0, tries=2.0)
        batch.running = [seq]
        assert batch.cost.line() == pytest.approx((1.0, 0.1))
        assert batch._pays([1]) == want
    batch.fused_cost.add(1, 1.15)
    batch.fused_cost.add(2, 1.3)
    assert batch._pays([1]) == 1
    batch.cost.clear()  # the plain line from the fused one (b / (1 + w) = 0.0375): D = 0 gives 1 / 1.0375
    assert batch._pays([1]) == 1


def test_the_cost_line_is_fitted_at_the_load_it_prices():
    """`StepCost`: weighted least squares, a forward weighing LOAD_WEIGHT = 4 times less per doubling between the
    load it ran at and the priced one. Forwards of 1 and 3 rows at load 1 (0.1 s a row), of 16 and 48 rows at
    load 16 (0.2 s a row): priced at load 16 the light ones weigh w = 4^-4 each against 1 (the weighted fit,
    written out), nearly the busy load's line; unweighted (load None) the plain fit; at load 1, nearly the
    light load's."""
    now = [0]
    cost = StepCost(clock=lambda: now[0])
    pts = [(1, 1.0, 1), (3, 1.2, 1), (16, 4.0, 16), (48, 10.4, 16)]
    for r, t, n in pts:
        cost.add(r, t, n)

    def fit(w):
        W = sum(w)
        mr = sum(wi * r for wi, (r, _, _) in zip(w, pts)) / W
        mt = sum(wi * t for wi, (_, t, _) in zip(w, pts)) / W
        b = (sum(wi * (r - mr) * (t - mt) for wi, (r, t, _) in zip(w, pts))
             / sum(wi * (r - mr) ** 2 for wi, (r, _, _) in zip(w, pts)))
        return mt - b * mr, b

    w = 4.0 ** -4
    assert cost.line(16) == pytest.approx(fit([w, w, 1, 1]), rel=1e-12)
    assert cost.line(16) == pytest.approx((0.8, 0.2), abs=2e-3)  # nearly the busy load's own line: 0.2 s a row
    assert cost.line() == pytest.approx(fit([1, 1, 1, 1]), rel=1e-12)
    assert cost.line(1)[1] < 0.2 and cost.line(1) == pytest.approx(fit([1, 1, w, w]), rel=1e-12)
    assert StepCost().line() is None
    # a window of 5 over 23 forwards (the sums kept per load as points leave, and now and then afresh): the fit
    # of the last 5, at every load
    small, rng = StepCost(window=5), random.Random(0)
    for _ in range(23):
        small.add(rng.randint(1, 40), rng.uniform(0.5, 3.0), rng.choice([1, 2, 4, 16]))
    last = [(r, t, n) for r, t, n, _ in small.points]
    checked = 0
    for load in (1, 3, 16):
        w = [4.0 ** -abs(math.log2(n / load)) for _, _, n in last]
        W = sum(w)
        mr = sum(wi * r for wi, (r, _, _) in zip(w, last)) / W
        mt = sum(wi * t for wi, (_, t, _) in zip(w, last)) / W
        b = (sum(wi * (r - mr) * (t - mt) for wi, (r, t, _) in zip(w, last))
             / sum(wi * (r - mr) ** 2 for wi, (r, _, _) in zip(w, last)))
        want = (mt - b * mr, b) if b > 0 and mt - b * mr > 0 else None
        if want is not None:  # (else the prior's slope: a line with a negative intercept is not taken)
            assert small.line(load) == pytest.approx(want, rel=1e-9)
            checked += 1
    assert checked >= 2
    now[0] = 10
    assert cost.seen(3, 10) and cost.seen(48, 10) and not cost.seen(8, 100)  # 8 rows: none within a quarter
    now[0] = 20
    assert not cost.seen(3, 19) and cost.seen(3, 20)


def test_the_cost_lines_hold_the_steps_own_seconds():
    """Every forward the cost line is fitted to is timed from its own step's start: rows whose proposer gave no
    draft (their estimate drifts back to its prior in the same loop) leave the timing alone."""
    model = make_tiny(DIMS, False)
    batch = ContinuousBatch(model, max_rows=2, k=3, propose=lambda tokens, n: [] if len(tokens) % 2 else [1] * n)
    t0 = time.perf_counter()
    for p in ([1, 2, 3], [4, 5]):
        batch.add(p, GenerationConfig(max_new_tokens=12))
    while batch.running or batch.waiting:
        batch.step()
    took = time.perf_counter() - t0
    assert len(batch.cost.points) >= 6
    assert all(0 < t < took for _, t, _, _ in batch.cost.points)


def test_a_fused_drafters_batch_times_a_plain_step_at_its_load():
    """With a fused drafter, drafting is priced by its own line and staying plain by the plain line, which only
    plain steps time. Four rows whose drafts pay: while the plain line has timed no forward of about 4 rows in
    the last PROBE_STEPS steps, the step is plain (it times one); once it has, the step drafts; PROBE_STEPS
    steps later it probes again."""
    from midlayer.engine.batch import PROBE_STEPS

    class Fused:
        k, rows_per_column = 3, 0.5

    batch = ContinuousBatch(make_tiny(DIMS, False), fused=Fused(), k=1)
    batch.running = [BatchSequence(i, [1], 1, GenerationConfig(), 1, None, hits=9.0, tries=10.0) for i in range(4)]
    batch.fused_cost.add(8, 1.2)
    batch.fused_cost.add(16, 1.4)
    batch.cost.add(1, 1.0)  # timed at one row (a lighter load), long ago or not
    assert batch._pays([1] * 4) == 0  # a probe: nothing timed at 4 rows
    batch.cost.add(4, 1.1)
    assert batch._pays([1] * 4) == 1  # now 4 rows: 4 / 1.1 against 7.6 / 1.2
    batch.steps += PROBE_STEPS + 1
    batch.fused_cost.add(8, 1.2)
    assert batch._pays([1] * 4) == 0  # the plain line's 4-row forward is stale: probe again


@needs_kernels
@pytest.mark.parametrize("windowed", [False, True])
def test_seeded_sampling_rows_reproduce_a_single_request(windowed):
    model = _q4(**(WINDOWED if windowed else {}))
    prompts, _ = _workload(seed=3, n=6)
    cfgs = [GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=s) for s in range(6)]
    ref = [generate(model, [p], c)[0] for p, c in zip(prompts, cfgs)]
    greedy = GenerationConfig(max_new_tokens=12)
    # sampled rows next to greedy lookup rows: a sampled row never drafts, and draws once per token
    batch = ContinuousBatch(model, max_rows=4, propose=PromptLookupDrafter(V).chain, k=3)
    out, _ = _run(batch, prompts + prompts[:2], cfgs + [greedy, greedy], seed=1)
    assert out[:6] == ref
    assert out[6:] == [generate(model, [p], greedy)[0] for p in prompts[:2]]


@needs_kernels
def test_cancel_frees_the_row_and_the_others_go_on():
    model = _q4()
    prompts, _ = _workload(seed=5, n=4)
    cfg = GenerationConfig(max_new_tokens=20)
    ref = [generate(model, [p], cfg)[0] for p in prompts]
    batch = ContinuousBatch(model, max_rows=4)
    handles = [batch.add(p, cfg) for p in prompts]
    got = {h: [] for h in handles}
    for _ in range(3):
        for seq, tokens, _ in batch.step():
            got[seq.handle] += tokens
    row = next(s.row for s in batch.running if s.handle == handles[0])
    last = batch.running[-1].handle
    batch.cancel(handles[0])  # its row is freed: the last row moves into it
    assert len(batch.running) == 3 and (row == 3 or batch.running[row].handle == last)
    assert [s.row for s in batch.running] == [0, 1, 2]
    while len(batch):
        for seq, tokens, _ in batch.step():
            got[seq.handle] += tokens
    assert [got[h] for h in handles[1:]] == ref[1:]
    assert got[handles[0]] == ref[0][:len(got[handles[0]])]


@needs_kernels
@pytest.mark.parametrize("drafter", ["lookup", "eagle", "hidden-transfer"])
def test_the_context_bounds_every_row(drafter):
    """A prompt that fills the context: one new token (the last needs no slot), as `generate` gives; rows near
    the end draft only what fits (an EAGLE chain's and the pseudo rows' positions stay inside the RoPE tables,
    the pseudo rows' scratch slots past the context)."""
    from midlayer.speculative.eagle import EagleRows
    from midlayer.speculative.hidden_transfer import HiddenTransferRows

    model = _q4()
    full = [7] * DIMS["max_seq_len"]
    cfg = GenerationConfig(max_new_tokens=10)
    drafting = {"lookup": dict(propose=PromptLookupDrafter(V).chain),
                "eagle": dict(row_drafter=EagleRows(_eagle(model), 3)),
                "hidden-transfer": dict(fused=HiddenTransferRows(_transfer(model, [1, 2, 3])))}
    batch = ContinuousBatch(model, max_rows=3, k=4, **drafting[drafter])
    batch._pays = lambda lengths: max(lengths)  # draft as deep as the deepest row allows
    out, _ = _run(batch, [full, full[:90], full[:60]], [cfg] * 3, join_p=1.0)
    assert out == [generate(model, [p], cfg)[0] for p in (full, full[:90], full[:60])]
    assert len(out[0]) == 1 and len(out[1]) == 7 and len(out[2]) == 10


def test_keep_memory_moves_a_memory_over_the_oldest_one_but_never_over_the_donor():
    """`_keep_memory` with no free row left: the memory of the row a prompt is about to overwrite (row 0) replaces
    the oldest memory among the rows the join leaves alone (rows 1, 2: dict order, row 1 the oldest), unless that
    row is the joiner's donor (its K/V are read by this join): then the next oldest."""
    model = make_tiny(DIMS, False)
    for donor, target, kept in ((-1, 1, 2), (1, 2, 1)):
        batch = ContinuousBatch(model, max_rows=1, memory_rows=2)
        batch.memory = {1: ([1, 2, 3], 0), 2: ([4, 5, 6], 0), 0: ([7, 8, 9], 0)}
        batch._keep_memory(0, 1, donor)
        assert batch.memory == {kept: batch.memory[kept], target: ([7, 8, 9], 0)}
        assert batch.memory[kept][0] == ([1, 2, 3] if kept == 1 else [4, 5, 6])


def test_a_decode_forward_holds_at_most_max_step_rows_rows():
    """`max_step_rows` caps a decode forward: 2 rows drafting k = 4 tokens each would be 2 x (1 + 4) = 10 rows;
    under a cap of 4, each row drafts at most (4 - 2) // 2 = 1 token, so 2 x 2 rows. The tokens stay plain
    greedy decoding's."""
    model = make_tiny(DIMS, False)
    batch = ContinuousBatch(model, max_rows=2, max_step_rows=4, propose=lambda tokens, k: [tokens[-1]] * k, k=4)
    batch._pays = lambda lengths: max(lengths)  # draft as deep as each row allows
    rows, drafts = [], batch._drafts

    def spy():
        out = drafts()
        rows.append(len(out[0]) * (1 + max(map(len, out[0]))))  # the decode forward's n x M rows
        return out
    batch._drafts = spy
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]]
    cfg = GenerationConfig(max_new_tokens=8)
    out, _ = _run(batch, prompts, [cfg] * 2, join_p=1.0)
    assert out == [generate(model, [p], cfg)[0] for p in prompts]
    assert max(rows) == 4


def test_refusals():
    with pytest.raises(ValueError, match="sliding-window"):
        ContinuousBatch(make_tiny({**DIMS, "sliding_window": 8}, False))
    model = make_tiny(DIMS, False)
    with pytest.raises(ValueError, match="max_rows"):
        ContinuousBatch(model, max_rows=0)
    batch = ContinuousBatch(model)
    with pytest.raises(ValueError, match="empty"):
        batch.add([], GenerationConfig())
    with pytest.raises(ValueError, match="longer than the model's context"):
        batch.add([1] * 97, GenerationConfig())
    batch.cancel(12345)  # an unknown handle: nothing to do
    assert len(batch) == 0 and batch.step() == []


def test_kv_cache_rows_share_the_buffers():
    from midlayer.model.kv_cache import KVCache
    cache = KVCache(2, 4, 1, 8, 16)
    view = cache.rows(1, 3)
    view.k[:, 0].fill_(3.0)
    assert torch.all(cache.k[:, 1] == 3.0) and torch.all(cache.k[:, 0] == 0) and view.length == 0
    assert view.k_layers[1].is_contiguous()
    with pytest.raises(ValueError, match="outside"):
        cache.rows(3, 5)


def test_a_grown_cache_holds_what_it_held():
    """`KVCache.grown` (a batch's cache, EAGLE's batch rows, when they outgrow their slots): the same keys,
    values, key biases, positions and windows in more slots, the new ones empty; never fewer slots."""
    from midlayer.model.kv_cache import KVCache
    cache = KVCache(2, 3, 1, 4, 8, dtype=torch.float16)
    cache.window, cache.layer_windows = 5, [5, 0]
    g = torch.Generator().manual_seed(0)
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=g))
    cache.bias[:, :, :6] = 0.0
    cache.pos.copy_(torch.arange(8).expand(3, -1))
    big = cache.grown(20)
    assert big.max_len == 20 and big.k.dtype == torch.float16 and (big.window, big.layer_windows) == (5, [5, 0])
    assert torch.equal(big.k[..., :8, :], cache.k) and torch.equal(big.v[..., :8, :], cache.v)
    assert torch.equal(big.bias[..., :8], cache.bias) and torch.equal(big.pos[:, :8], cache.pos)
    assert bool((big.bias[..., 8:] == float("-inf")).all()) and not big.k[..., 8:, :].any()
    with pytest.raises(ValueError, match="fewer"):
        cache.grown(7)


@needs_kernels
def test_bench_decodes_steps_rows_run_every_batch_drafter_exactly():
    """`bench decode`'s "-steps" rows (a one-row continuous batch per prompt, `registry.batch_drafting`) for every
    kind of drafter -- prompt lookup, Medusa heads, EAGLE, hidden transfer, early exit, layer skip, skip gates:
    every output equals plain greedy decoding. A drafter of no kind the batch knows has no such row."""
    from midlayer.experiments.bench import _bench_prompt
    from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads
    from midlayer.speculative.registry import batch_drafting

    model = _q4()
    drafters = {"lookup": PromptLookupDrafter(V), "medusa": MedusaDrafter(model, MedusaHeads(model.cfg.dim, 3)),
                "eagle": _eagle(model), "ht": _transfer(model, [1, 2, 2]), **_self_drafters(model, True)}
    assert batch_drafting(object(), 1) is None
    stepwise = {f"{label}-steps": batch_drafting(d, 1, 0.5) for label, d in drafters.items()}
    methods = {label: (drafters[label.removesuffix("-steps")], 3) for label in stepwise}
    stepwise["none-steps"], methods["none-steps"] = {}, (None, 3)  # a batch that drafts nothing: plain decoding
    rows = {name: dict(time=0.0, tokens=0, forwards=0, equal=0, hits=[0] * 3, counts=[0] * 3, tree=None)
            for name in ["plain", *methods]}
    prompts, _ = _workload(seed=4, n=4)
    for ids in prompts:
        _bench_prompt(model, ids, rows, methods, {}, GenerationConfig(max_new_tokens=20, stop_tokens=(5,)), None,
                      None, 3, stepwise)
    assert all(rows[label]["equal"] == 4 and rows[label]["tokens"] == rows["plain"]["tokens"] for label in methods)
    # its tau is 1: the prompt's forward, which chose the first token, counts (it was left out: tau 1.09 at 12 tokens)
    assert rows["none-steps"]["forwards"] == rows["plain"]["forwards"] == rows["plain"]["tokens"]


def test_a_failed_prefill_leaves_its_sequences_cancellable_and_a_skip_rule_of_its_own_is_refused(monkeypatch):
    """A forward that fails while prompts join (out of memory, say) leaves them waiting, so the server can cancel
    them (cancel raised ValueError, which killed the server's engine thread: every later request hung); the batch
    then runs the next sequence as before. A gated model's batch skips (or computes) gated blocks for every row:
    a sequence asking for the other rule is refused (it was silently run with the batch's)."""
    model = _q4()
    batch = ContinuousBatch(model, max_rows=2)
    cfg = GenerationConfig(max_new_tokens=4)
    real, calls = ContinuousBatch._forward_one, []

    def flaky(self, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        return real(self, *a, **kw)

    monkeypatch.setattr(ContinuousBatch, "_forward_one", flaky)
    h = batch.add([1, 2, 3], cfg)
    with pytest.raises(RuntimeError, match="simulated"):
        batch.step()
    assert [s.handle for s in batch.waiting] == [h] and not batch.running
    batch.cancel(h)
    assert len(batch) == 0
    batch.add([4, 5, 6], cfg)
    out = []
    while len(batch):
        out += [t for _, toks, _ in batch.step() for t in toks]
    assert out == generate(model, [[4, 5, 6]], cfg)[0]
    gated = ContinuousBatch(_q4(True), max_rows=2)
    with pytest.raises(ValueError, match="skips gated blocks for every row; a sequence with skip=False"):
        gated.add([1, 2], GenerationConfig(max_new_tokens=2, skip=False))
    ContinuousBatch(model, max_rows=2).add([1, 2], GenerationConfig(max_new_tokens=2, skip=False))  # dense: no rule

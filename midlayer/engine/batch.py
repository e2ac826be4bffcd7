"""Continuous batching: sequences join a running batch between steps and leave it when they finish (issue 45).

A server's requests arrive at any time and end at any time. Decoding them one after another pays a whole
forward per token per request, while on a CPU a forward over 16 rows costs little more than over one (the
weights are read once per forward: docs/results/decode-cpu.md, the row-cost curves). `ContinuousBatch`
keeps every running sequence in one row of a shared KV cache and advances them all with one forward per step:

  * **Rows.** The cache has `max_rows` rows; the running sequences hold rows 0..n-1, so a step's forward runs
    over a prefix of the buffers (`KVCache.rows`, no copy). A sequence that ends frees its row: the last
    running sequence moves into it (the two rows swap), so the prefix stays dense and the freed row keeps the
    left sequence's K/V for a follow-up prompt. `memory_rows` more rows hold only such memories: a full batch,
    whose freed rows are taken at once, keeps the newest ones there.
  * **Slots.** Slot p of a row holds that sequence's token at position p: each row has its own length, and a
    step writes row i's token at slot L_i (`forward_cached(..., slots=)`); the cache's mask hides a row's slots
    past its own length (-inf key bias), so a short row never sees a long row's stale keys.
  * **Joining.** Joining prompts are prefilled into their rows, several in one forward, as a single request's
    is, and take part in the next step's forward.
  * **Prefix reuse.** A joining prompt that starts as a running row's tokens, or as what a free row still
    holds from a sequence that left (a follow-up chat turn), takes that prefix's K/V from there and prefills
    only the rest (`_prefix`; chat prompts share their template's system turn); prompts that arrive together
    with one start share one prefill of it (`_defer`). In q4 the reused K/V are the bits the prompt's own
    prefill would give.
  * **Speculation in the batch.** Every drafter drafts a chain per greedy row: `propose` (from tokens: prompt
    lookup), `row_drafter` (from the base's final residuals, fed those of every position a row commits: EAGLE,
    which keeps a draft KV cache row per batch row, or Medusa heads, which keep none; `RowDrafter`), `fused`
    (rows that ride the step's own forward from the middle of the network up: hidden transfer's pseudo rows,
    `FusedDrafter`) or `self_drafter` (partial forwards of the base's own blocks: early exit, layer skip, skip
    gates; `SelfDrafter`). Each greedy row feeds its pending token and its draft's tokens in the same forward
    (rows with shorter drafts are padded). A row keeps the longest prefix of its draft that matches its own
    greedy targets plus one bonus token; its rejected slots get key bias -inf.
  * **When a draft pays.** A drafted token earns a token only if it and every draft token before it are
    accepted, and every row of a step is padded to the deepest draft: depth D costs n (1 + D) rows. With the
    forward's time a line in its rows, t(R) = a + b R (`StepCost`, fitted to this batch's own recent forwards), the
    step takes the depth D that maximises expected tokens per second, each row's j-th draft token counting
    p^j, p the row's acceptance rate (a Beta estimate started from `accept_prior` on its prompt); a drafter's
    own forwards, or the rows it adds to the step's, are priced by lines of their own. One sequence drafts deep
    (a row costs a few percent of a step); a big batch drafts only where its rows have been right often. The
    rows of a forward are capped too (`max_step_rows`). A row that judges no draft token in a step forgets a
    little of its evidence (`forget`): its estimate drifts back to its prior, so a row whose drafts stopped
    paying tries again later -- an answer that turns to copying its prompt (a code edit) is noticed.

Exactness. In the q4 format every kernel gives a row the same bits whatever rows share its forward and
whatever masked keys lie beyond its own (kernels.py), so each sequence's greedy tokens equal single-request
plain decoding (`generate`) token for token, with or without drafts (tests/test_batch.py). In fp32 and bf16
PyTorch's matrix products pick their kernels by row count, so a batched row may differ in the last bits and,
at a near-tie, in a token. A sampled row (temperature > 0) draws from its own generator, seeded from its
`GenerationConfig`, one draw per token as `generate` does, so it reproduces a single request's sample too.

Windowed blocks beside global ones (Gemma 3). Each layer masks by its own window, and the windowed layers keep
what their window still sees, per row: 2 W - 1 columns (W - 1 kept keys beside a forward's W new tokens; a
prompt's longer rest is prefilled W tokens at a time in its own row first), plus the scratch columns. A row that
lacks room drops its passed keys (`KVCache.make_room_row`), so rows in one forward have offsets of their own; a
forward names its scratch slots, which the windowed layers hold past every row's real columns (kv_cache.py). A
row that dropped keys is a prefix donor only for a joiner whose first window it still holds. `bound_windows=False`
keeps every slot instead (the same tokens).

Scope: dense and gated models (real skipping per row), and windowed blocks mixed with global ones; a window on
every block (whose cache drops keys for all rows at once) and state-space mixers keep whole-cache state and are
refused by `unsupported`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

from .draft_vocab import to_token_ids
from .generate import GenerationConfig, forward_cached, JoinedRows, sample_next, token_logprobs, validate_prompts
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.model.transformer import Transformer
from midlayer.ops import kernels


def unsupported(model: Transformer) -> str | None:
    """Why `model` cannot be decoded in a continuous batch, or None when it can."""
    cfg = model.cfg
    if cfg.sliding_window and not cfg.mixed_windows:
        return "sliding-window attention evicts keys from the whole cache at once"
    if cfg.ssm_layers:
        return "state-space mixers keep one state per cache, not per row"
    return None


class RowDrafter(Protocol):
    """A drafter that reads the base's final residuals (its "states"). The batch hands it each row's states as
    the row commits them and moves its rows as it moves its own: a drafter may keep rows of its own (EAGLE's
    draft KV cache: speculative/eagle.py, `EagleRows`) or none (Medusa heads: speculative/medusa.py)."""

    keeps_rows: bool  # rows of its own, one per batch row, that must hold every position's entry (EAGLE)
    rows: int  # with keeps_rows: how many (at least the batch's cache rows: max_rows + memory_rows)

    def chains(self, rows: list[int], starts: list[int], hidden: list[torch.Tensor], tokens: list[list[int]],
               depth: int) -> list[list[int]]:
        """Chains of `depth` draft tokens, one per row. Row rows[i] has states up to position starts[i] - 1
        already; hidden[i] [m, d] holds the base's final residuals at positions starts[i].. starts[i] + m - 1
        (the last is the position before the row's pending token) and tokens[i] the m tokens after them (the
        last is the pending token)."""
        ...

    def move(self, src: int, dst: int, length: int) -> None:
        """Row src's first `length` positions are row dst's from now on (the batch moved a sequence)."""
        ...

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Rows a and b trade their first positions (length_a of row a's, length_b of row b's): a sequence left
        row a, the last row's sequence moves into it, and row b keeps the left one's entries for a later prompt."""
        ...


class FusedDrafter(Protocol):
    """A drafter whose rows ride the batch's own forward: hidden transfer's pseudo rows (arXiv 2404.12022 sec.
    3.4; speculative/hidden_transfer.py, `HiddenTransferRows`). A step's forward over M token columns per row
    carries M k joined rows per row from the middle of the network up; after verification, the k joined rows of
    each row's anchor column (its last accepted token) give its next chain of k tokens."""

    k: int  # tokens per chain
    rows_per_column: float  # a column's joined rows, in rows of a full forward (their blocks over all blocks)

    def joins(self, M: int) -> JoinedRows:
        """The rows that join the forward of M token columns per row (M k of them per row)."""
        ...

    def visible(self, off: int, M: int) -> torch.Tensor:
        """bool [M (1 + k), M (1 + k)]: which of the forward's own rows (M token columns, then the joined rows)
        each may see, for a row whose real columns are off..M-1 (the rest is padding)."""
        ...

    def chains(self, pseudo: torch.Tensor, columns: list[int]) -> list[list[int]]:
        """pseudo [n, M k, d]: the joined rows' final residuals; columns[b]: row b's anchor column. A chain per
        row."""
        ...


@dataclass
class DraftPass:
    """How a self-speculative drafter drafts one token per row with the base's own blocks (early exit, layer
    skip, skip gates): `model` (the base, or a gated twin sharing its blocks) runs blocks l < stop with run(l)
    True over the base's cache (`skip`: real skipping of closed gates), and logits(h) [n, V'] reads the
    residual leaving them (V': the draft vocabulary `vocab`, or all)."""

    model: Transformer
    run: Callable[[int], bool] | None
    stop: int
    skip: bool
    logits: Callable[[torch.Tensor], torch.Tensor]
    vocab: torch.Tensor | None = None


class SelfDrafter(Protocol):
    """A drafter that drafts with the base's own blocks, one token per partial forward (`DraftPass`)."""

    def draft_pass(self) -> DraftPass:
        ...


@dataclass
class BatchSequence:
    """One sequence of the batch: its tokens so far, where it lives, and how it decodes."""

    handle: int
    tokens: list[int]  # prompt + committed new tokens
    prompt_len: int
    cfg: GenerationConfig
    budget: int  # most new tokens: max_new_tokens, and no more than the context holds
    generator: torch.Generator | None
    row: int = -1  # -1: waiting to join
    length: int = 0  # cache slots held: tokens[:length] are in the cache; tokens[length] is pending
    done: bool = False
    forwards: int = 0  # batched decode forwards this sequence took part in (the prefill not counted)
    accept_hist: list[int] = field(default_factory=list)  # rounds that accepted a draft tokens, by a
    hits: float = 1.0  # accepted draft tokens + the prior's (Beta estimate of the acceptance rate, `_drafts`)
    tries: float = 2.0  # judged draft tokens (up to and including the first rejection) + the prior's
    prior: tuple[float, float] = (1.0, 2.0)  # (hits, tries) of the prior alone: what forgetting returns to
    fed: int = 0  # positions whose base states the row drafter holds (`row_drafter`)
    reused: int = 0  # prompt tokens whose K/V it took from another row instead of prefilling them (`_prefix`)
    chain: list[int] = field(default_factory=list)  # the fused drafter's next chain (`fused`), from the last step
    states: list[torch.Tensor] = field(default_factory=list)  # final residuals at positions fed..length-1, unfed
    logprobs: int | None = None  # None: no scores; else how many most likely alternatives to keep per token
    scores: list[tuple[float, dict[int, float]]] = field(default_factory=list)  # per new token (`token_logprobs`)

    @property
    def acceptance(self) -> float:
        return self.hits / self.tries

    @property
    def new(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def base_forwards(self) -> int:
        """The base's forwards that chose its new tokens: its decode steps, and the prompt's forward, which chose
        the first (counted as the decode loop counts the round that verifies the prompt's last token)."""
        return self.forwards + bool(self.new)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens a and b start with alike."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _prefill_groups(seqs: list[BatchSequence], waste: float = 1.25) -> list[list[BatchSequence]]:
    """Joining prompts in groups that share one prefill forward: longest first, a prompt joins the group while
    the group's padded rows (its longest prompt x its size) stay within `waste` x its real rows. (Thirteen chat
    prompts of 35-250 tokens padded to 250 cost 1.48 s in one forward; packed by length far less.)"""
    groups: list[list[BatchSequence]] = []
    for seq in sorted(seqs, key=lambda x: -x.prompt_len):
        g = groups[-1] if groups else None
        if g is not None and g[0].prompt_len * (len(g) + 1) <= waste * (sum(x.prompt_len for x in g) + seq.prompt_len):
            g.append(seq)
        else:
            groups.append([seq])
    return groups


PROBE_STEPS = 128  # a fused drafter's batch times a plain step at its load at least this often (`_pays`)
LOAD_WEIGHT = 4.0  # a timed forward weighs this many times less per doubling between its load and the priced one


class StepCost:
    """A decode forward's seconds as a line in its rows, t(R) = a + b R, fitted by weighted least squares to the
    last `window` forwards of this batch, each weighed by how close the load it ran at (its sequences) is to the
    load being priced: `LOAD_WEIGHT` times less per doubling apart. A forward's cost is not one line over all
    row counts (flat while reading the weights dominates, steeper once the rows' arithmetic does), and an
    unweighted fit over an hour of light load priced a busy minute's drafts by the light load's slope (docs/
    results/serve-cpu.md, 38th session); at a steady load every forward weighs the same. Until two row counts
    have been seen, the slope is `prior_slope` of the mean time (a 4-row q4 forward costs ~1.3x a one-row one:
    docs/results/decode-cpu.md). `clock` (the batch's decode steps) dates the forwards for `seen`."""

    def __init__(self, prior_slope: float = 0.08, window: int = 256, clock: Callable[[], int] | None = None) -> None:
        self.prior_slope = prior_slope
        self.clock = clock
        self.points: deque[tuple[int, float, int, int]] = deque(maxlen=window)  # (rows, seconds, load, tick)
        # per load, the sums of the window's points (count, R, t, R^2, R t): a fit costs a few operations per load,
        # not per point (it runs every decode step, where a one-row step takes ~3 ms)
        self._sums: dict[int, list[float]] = {}
        self._evicted = 0

    def _tally(self, rows: int, seconds: float, load: int, sign: float) -> None:
        s = self._sums.setdefault(load, [0.0] * 5)
        for i, x in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            s[i] += sign * x

    def add(self, rows: int, seconds: float, load: int = 1) -> None:
        if len(self.points) == self.points.maxlen:
            self._tally(*self.points[0][:3], -1.0)
            self._evicted += 1
        self.points.append((rows, seconds, load, self.clock() if self.clock is not None else 0))
        if self._evicted >= (self.points.maxlen or 1):  # now and then, the sums afresh (no drift from -/+)
            self._sums, self._evicted = {}, 0
            for r, t, n, _ in self.points:
                self._tally(r, t, n, 1.0)
        else:
            self._tally(rows, seconds, load, 1.0)

    def clear(self) -> None:
        self.points.clear()
        self._sums, self._evicted = {}, 0

    def line(self, load: int | None = None) -> tuple[float, float] | None:
        """(a, b) at `load` sequences (None: every forward weighs the same), or None before any forward was timed."""
        if not self.points:
            return None
        tot = [0.0] * 5
        for n, s in self._sums.items():
            w = 1.0 if load is None else LOAD_WEIGHT ** -abs(math.log2(max(n, 1) / max(load, 1)))
            for i in range(5):
                tot[i] += w * s[i]
        W, SR, ST, SRR, SRT = tot
        mr, mt = SR / W, ST / W
        var, cov = SRR - W * mr * mr, SRT - W * mr * mt  # sum w (R - mr)^2, sum w (R - mr)(t - mt)
        if var > 1e-9 * W * max(1.0, mr * mr):
            b = cov / var
            if b > 0 and mt - b * mr > 0:
                return mt - b * mr, b
        b = self.prior_slope * mt / (1 + self.prior_slope * mr)  # the prior: b = prior_slope * a
        return mt - b * mr, b

    def seen(self, rows: int, within: int) -> bool:
        """Whether a forward of about `rows` rows (within a quarter) was timed in the last `within` clock ticks."""
        now, tol = self.clock() if self.clock is not None else 0, max(1.0, 0.25 * rows)
        for r, _, _, tick in reversed(self.points):  # newest first
            if now - tick > within:
                return False
            if abs(r - rows) <= tol:
                return True
        return False


class ContinuousBatch:
    """Sequences decoded together, one forward per step (module docstring)."""

    def __init__(self, model: Transformer, max_rows: int = 16, *, skip: bool = True,
                 propose: Callable[[Sequence[int], int], list[int]] | None = None, k: int = 4,
                 accept_prior: Callable[[Sequence[int]], float | None] | None = None,
                 row_drafter: RowDrafter | None = None, fused: FusedDrafter | None = None,
                 self_drafter: SelfDrafter | None = None, max_step_rows: int = 64, max_prefill_rows: int = 1024,
                 initial_len: int = 256, prefix_reuse: int = 16, forget: float = 0.995,
                 bound_windows: bool = True, memory_rows: int = 0) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"continuous batching does not support this model: {why}")
        if max_rows < 1 or k < 0 or max_step_rows < max_rows or memory_rows < 0:
            raise ValueError(f"need max_rows >= 1, k >= 0, max_step_rows >= max_rows and memory_rows >= 0; got "
                             f"{max_rows}, {k}, {max_step_rows}, {memory_rows}")
        # cache rows past max_rows: free rows that only remember left sequences, so a full batch keeps them too
        self.cache_rows = max_rows + memory_rows
        if row_drafter is not None and row_drafter.keeps_rows and row_drafter.rows < self.cache_rows:
            raise ValueError(f"the row drafter keeps {row_drafter.rows} rows, the batch's cache {self.cache_rows} "
                             "(max_rows + memory_rows): give it as many")
        if sum(x is not None for x in (propose, row_drafter, fused, self_drafter)) > 1:
            raise ValueError("one drafter per batch: propose (from tokens), row_drafter (from the base's states), "
                             "fused (rows that ride the base's forward) or self_drafter (the base's own blocks)")
        self.model, self.max_rows, self.skip = model.eval(), max_rows, skip
        self.propose, self.k, self.max_step_rows = propose, k, max_step_rows
        self.row_drafter = row_drafter  # fed every committed position's state (EAGLE, Medusa heads)
        self.fused = fused  # rows in the base's forward (hidden transfer)
        self.self_drafter = self_drafter  # partial forwards of the base's own blocks (early exit, layer skip)
        self.steps = 0  # decode steps taken: the cost lines' clock (`StepCost`)
        self.draft_cost = StepCost(clock=self._clock)  # a self drafter's forwards, by rows (`_pays`)
        if fused is not None:
            self.k = min(k, fused.k)
        # slots past the context for a step's scratch slot and the fused drafter's rows
        self.scratch = 1 + (0 if fused is None else (1 + self.k) * fused.k)
        self.accept_prior = accept_prior  # a prompt -> the drafter's expected acceptance rate on it (or None)
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1] (1: never forget), got {forget}")
        # per step without a judged draft token, a row keeps this share of its evidence beyond its prior
        self.forget = forget
        self.cost = StepCost(clock=self._clock)
        self.fused_cost = StepCost(clock=self._clock)  # the forwards that carried a fused drafter's rows (`_pays`)
        self.max_prefill_rows = max_prefill_rows  # prompt tokens prefilled in one step (at least one prompt)
        self.ctx = model.cfg.max_seq_len
        self.device = model.tok_embeddings.weight.device
        self.dtype = kv_dtype(model)  # the KV cache's
        # Windowed blocks beside global ones (Gemma 3), `bound_windows`: each row's windowed layers keep the W - 1
        # keys its next query still sees plus room for one forward's new tokens (a prompt chunk of `chunk`, a
        # verified draft), not every slot; each row drops its passed keys when it needs room (`_room`).
        cfg = model.cfg
        windows = [cfg.window_of(layer) for layer in range(cfg.n_layers)] if cfg.mixed_windows else []
        self.window = max(windows, default=0) if bound_windows else 0
        self.chunk = max(self.window, self.k + 1)  # (a prompt's tokens per forward, when windows are bounded)
        local_len = self.window - 1 + self.chunk if self.window else None
        self.cache = KVCache.for_model(cfg, self.cache_rows, max_len=min(initial_len, self.ctx), device=self.device,
                                       dtype=self.dtype, local_len=local_len, spare=self.scratch, row_offsets=True)
        self.running: list[BatchSequence] = []  # running[i] holds row i
        self.waiting: list[BatchSequence] = []
        self.by_handle: dict[int, BatchSequence] = {}
        self._next = 0
        if prefix_reuse < 0:
            raise ValueError(f"prefix_reuse must be >= 0 (0: off), got {prefix_reuse}")
        self.prefix_reuse = prefix_reuse  # the shortest shared prompt prefix whose K/V a joining row reuses
        # free rows whose slots still hold a left sequence's K/V: row -> (its tokens there, its row drafter's fed)
        self.memory: dict[int, tuple[list[int], int]] = {}

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    # ------------------------------------------------------------------------------------ membership
    def add(self, prompt: Sequence[int], cfg: GenerationConfig, *, logprobs: int | None = None) -> int:
        """Queue a sequence; it joins at the next `step` with a free row. Returns its handle. `logprobs`: keep, per
        new token, its log-probability and that many most likely alternatives (`seq.scores`), from the logits
        of the forward that chose it: in q4 the numbers one forward over prompt and answer gives."""
        ids = validate_prompts(self.model, [prompt])[0]
        if cfg.skip != self.skip and self.model.routers is not None:  # (one forward runs every row: one rule)
            raise ValueError(f"this batch {'skips' if self.skip else 'computes'} gated blocks for every row; a "
                             f"sequence with skip={cfg.skip} needs a batch made with skip={cfg.skip}")
        budget = min(cfg.max_new_tokens, self.ctx - len(ids) + 1)  # the last new token needs no slot
        gen = cfg.generator(self.device)  # seeded as generate_stream seeds it: the same draws as a single request
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
        seq = BatchSequence(self._next, ids, len(ids), cfg, budget, gen, accept_hist=[0] * (self.k + 1),
                            logprobs=logprobs)
        drafting = any(x is not None for x in (self.propose, self.row_drafter, self.fused, self.self_drafter))
        q = self.accept_prior(ids) if self.accept_prior is not None and drafting else None
        if q is not None:  # Beta(1 + 2q, 1 + 2(1 - q)): the prior's mean, worth two judged tokens, over a uniform
            seq.hits, seq.tries = 1.0 + 2.0 * q, 4.0  # one (so a row whose prompt repeats nothing still tries)
        seq.prior = (seq.hits, seq.tries)
        self._next += 1
        self.by_handle[seq.handle] = seq
        if budget <= 0:
            seq.done = True
        self.waiting.append(seq)
        return seq.handle

    def alone(self, prompt: Sequence[int], cfg: GenerationConfig) -> tuple[BatchSequence, Iterator[list[int]]]:
        """One sequence decoded by itself in this (empty) batch: the sequence (its statistics fill in as it goes)
        and an iterator over its new tokens, step by step; closing the iterator early cancels the sequence. The
        API's prompt lookup with tree auto and bench decode's lookup "-steps" row decode through this."""
        if len(self):
            raise ValueError(f"alone: the batch already holds {len(self)} sequences")
        handle = self.add(prompt, cfg)

        def steps() -> Iterator[list[int]]:
            try:
                while len(self):
                    for _, tokens, _ in self.step():
                        if tokens:
                            yield tokens
            finally:
                self.cancel(handle)  # (nothing to do once it finished)
        return self.by_handle[handle], steps()

    def cancel(self, handle: int) -> None:
        """Drop a sequence (a client gone, a stop string found): its row is free at once."""
        seq = self.by_handle.pop(handle, None)
        if seq is None:
            return
        if seq.row >= 0:
            self._leave(seq)
        else:  # (by identity: a dataclass's == compares every field)
            self.waiting[:] = [w for w in self.waiting if w is not seq]

    def _leave(self, seq: BatchSequence) -> None:
        """Free seq's row: the last running sequence moves into it (K/V, key biases, positions) and seq's K/V go to
        the freed last row, a swap. That row remembers them (`memory`) for a prompt that starts as seq's tokens: a
        follow-up chat turn prefills only its new part (`_prefix`)."""
        r, last = seq.row, len(self.running) - 1
        if r != last:
            mover = self.running[last]
            self.cache.swap_rows(r, last, seq.length, mover.length)
            self.cache.truncate_row(r, mover.length)  # a row's slots past its length are hidden
            if self.row_drafter is not None:
                self.row_drafter.swap(r, last, seq.fed, mover.fed)
            mover.row = r
            self.running[r] = mover
        self.memory.pop(last, None)  # (re-inserted: the newest memory comes last, `_keep_memory`)
        self.memory[last] = (seq.tokens[:seq.length], seq.fed)
        self.running.pop()
        seq.row = -1
        self.by_handle.pop(seq.handle, None)

    def _room(self, first: int, starts: list[int], counts: list[int]) -> int:
        """Before a forward writes counts[i] tokens at slots starts[i].. of row first + i: with bounded windowed
        layers, a row that lacks the room drops the keys its queries have passed (`KVCache.make_room_row`).
        Returns the column past every row's new tokens in those layers (a forward's scratch slots sit from there:
        `KVCache.scratch`); without bounded layers, past every slot."""
        c = self.cache
        if not self.window:
            return max(s + n for s, n in zip(starts, counts))
        for i, (s, n) in enumerate(zip(starts, counts)):
            c.make_room_row(first + i, s, n)
        return max(s + n - c.row_offs[first + i] for i, (s, n) in enumerate(zip(starts, counts)))

    def _reserve(self, need: int) -> None:
        """Grow the cache's slots to at least `need` (doubling, at most the context), keeping what it holds."""
        old = self.cache
        if need <= old.max_len:
            return
        self.cache = old.grown(min(max(need, 2 * old.max_len), self.ctx + self.scratch))

    # ------------------------------------------------------------------------------------ stepping
    def step(self) -> list[tuple[BatchSequence, list[int], bool]]:
        """Admit waiting sequences into free rows (their prompts prefilled together in one forward: each row's
        first token), then advance every running sequence by one batched forward. Returns (sequence, new tokens,
        finished) per sequence that moved; a finished sequence has left the batch."""
        events: dict[int, tuple[BatchSequence, list[int]]] = {}
        joining: list[BatchSequence] = []
        i = 0  # waiting[:i]: deferred to the next step (they share a start with a sequence joining now)
        while i < len(self.waiting) and len(self.running) + len(joining) < self.max_rows:
            seq = self.waiting[i]
            if seq.done:  # nothing fits in the context after this prompt
                self.waiting.pop(i)
                self.by_handle.pop(seq.handle, None)
                events[seq.handle] = (seq, [])
                continue
            if joining and sum(x.prompt_len for x in joining) + seq.prompt_len > self.max_prefill_rows:
                break  # the rest join at a later step: a step's prefill stays bounded, decoding goes on
            if self._defer(seq, joining):
                i += 1
                continue
            joining.append(self.waiting.pop(i))
        try:
            for group in _prefill_groups(joining):
                self._join(group, events)
        except BaseException:  # (a forward failed, e.g. out of memory): the ones without a row wait again, so
            self.waiting[:0] = [x for x in joining if x.row < 0]  # the caller can cancel them (it could not)
            raise
        if self.running:
            self.steps += 1
            self._decode(events)
        return [(seq, toks, seq.done) for seq, toks in events.values()]

    def _clock(self) -> int:
        return self.steps

    def _forward(self, first: int, fed: list[list[int]], starts: list[int], last_only: bool, carry: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE forward over rows first.. of the cache: row i's tokens fed[i] at slots (= positions) starts[i],
        starts[i] + 1, ... Rows are right-aligned in the forward (the last column holds every row's last token);
        a shorter row is padded in front. A padding row is computed like the others -- so the forward stays one
        dense stretch for the fused kernels -- at the scratch slot `end`, past every row's real slots: free in
        every row, after every real query (causality hides it from them), at position 0; its key bias is reset
        afterwards. With `carry`, the fused drafter's M k rows per row join too (`_fused_rows`). Returns logits
        [n, V] of each row's last token (`last_only`), else [n, M, V]; and, for a `row_drafter` or with `carry`,
        the final residual at every row ([n, M (+ M k), d]), else None."""
        n, M = len(fed), max(len(f) for f in fed)
        if n == 1 and not carry and self.model.routers is None:
            return self._forward_one(first, fed[0], starts[0], last_only)
        counts = [len(f) for f in fed]
        end = max(s + c for s, c in zip(starts, counts))
        J = self.fused.k * M if carry else 0
        self._reserve(end + 1 + J)
        E = self._room(first, starts, counts)
        tokens = torch.zeros(n, M, dtype=torch.long)
        positions = torch.zeros(n, M + J, dtype=torch.long)
        slots = torch.full((n, M + J), end, dtype=torch.long)
        for i, (f, s, c) in enumerate(zip(fed, starts, counts)):
            tokens[i, M - c:] = torch.tensor(f)
            positions[i, M - c:M] = slots[i, M - c:M] = torch.arange(s, s + c)
        joins = extra = None
        if carry:
            joins, extra = self._fused_rows(M, counts, starts, positions, slots, end)
        tokens, positions, slots = (x.to(self.device) for x in (tokens, positions, slots))
        view = self.cache.rows(first, first + n)
        view.length, view.scratch = end + 1 + J, (end, E)
        out = forward_cached(self.model, tokens, view, positions, skip=self.skip, slots=slots,
                             last_only=last_only and not carry, return_hidden=self.row_drafter is not None or carry,
                             all_hidden=True, joins=joins, extra_mask=extra, head_rows=M if carry else None)
        self.cache.bias[:, first:first + n, end:end + 1 + J] = float("-inf")  # the scratch slots: never held
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        return (logits[:, -1] if last_only and carry else logits), hidden

    def _forward_one(self, row: int, fed: list[int], start: int, last_only: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward` of one row (one sequence running, or one prompt joining): `generate`'s own contiguous step
        at the next slots, with no per-row slots and, for one token, no mask at all (every slot before the row's
        length holds a committed key with bias 0 at every layer: a dense model, whose rejected drafts always lie
        past that length). In q4 the same bits as the per-row path (the kernels depend only on the keys seen);
        less Python per step. Gated models keep the per-row path: a skipped key's bias is -inf at its layer."""
        self._reserve(start + len(fed))
        self._room(row, [start], [len(fed)])
        view = self.cache.rows(row, row + 1)
        view.length = start  # (a fresh view: dense, as the row's committed slots are)
        tokens = torch.tensor([fed], device=self.device)
        positions = torch.arange(start, start + len(fed), device=self.device)[None]
        out = forward_cached(self.model, tokens, view, positions, skip=self.skip, last_only=last_only,
                             return_hidden=self.row_drafter is not None, all_hidden=True)
        return out if isinstance(out, tuple) else (out, None)

    def _fused_rows(self, M: int, counts: list[int], starts: list[int], positions: torch.Tensor, slots: torch.Tensor,
                    end: int) -> tuple[JoinedRows, torch.Tensor]:
        """The fused drafter's rows of a forward over M token columns per row: step s of column c (joined row
        (s - 1) M + c) at scratch slot end + 1 + (s - 1) M + c, past every real and padding slot, at the
        column's position + s (kept inside the RoPE tables: such tokens lie past the context and are never
        drafted). Fills their positions and slots; returns the JoinedRows and the extra mask [n, 1, M + J, S]:
        0 for the token columns (causality by slot already hides every joined row from them); a joined row sees
        the row's committed slots (the cache's own rule) and, of this forward's rows, those `visible` allows."""
        f, n = self.fused, len(counts)
        J = f.k * M
        col = positions[:, :M]
        step = torch.arange(1, f.k + 1).repeat_interleave(M)
        positions[:, M:] = (col.repeat(1, f.k) + step).clamp(max=self.ctx - 1)
        slots[:, M:] = end + 1 + torch.arange(J)
        S = end + 1 + J
        extra = torch.zeros(n, 1, M + J, S)
        for i, (s, c) in enumerate(zip(starts, counts)):
            rows = torch.full((J, S), float("-inf"))
            rows[:, :s] = 0.0
            seen = torch.zeros(J, M + J).masked_fill(~f.visible(M - c, M)[M:], float("-inf"))
            # padding columns share one slot: a key counts as seen if any row at its slot is (amax)
            extra[i, 0, M:] = rows.scatter_reduce(1, slots[i].expand(J, M + J), seen, "amax")
        return f.joins(M), extra.to(self.device)

    def _defer(self, seq: BatchSequence, joining: list[BatchSequence]) -> bool:
        """Whether `seq` waits a step: no running row shares `prefix_reuse` tokens with its prompt, but a sequence
        joining this step does. Prefilled beside it, it would compute that start again; a step later it reuses it
        from that row (`_prefix`). (Sixteen chat prompts arriving at once share SmolLM2's 24-token system turn.)
        With bounded windowed layers only a joiner whose row drops no key before then counts (its prompt and next
        step fit its columns): one that does would lend `_prefix` nothing, and the wait would be for nothing."""
        if not self.prefix_reuse or not joining:
            return False
        ids = seq.tokens[:seq.prompt_len - 1]
        if any(shared_prefix(ids, x.tokens[:x.length]) >= self.prefix_reuse for x in self.running):
            return False
        room = self.cache.local_len - 1 - self.k if self.window else self.ctx
        return any(shared_prefix(ids, x.tokens) >= self.prefix_reuse and x.prompt_len <= room for x in joining)

    def _prefix(self, seq: BatchSequence, row: int) -> tuple[int, int]:
        """(s, donor): the joining `seq` (into `row`) takes slots 0..s-1 from row `donor` -- a running row, or a
        free row (`row` itself or a later one) that remembers a left sequence's K/V (`memory`) -- whose tokens
        start as its prompt does, the longest such prefix; (0, -1) if none reaches `prefix_reuse` tokens. The
        prompt's last token is always run (its logits choose the first new token). With a row drafter that keeps
        rows, s also stops where the donor's draft entries do and one before the shared tokens end (EAGLE's entry
        at position t reads token t + 1). With bounded windowed layers, a donor that has dropped keys (offset o > 0)
        gives only a prefix whose first query's window it still holds: s - (W - 1) >= o. In q4 the reused K/V are
        the bits the joiner's own prefill gives (row-invariant kernels), so its tokens stay those of a single
        request (tests/test_batch.py)."""
        if not self.prefix_reuse:
            return 0, -1
        ids = seq.tokens[:seq.prompt_len - 1]
        held = [(x.row, x.tokens[:x.length], x.fed) for x in self.running]
        # free rows: `row` and those after it, which this join has not written yet (joiners take rows in order)
        held += [(m, *self.memory[m]) for m in sorted(self.memory) if m >= row]
        best, donor = 0, -1
        for r, toks, fed in held:
            n = shared_prefix(ids, toks)
            if self.row_drafter is not None and self.row_drafter.keeps_rows:
                n = min(n - 1, fed)
            off = self.cache.row_offset(r)
            if off and n - (self.window - 1) < off:  # keys the joiner's first query sees are gone
                n = 0
            if n > best:
                best, donor = n, r
        return (best, donor) if best >= self.prefix_reuse else (0, -1)

    def _join(self, seqs: list[BatchSequence], events: dict[int, tuple[BatchSequence, list[int]]]) -> None:
        """Prefill the joining sequences' prompts into the next free rows, together; sample each first token. A
        prompt that starts as a running row's tokens (or those a free row remembers) takes that prefix's K/V
        from it and prefills only the rest (`_prefix`): chat prompts share their template's system turn."""
        r = len(self.running)
        c = self.cache
        starts = []
        for i, seq in enumerate(seqs):
            row = r + i
            s, donor = self._prefix(seq, row)
            if donor != row and row in self.memory:
                self._keep_memory(row, r + len(seqs), donor)
            if donor not in (-1, row):  # (running rows are never joining rows: no copy reads a row written here)
                c.copy_row(donor, row, s)
                if self.row_drafter is not None:
                    self.row_drafter.move(donor, row, s)
            c.truncate_row(row, s)  # whatever earlier sequences left past the prefix is gone
            self.memory.pop(row, None)
            seq.reused = s
            starts.append(s)
        # bounded windowed layers: a rest that does not fit beside what the row holds goes first through forwards
        # of its own row, `chunk` tokens each, until it does (the same bits in q4: the kernels see the same keys)
        early: list[list[torch.Tensor]] = [[] for _ in seqs]  # their final residuals, for a row drafter
        for i, seq in enumerate(seqs):
            while (self.window and seq.prompt_len - starts[i] > self.chunk  # (self.cache: a forward may grow it)
                   and seq.prompt_len - self.cache.row_offs[r + i] > self.cache.local_len):
                a = starts[i]
                _, h = self._forward(r + i, [seq.tokens[a:a + self.chunk]], [a], last_only=True)
                if h is not None:
                    early[i].append(h[0])
                starts[i] = a + self.chunk
        logits, hidden = self._forward(r, [s.tokens[st:] for s, st in zip(seqs, starts)], starts, last_only=True)
        for i, seq in enumerate(seqs):
            seq.row, seq.length = r + i, seq.prompt_len
            if self.row_drafter is not None and seq.cfg.temperature == 0:  # (sampled rows never draft)
                m = seq.prompt_len - starts[i]
                seq.fed, seq.states = seq.reused, early[i] + [hidden[i, hidden.shape[1] - m:].clone()]
            self.running.append(seq)
            self._commit(seq, [int(self._sample(seq, logits[i:i + 1])[0])], events, logits[i:i + 1])
        self._leave_finished(seqs)

    def _keep_memory(self, row: int, free: int, donor: int) -> None:
        """A joining prompt is about to overwrite free `row`, whose remembered K/V it does not start with: copy them
        to a free row that this join leaves alone (`free`.. `cache_rows` - 1) and that is not the joiner's `donor`,
        one that remembers nothing if there is one, else the one whose memory is oldest. So a follow-up turn still
        finds its previous turn when other requests joined in between."""
        spare = [t for t in range(free, self.cache_rows) if t not in self.memory]
        older = [t for t in self.memory if t >= free and t != donor]  # (dict order: oldest first)
        target = spare[0] if spare else older[0] if older else -1
        if target < 0:
            return
        tokens, fed = self.memory.pop(row)
        self.memory.pop(target, None)
        self.cache.copy_row(row, target, len(tokens))  # (past them the row is hidden when a prompt joins it)
        if self.row_drafter is not None:
            self.row_drafter.move(row, target, fed)
        self.memory[target] = (tokens, fed)

    def _sample(self, seq: BatchSequence, logits: torch.Tensor) -> torch.Tensor:
        cfg = seq.cfg
        return sample_next(logits, cfg.temperature, cfg.top_k, cfg.top_p, seq.generator)

    def _commit(self, seq: BatchSequence, tokens: list[int], events: dict[int, tuple[BatchSequence, list[int]]],
                logits: torch.Tensor) -> None:
        """Append tokens (accepted drafts + the new pending token) up to a stop token or the budget; logits
        [len(tokens), V]: the rows that chose them (scored when the sequence asked for logprobs)."""
        got = events.setdefault(seq.handle, (seq, []))[1]
        n = 0
        for tok in tokens:
            seq.tokens.append(tok)
            got.append(tok)
            n += 1
            if tok in seq.cfg.stop_tokens or len(seq.new) >= seq.budget:
                seq.done = True
                break
        if seq.logprobs is not None:
            seq.scores += token_logprobs(logits[:n], torch.tensor(tokens[:n]), seq.logprobs)

    def _leave_finished(self, seqs: list[BatchSequence]) -> None:
        """Finished sequences leave, highest row first: the row that moves into a freed one is never finished."""
        for seq in sorted((s for s in seqs if s.done), key=lambda s: -s.row):
            self._leave(seq)

    def _drafts(self) -> tuple[list[list[int]], bool]:
        """Each running row's chain draft (greedy rows with a proposer only), all cut to one depth D, the one
        that pays best (module docstring, "When a draft pays"); each also capped by the context, the row's
        remaining budget and the forward's row cap. And whether this step's forward carries a fused drafter's
        rows (it does whenever the step drafts: they make the next step's chains)."""
        n = len(self.running)
        drafts: list[list[int]] = [[] for _ in range(n)]
        if all(x is None for x in (self.propose, self.row_drafter, self.fused, self.self_drafter)) or self.k == 0:
            return drafts, False
        spare = self.max_step_rows - n  # rows a forward may spend on drafts
        rooms = [min(self.k, self.ctx - 1 - seq.length, seq.budget - len(seq.new) - 1, spare // n)
                 if seq.cfg.temperature == 0 else 0 for seq in self.running]
        # priced as if every draft were as long as its row allows: no lookup at all when even that does not pay
        # (proposing is Python work per row, a sizeable part of a big batch's step)
        depth = self._pays([max(r, 0) for r in rooms])
        if depth == 0:
            return drafts, False
        cut = [min(r, depth) for r in rooms]
        rows = [i for i in range(n) if cut[i] > 0]
        if self.fused is not None:  # the chains the last step's forward drafted; this one drafts the next ones
            chains = [self.running[i].chain for i in rows]
        elif self.self_drafter is not None:
            chains = self._self_chains(cut, rows)
        elif self.row_drafter is not None:  # one call for every drafting row, with every state committed since its
            # last call; each chain then cut to its row's room
            seqs = [self.running[i] for i in rows]
            chains = self.row_drafter.chains([x.row for x in seqs], [x.fed for x in seqs],
                                             [torch.cat(x.states) for x in seqs],
                                             [x.tokens[x.fed + 1:x.length + 1] for x in seqs], depth) if rows else []
            for x in seqs:
                x.fed, x.states = x.length, []
        else:
            chains = [self.propose(self.running[i].tokens, cut[i]) for i in rows]
        for i, chain in zip(rows, chains):
            drafts[i] = [int(t) for t in chain[:cut[i]]]
        return drafts, self.fused is not None

    @torch.no_grad()
    def _self_chains(self, cut: list[int], rows: list[int]) -> list[list[int]]:
        """A self drafter's chains (`DraftPass`): forward j runs every row's j-th chain token (the pending token
        first) through the drafter's blocks at its own slot L_i + j, as the one-sequence drafter runs one level
        of a chain at the next slot; rows whose chain is done sit at a scratch slot past every row's chain. The
        draft K/V is then dropped at every layer (key bias -inf): the verification forward writes those slots
        anew, at every block the base runs (the drafter ran only some). Returns the chains of `rows`; their
        forwards' seconds fit `draft_cost`."""
        p, seqs = self.self_drafter.draft_pass(), self.running
        n, steps = len(seqs), max(cut)
        chains: list[list[int]] = [[] for _ in range(n)]
        last = [seq.tokens[seq.length] for seq in seqs]
        end = max(seq.length + c for seq, c in zip(seqs, cut))
        self._reserve(end + 1)
        E = self._room(0, [seq.length for seq in seqs], [1 + c for c in cut])  # (and the verification's rows)
        t0 = time.perf_counter()
        for j in range(steps):
            live = [c > j for c in cut]
            tokens = torch.tensor([[last[i] if live[i] else 0] for i in range(n)], device=self.device)
            positions = torch.tensor([[seqs[i].length + j if live[i] else 0] for i in range(n)], device=self.device)
            slots = torch.tensor([[seqs[i].length + j if live[i] else end] for i in range(n)], device=self.device)
            view = self.cache.rows(0, n)
            view.length, view.scratch = end + 1, (end, E)
            h = forward_cached(p.model, tokens, view, positions, skip=p.skip, slots=slots, run=p.run, stop=p.stop)
            self.cache.bias[:, :n, end] = float("-inf")
            logits = p.logits(h[:, -1])
            fast = kernels.topk(logits, 1)  # top-1 as the one-sequence drafter takes it (draft_tree_autoregressive)
            top = to_token_ids(fast[1] if fast is not None else logits.topk(1, -1).indices, p.vocab)[:, 0].tolist()
            for i in range(n):
                if live[i]:
                    chains[i].append(top[i])
                    last[i] = top[i]
        self.draft_cost.add(n, (time.perf_counter() - t0) / steps, n)
        for i, seq in enumerate(seqs):
            self.cache.bias[:, i, seq.length:seq.length + cut[i]] = float("-inf")
        return [chains[i] for i in rows]

    def _pays(self, lengths: list[int]) -> int:
        """The draft depth D for this step, for drafts of at most `lengths` tokens per row. Every row is padded to
        the deepest draft, so depth D costs n (1 + D) rows: t(D) = a + b n (1 + D) by the fitted line (`StepCost`).
        A fused drafter's steps carry its rows too, priced in steady state (each step carries the rows of the next
        step's chains) by a line of their own, fitted to the forwards that carried them (`fused_cost`); until it
        has one, the plain line with w = `rows_per_column` more rows per column, t(D) = a + b n (1 + D)(1 + w),
        and the other way round. A chain's j-th token is accepted with probability p^j (p the row's acceptance
        estimate), so the step yields n + sum_i sum_{j <= min(D, k_i)} p_i^j tokens. A self drafter's D forwards
        of n rows add D d(n), d its own fitted line (`draft_cost`; until timed, the plain line: as dear as a full
        forward). D maximises tokens per second; before any forward is timed, the deepest draft. With a fused
        drafter the two sides are priced by two lines, and the plain one is timed only by plain steps: where it
        has timed none at about n rows in the last `PROBE_STEPS` steps though drafting wins, this step is plain
        (a probe), so that a line fitted at another load cannot keep the batch drafting at a loss."""
        deepest, n = max(lengths), len(lengths)
        line = drafting = self.cost.line(n)
        if self.fused is not None:
            w = 1.0 + self.fused.rows_per_column
            drafting = self.fused_cost.line(n)
            if drafting is None and line is not None:
                drafting = (line[0], line[1] * w)
            elif line is None and drafting is not None:
                line = (drafting[0], drafting[1] / w)
        if line is None or drafting is None or deepest == 0:
            return deepest
        a, b = line
        p = [seq.acceptance for seq in self.running]
        best, best_rate = 0, n / (a + b * n)
        a, b = drafting
        da, db = (self.draft_cost.line(n) or line) if self.self_drafter is not None else (0.0, 0.0)
        for depth in range(1, deepest + 1):
            tokens = n + sum(p[i] ** j for i, k in enumerate(lengths) for j in range(1, min(depth, k) + 1))
            rate = tokens / (a + b * n * (1 + depth) + depth * (da + db * n))
            if rate > best_rate:
                best, best_rate = depth, rate
        if best and self.fused is not None and self.cost.points and not self.cost.seen(n, PROBE_STEPS):
            return 0
        return best

    def _decode(self, events: dict[int, tuple[BatchSequence, list[int]]]) -> None:
        """One forward over every running row: its pending token at slot L_i, then its draft's tokens. A greedy
        row keeps the longest prefix of its draft that equals its own targets, plus the target after it."""
        rows = list(self.running)
        cache = self.cache  # (replaced by a larger one if the cache grows during this step: `_reserve`)
        t0 = time.perf_counter()  # the step's cost includes proposing: Python work per row, only when drafting
        drafts, carry = self._drafts()
        if self.self_drafter is not None:  # its forwards have a line of their own (`_self_chains`)
            t0 = time.perf_counter()
        fed = [[s.tokens[s.length]] + d for s, d in zip(rows, drafts)]
        M = max(len(f) for f in fed)
        logits, hidden = self._forward(0, fed, [s.length for s in rows], last_only=M == 1, carry=carry)
        took = time.perf_counter() - t0
        timed = self.cache is cache  # a step that grew the cache copied it: not a sample of the cost line
        logits = logits[:, None] if M == 1 else logits  # [n, M, V]
        greedy = kernels.argmax(logits.reshape(-1, logits.shape[-1])).view(len(rows), M).tolist()
        c = self.cache
        anchors: list[int] = []  # per row, the column of its last accepted token: its fused rows draft next
        for i, seq in enumerate(rows):
            d, off = drafts[i], M - len(fed[i])  # row i's entries sit in columns off..M-1
            seq.forwards += 1
            if seq.cfg.temperature > 0:  # (a sampled row drafts nothing: a round that accepted 0)
                take = [int(self._sample(seq, logits[i, off:off + 1])[0])]
                seq.accept_hist[0] += 1
            else:
                a = 0
                while a < len(d) and d[a] == greedy[i][off + a]:
                    a += 1
                take = d[:a] + [greedy[i][off + a]]
                seq.accept_hist[a] += 1
                seq.hits += a
                seq.tries += min(len(d), a + 1)
                if not d:  # no evidence this step: keep `forget` of what lies beyond the prior
                    (h0, n0), f = seq.prior, self.forget
                    seq.hits, seq.tries = h0 + f * (seq.hits - h0), n0 + f * (seq.tries - n0)
                if a < len(d):  # the rejected drafts' slots: hidden from every later query, at every layer
                    c.bias[:, seq.row, seq.length + 1 + a:seq.length + 1 + len(d)] = float("-inf")
            if self.row_drafter is not None and seq.cfg.temperature == 0:  # the states of the committed positions
                seq.states.append(hidden[i, off:off + len(take)].clone())
            seq.length += len(take)  # the pending token and the accepted drafts are in the cache now
            anchors.append(off + len(take) - 1)
            self._commit(seq, take, events, logits[i, off:off + len(take)])  # column off + j chose take[j]
        if self.fused is not None:
            t1 = time.perf_counter()
            drafting = [i for i, seq in enumerate(rows) if carry and seq.cfg.temperature == 0 and not seq.done]
            chains = self.fused.chains(hidden[drafting, M:], [anchors[i] for i in drafting]) if drafting else []
            for seq in rows:
                seq.chain = []
            for i, chain in zip(drafting, chains):
                rows[i].chain = chain
            took += time.perf_counter() - t1  # a fused drafter's chains (its LM head) are part of its step
        if timed:  # (not the acceptance: committing a token costs the same with or without drafts)
            (self.fused_cost if carry else self.cost).add(len(rows) * M, took, len(rows))
        self._leave_finished(rows)

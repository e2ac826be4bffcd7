"""Draft trees sized by measured cost (issue 11, item 5): `--tree auto`.

Speculative decoding's speed is (tokens per round) / (time per round). Both depend on the tree:

* tokens per round. Verification walks down from the root (`speculative.verify_tree`), so a node is accepted
  iff every node on its path is. With the draft's held-out per-rank accuracies acc[d][r] (the probability
  that the rank-r candidate at depth d + 1 is the base model's token, `DraftTree.greedy_from_accuracies`),
  treating depths as independent,

      E[tokens per round] = 1 + sum over nodes (r_1..r_D) of prod_d acc[d-1][r_d],

  the 1 being the token the base model adds after the accepted path (its own prediction at the last
  accepted node). For a given number of nodes n, `greedy_from_accuracies(acc, n)` maximises this sum.
* time per round: the verification forward plus whatever the drafter runs. Each forward is described by
  the rows present at every block and the rows that go through the final norm + LM head, and costs

      ms(forward) = call_ms  +  sum over blocks b with R_b > 0 of (blocks_ms(R_b) - call_ms) / L
                    +  head_ms(R_head),

  with blocks_ms(T) and head_ms(T) the measured cost of a forward over T rows of all L blocks and of the
  head, and call_ms what any forward call costs before its rows' work (embedding, RoPE tables, the cache
  step, dispatch: what makes this formula price a measured one-block one-row call at what it took,
  call_ms = (t_1 - blocks_ms(1) / L) L / (L - 1)); a full forward costs
  blocks_ms + head_ms exactly (`RowCosts`, `measure_row_costs`: measured once per model, weight format and
  CPU and cached). Rows that join mid-network (hidden transfer's fused pass) or drafts that run only some
  blocks (early exit, layer skip, an EAGLE layer) are thereby costed by the blocks they actually run, and
  each draft call pays call_ms: without it a one-block EAGLE level cost 1/30 of the forward's fixed cost,
  and `auto` chose EAGLE trees that lost 5-16% to plain decoding (docs/results/hidden-transfer-cpu.md,
  27th session).

`choose_tree` evaluates n = 0, 1, ..., max_nodes (n = 0 is plain decoding: one token per one-row forward)
and returns the tree of highest expected tokens per second with the whole table, so the choice can be
inspected (`midlayer generate --draft DIR --tree auto --stats`).

Early exit reports held-out accuracy at depth 1 only (and layer skip none: it borrows another draft's);
their deeper depths are assumed to be as accurate as depth 1 (an optimistic guess: acceptance usually
falls with depth, so `auto` may pick slightly deep trees for them). EAGLE reports every depth, scored with
its own predicted features but the true tokens above (draft_training.heldout_metrics).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from midlayer.common import atomic_write, cache_dir, device_sync
from midlayer.engine.decode_step import anchor_shifts
from midlayer.engine.draft_vocab import draft_vocab
from midlayer.engine.generate import forward_cached, generate_stream, GenerationConfig
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.ops.kernels import cpu_info, library_path
from .drafting import run_blocks_cached
from .protocol import Drafter, Forward
from .tree import DraftTree
from .verify import speculative_generate

# Forward (protocol.py): (rows at each block 0..L-1, rows through the final norm + LM head[, the share of the
# head's rows they read: a draft vocabulary (draft_vocab.py) reads |vocab| of V rows, and batch-1 head rows
# cost what they read])
DEFAULT_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


# ================================================================================== the row-cost curve
@dataclass(frozen=True)
class RowCosts:
    """Measured ms of one cached forward over T new rows: `total_ms` (all blocks + head) and `head_ms`
    (final norm + LM head alone), at the row counts `rows` (increasing); linear in between and beyond.
    `call_ms`: the fixed cost of a forward call (module docstring), part of total_ms."""

    rows: tuple[int, ...]
    total_ms: tuple[float, ...]
    head_ms: tuple[float, ...]
    n_layers: int
    call_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (len(self.rows) == len(self.total_ms) == len(self.head_ms) >= 1):
            raise ValueError("rows, total_ms and head_ms need the same (non-zero) length")
        if (not all(type(r) is int for r in self.rows) or list(self.rows) != sorted(set(self.rows))
                or self.rows[0] < 1):
            raise ValueError(f"rows must be increasing positive ints, got {self.rows}")
        if type(self.n_layers) is not int or self.n_layers < 1:
            raise ValueError(f"n_layers must be an int >= 1, got {self.n_layers!r}")
        if not all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0  # (a damaged store's NaN or -1)
                   for t in (*self.total_ms, *self.head_ms, self.call_ms)):
            raise ValueError("total_ms, head_ms and call_ms must be finite and >= 0")
        if not 0.0 <= self.call_ms <= self.total_ms[0] - self.head_ms[0]:
            raise ValueError(f"call_ms {self.call_ms} must lie in [0, the blocks' ms at {self.rows[0]} rows]")

    @staticmethod
    def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        i = 1
        while i < len(xs) - 1 and xs[i] < x:
            i += 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def head(self, T: int) -> float:
        return 0.0 if T <= 0 else max(self._interp(self.rows, self.head_ms, T), 0.0)

    def blocks(self, T: int) -> float:
        """ms of all L blocks over T rows (the total minus the head)."""
        if T <= 0:
            return 0.0
        return max(self._interp(self.rows, [t - h for t, h in zip(self.total_ms, self.head_ms)], T), 0.0)


def forward_ms(costs: RowCosts, forward: Forward) -> float:
    """ms of one forward (module docstring): call_ms if any block runs, each running block's share of
    blocks_ms(R_b) - call_ms, plus share * head_ms(R_head)."""
    rows_per_block, head_rows, *rest = forward
    share = float(rest[0]) if rest else 1.0
    if len(rows_per_block) != costs.n_layers:
        raise ValueError(f"{len(rows_per_block)} block row counts for a model of {costs.n_layers} blocks")
    c = costs.call_ms
    blocks = sum(max(costs.blocks(r) - c, 0.0) for r in rows_per_block if r > 0) / costs.n_layers
    return (c if any(r > 0 for r in rows_per_block) else 0.0) + blocks + share * costs.head(head_rows)


def head_share(module: object, vocab_size: int) -> float:
    """The share of the LM head a draft module's candidates read: |draft vocabulary| / V, or 1."""

    v = draft_vocab(module) if module is not None else None
    return 1.0 if v is None else min(1.0, v.numel() / vocab_size)


# ========================================================================== what a round of a drafter runs
def round_forwards(drafter: Drafter, tree: DraftTree, n_layers: int) -> list[Forward]:
    """The forwards one speculative round runs with `drafter` and `tree`: the verification forward (root +
    nodes; with hidden transfer's fused pass also the pseudo rows, each from the block it joins at), then
    the drafter's own. Each drafter describes its round (`Drafter.verify_forward` / `draft_forwards`)."""
    if not len(tree):  # no draft: plain decoding
        return [([1] * n_layers, 1)]
    return [drafter.verify_forward(tree, n_layers), *drafter.draft_forwards(tree, n_layers)]


def round_ms(costs: RowCosts, drafter: object, tree: DraftTree) -> float:
    return sum(forward_ms(costs, f) for f in round_forwards(drafter, tree, costs.n_layers))


# ====================================================================== what the forwards do not account for
@dataclass(frozen=True)
class Overhead:
    """Measured ms that the forwards of `round_forwards` leave out (`measure_overhead`): per token of plain
    decoding (the decode loop, argmax), per speculative round (verification's acceptance, the cache
    compaction, the loop), and per draft forward call (a drafter's Python, its input projection, top-k).
    Without them `auto` priced an EAGLE-2 round's drafting at ~1.9 ms where it took ~4 ms, and chose trees
    that lost to plain decoding (docs/results/hidden-transfer-cpu.md, 28th session). plain_ms and round_ms
    are measured against the cached curve in the same run, so they are negative when the machine ran
    faster then than when the curve was measured (a shared host drifts by 20% within minutes). `bench
    decode` measures them afresh, so its rounds are priced as they cost now; `generate` reuses the first
    measurement per drafter and machine (`cached_overhead`), which keeps that moment's drift and prompt
    length: a trade of ~1 s a call for a price that can be off by the drift (`--refresh-costs`)."""

    plain_ms: float = 0.0
    round_ms: float = 0.0
    call_ms: float = 0.0


def draft_calls(drafter: object, tree: DraftTree, n_layers: int) -> int:
    """The drafter's own forward calls in one round with `tree` (the verification forward not counted)."""
    return len(round_forwards(drafter, tree, n_layers)) - 1 if len(tree) else 0


def total_round_ms(costs: RowCosts, drafter: object, tree: DraftTree, overhead: Overhead | None = None) -> float:
    """round_ms plus the measured overhead: per plain token for the empty tree, else per round and per
    draft call."""
    ms = round_ms(costs, drafter, tree)
    if overhead is None:
        return ms
    if not len(tree):
        extra = overhead.plain_ms
    else:
        extra = overhead.round_ms + overhead.call_ms * draft_calls(drafter, tree, costs.n_layers)
    return max(ms + extra, 0.25 * ms)  # (a floor for a wild measurement: never free)


def measure_overhead(model, drafter: object, costs: RowCosts, prompt_ids: Sequence[int],
                     trees: Sequence[DraftTree] = (DraftTree.chain(1), DraftTree.chain(3)), new_tokens: int = 48,
                     repeats: int = 2, timer: Callable[[], float] = time.perf_counter) -> Overhead:
    """`Overhead` from short greedy generations on `prompt_ids`, plain decoding and each tree of `trees`
    interleaved `repeats` times: the median interval between plain tokens minus the modelled one-row
    forward, and per tree the median interval between the ends of its rounds minus its modelled forwards
    (medians of intervals: the prefill and a stray slow step do not count). Two trees with different numbers
    of draft calls split that excess into a per-round and a per-call part (`split_excess`)."""

    L = costs.n_layers
    prompt = list(prompt_ids)
    gcfg = GenerationConfig(max_new_tokens=max(new_tokens, 3))
    k = drafter.draft_steps()
    if k is not None:  # no deeper than the drafter drafts (Medusa, hidden transfer: k steps)
        trees = list(dict.fromkeys(t.prune(min(t.max_depth, k), len(t)) for t in trees))

    def intervals(stamps: list[float]) -> list[float]:
        return [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]

    plain: list[float] = []
    rounds: list[list[float]] = [[] for _ in trees]
    with torch.no_grad():
        for _ in generate_stream(model, [prompt], GenerationConfig(max_new_tokens=2)):  # warm-up
            pass
        for tree in trees:
            speculative_generate(model, prompt, drafter, tree, 4)
        for _ in range(max(repeats, 1)):
            stamps: list[float] = []
            for _ in generate_stream(model, [prompt], gcfg):
                stamps.append(timer())
            plain += intervals(stamps)
            for i, tree in enumerate(trees):
                ends: list[float] = []
                speculative_generate(model, prompt, drafter, tree, new_tokens,
                                     on_round=lambda cache, toks: ends.append(timer()))
                rounds[i] += intervals(ends)
    points = [(draft_calls(drafter, tree, L), statistics.median(r) - round_ms(costs, drafter, tree))
              for tree, r in zip(trees, rounds) if r]
    per_token = statistics.median(plain) - forward_ms(costs, ([1] * L, 1)) if plain else 0.0
    return Overhead(per_token, *split_excess(points))


def split_excess(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(per round, per call) ms from (draft calls, excess ms per round) points: the least-squares line when
    the call counts differ, else all per round. The per-call slope is at least 0 (a negative one is noise);
    the per-round part may be negative (`Overhead`)."""
    if not points:
        return 0.0, 0.0
    xs = [x for x, _ in points]
    per_call = 0.0
    if len(set(xs)) > 1:
        mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
        per_call = max(sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs), 0.0)
    return statistics.fmean(y - per_call * x for x, y in points), per_call


# ================================================================================== choosing the tree
def expected_tokens(tree: DraftTree, acc: Sequence[Sequence[float]], anchors: Sequence[int] | None = None) -> float:
    """1 + sum over nodes of prod_d acc[d-1][r_d]; ranks or depths beyond acc count as never accepted,
    and an autoregressive draft's single row is used at every depth (module docstring).

    `anchors` (hidden transfer's pseudo rows for these tree rows only, `decode_step.anchor_shifts`): a round
    that ended `delta` depths below its anchor drafts depth j from the anchor's step j + delta, as accurate as
    the draft's depth j + delta (never, past the last), and where that round ends sets the next one's delta.
    The tokens a round are then the mean of each delta's, E_delta = sum over rows r of P_delta(end = r)
    (depth(r) + 1) (`DraftTree.end_probabilities`), weighted by the chain's stationary distribution over delta
    (power iteration from delta = 0). Every row an anchor: the formula above."""
    if anchors is not None:
        return _anchored_tokens(tree, acc, anchors)
    total = 1.0
    for path in tree.paths:
        p = 1.0
        for d, r in enumerate(path):
            row = acc[min(d, len(acc) - 1)] if acc else []
            p *= row[r] if r < len(row) else 0.0
        total += p
    return total


def _anchored_tokens(tree: DraftTree, acc: Sequence[Sequence[float]], anchors: Sequence[int]) -> float:
    """`expected_tokens` with anchors (its docstring)."""
    shifts = [delta for _, delta in anchor_shifts(tree.parent.tolist(), tree.depth.tolist(), anchors)]
    D = max(shifts) + 1
    ends = [tree.end_probabilities([acc[j + d] if j + d < len(acc) else [] for j in range(len(acc))])
            for d in range(D)]  # P(end = r | the round's delta is d)
    depth = [0] + tree.depth.tolist()
    tokens = [sum(p * (depth[r] + 1) for r, p in enumerate(e)) for e in ends]
    move = [[0.0] * D for _ in range(D)]  # P(next delta | this delta): at most k + 1 states
    for d in range(D):
        for r, p in enumerate(ends[d]):
            move[d][shifts[r]] += p
    pi = [1.0] + [0.0] * (D - 1)
    for _ in range(1000):  # (power iteration, until it settles: a few dozen steps)
        nxt = [sum(pi[d] * move[d][e] for d in range(D)) for e in range(D)]
        done = max(abs(a - b) for a, b in zip(nxt, pi)) < 1e-12
        pi = nxt
        if done:
            break
    return sum(w * t for w, t in zip(pi, tokens))


# hidden transfer's anchor counts `auto` tries beside every row (`choose_tree`'s anchor_cost)
ANCHOR_COUNTS = (1, 2, 4, 8, 16)


def depth_rows(acc: Sequence[Sequence[float]], depth: int | None) -> list[list[float]]:
    """acc with `depth` rows (None: its own), its last row repeated below it: what `choose_tree` prices an
    autoregressive drafter's deeper depths with (module docstring)."""
    return [list(acc[min(d, len(acc) - 1)]) for d in range(len(acc) if depth is None else depth)]


def choose_tree(acc: Sequence[Sequence[float]], round_cost: Callable[[DraftTree], float], max_nodes: int = 64,
                max_depth: int | None = None, anchor_cost: Callable[[DraftTree, int], float] | None = None
                ) -> tuple[DraftTree, list[dict]]:
    """The tree of highest expected tokens per ms among `greedy_from_accuracies(acc', n)` for n = 0..max_nodes
    (acc' = acc repeated down to max_depth when it has fewer rows: autoregressive drafters). Returns
    (tree, table) with one row {nodes, depth, anchors, tokens, ms, tok_per_s} per candidate, the chosen one's
    with chosen=True. With `anchor_cost(tree, m)` (hidden transfer's fused pass), each tree is also priced with
    pseudo rows for m of its rows only, m in ANCHOR_COUNTS below its rows (`DraftTree.likeliest_ends`; anchors
    0: every row)."""
    if not acc:
        raise ValueError("choose_tree needs held-out per-rank accuracies (acc[d][r]) of the draft")
    full = depth_rows(acc, max_depth)
    best, table = None, []
    for n in range(max_nodes + 1):
        tree = DraftTree.greedy_from_accuracies(full, n)
        if len(tree) < n:
            break  # every path of the accuracy table is already in: nothing new beyond here
        counts = [m for m in ANCHOR_COUNTS if m <= n] if anchor_cost is not None else []
        for m in [0, *counts]:
            if m:
                tokens, ms = expected_tokens(tree, full, tree.likeliest_ends(full, m)), anchor_cost(tree, m)
            else:
                tokens, ms = expected_tokens(tree, full), round_cost(tree)
            row = dict(nodes=len(tree), depth=tree.max_depth, anchors=m, tokens=tokens, ms=ms,
                       tok_per_s=1e3 * tokens / ms)
            table.append(row)
            if best is None or row["tok_per_s"] > best[1]["tok_per_s"]:
                best = (tree, row)
    best[1]["chosen"] = True
    return best[0], table


def auto_tree(model, drafter: object, acc: Sequence[Sequence[float]], costs: RowCosts, max_nodes: int = 64,
              max_depth: int | None = None, overhead: Overhead | None = None) -> tuple[DraftTree, list[dict]]:
    """`choose_tree` with the round cost of `drafter` on `model` from the measured `costs` (and `overhead`,
    `measure_overhead`, when given); depth limited to what the drafter can draft (hidden transfer and
    Medusa: k steps). A drafter with a fused pass (hidden transfer) is priced with fewer anchors too, and
    takes the chosen count (its `anchors`, 0: every row)."""
    k = drafter.draft_steps()
    depth = min(x for x in (max_depth, k) if x is not None) if (max_depth or k) else None
    # a round's root and nodes after at least one token of text: no larger tree ever fits the context
    max_nodes = max(1, min(max_nodes, model.cfg.max_seq_len - 2))

    def anchored(tree: DraftTree, m: int) -> float:  # (a copy of the drafter with m anchors prices their rows)
        priced = copy.copy(drafter)
        priced.anchors = m
        return total_round_ms(costs, priced, tree, overhead)

    tree, table = choose_tree(acc, lambda t: total_round_ms(costs, drafter, t, overhead), max_nodes, depth,
                              anchored if drafter.fused else None)
    if drafter.fused:  # (the anchors priced are the ones it runs: chosen from the same accuracies)
        drafter.anchors = next(r["anchors"] for r in table if r.get("chosen"))
        drafter.acc = depth_rows(acc, depth)
    return tree, table


# ============================================================================= measuring (and caching) it
def measure_row_costs(model, rows: Sequence[int] = DEFAULT_ROWS, context: int = 128, repeats: int = 5,
                      timer: Callable[[], float] = time.perf_counter) -> RowCosts:
    """Median ms of a cached forward over T new rows after `context` tokens, and of the final norm + head
    over T rows, for each T (T values interleaved per repeat, so drift hits all alike); and call_ms, from
    the median t_1 of a one-row call through the first block alone: the fixed cost c for which `forward_ms`
    prices that call at t_1, c + (blocks_ms(1) - c) / L = t_1 (module docstring; L = 1 leaves c unknown: 0)."""

    cfg = model.cfg
    # the row counts that fit the context after at least one token (a model of a short context prices its larger
    # rounds by the curve's last segment, `RowCosts._interp`; it refused `--tree auto` outright)
    rows = sorted(set(int(r) for r in rows if int(r) < cfg.max_seq_len))
    if not rows:
        raise ValueError(f"max_seq_len {cfg.max_seq_len} leaves no room for a row after a context")
    context = min(context, cfg.max_seq_len - max(rows))
    dev = model.tok_embeddings.weight.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context + max(rows)), generator=g).to(dev)
    cache = KVCache.for_model(cfg, 1, context + max(rows), device=dev, dtype=kv_dtype(model))
    h = torch.randn(1, max(rows), cfg.dim, generator=g).to(dev)
    total: dict[int, list[float]] = {T: [] for T in rows}
    head: dict[int, list[float]] = {T: [] for T in rows}
    one_block: list[float] = []
    pos1 = torch.tensor([[context]], device=dev)
    with torch.no_grad():
        forward_cached(model, ids[:, :context], cache, torch.arange(context, device=dev)[None], last_only=True)
        for rep in range(repeats + 1):  # the first pass warms up
            for T in rows:
                cache.truncate(context)
                device_sync(dev)
                t0 = timer()
                forward_cached(model, ids[:, context:context + T], cache,
                               torch.arange(context, context + T, device=dev)[None])
                device_sync(dev)
                t1 = timer()
                model.output(model.norm(h[:, :T]))
                device_sync(dev)
                t2 = timer()
                if rep:
                    total[T].append(1e3 * (t1 - t0))
                    head[T].append(1e3 * (t2 - t1))
            cache.truncate(context)
            cache.reserve(1)
            device_sync(dev)
            t0 = timer()
            run_blocks_cached(model, ids[:, context:context + 1], pos1, cache, context, None, lambda b: True, 1)
            device_sync(dev)
            if rep:
                one_block.append(1e3 * (timer() - t0))
    tot = tuple(statistics.median(total[T]) for T in rows)
    hd = tuple(statistics.median(head[T]) for T in rows)
    blocks = [max(t - h, 0.0) for t, h in zip(tot, hd)]
    blocks1 = RowCosts._interp(rows, blocks, 1)
    L = cfg.n_layers
    call = (statistics.median(one_block) - blocks1 / L) * L / (L - 1) if L > 1 else 0.0
    call = min(max(call, 0.0), blocks[0])
    return RowCosts(tuple(rows), tot, hd, cfg.n_layers, call)


def _cache_file() -> Path:
    return cache_dir() / "row_costs.json"


def cost_key(model_name: str, weights: str, model=None) -> str:
    """What a row-cost curve depends on: the model, its weight format, the CPU (or GPU) and thread count, and
    the engine: torch's version and the q4 kernels' source (a curve measured before the fused q4 block was
    ~1.6x too slow at one row, docs/results/decode-cpu.md, 27th session)."""

    dev = "cpu"
    if model is not None:
        d = model.tok_embeddings.weight.device
        if d.type == "cuda":
            dev = torch.cuda.get_device_name(d)
    info = cpu_info()
    kv = getattr(model, "kv_dtype", None)  # an fp16 KV cache (the q4 default) makes attention cheaper
    if kv is not None:
        weights = f"{weights}|kv {str(kv).removeprefix('torch.')}"
    return f"{model_name}|{weights}|{dev}|{info.model}|{','.join(sorted(info.flags & {'avx2', 'avx512f', 'amx_bf16', 'avx512_vnni', 'avx_vnni'}))}|{torch.get_num_threads()}t|torch {torch.__version__}|{library_path().stem}"


def _load_store(path: Path) -> dict:
    try:
        store = json.loads(path.read_text(encoding="utf-8"))
        return store if isinstance(store, dict) else {}
    except (OSError, ValueError):  # absent, unreadable or damaged (bad JSON, bad UTF-8): re-measured, never trusted
        return {}


def _save_store(path: Path, key: str, value: Any) -> None:
    """store[key] = value in the cache file: re-read just before writing (another process may have added
    entries while this one measured), then replaced atomically. A cache that cannot be written costs only
    the measurement next time, never the call."""

    try:
        store = _load_store(path)
        store[key] = value
        atomic_write(path, json.dumps(store, indent=1).encode("utf-8"))
    except OSError as e:
        print(f"note: could not write the cost cache {path} ({e}); it will be measured again next time",
              file=sys.stderr)


def row_costs(model, model_name: str, weights: str, *, refresh: bool = False, progress: bool = False,
              **measure_kw) -> RowCosts:
    """The cached row-cost curve for (model, weights, machine), measured now if absent (~10-30 s)."""
    path, key = _cache_file(), cost_key(model_name, weights, model)
    store = _load_store(path)
    if not refresh and key in store:
        try:  # (a curve stored without call_ms, before it was measured, or damaged, is measured again)
            r = store[key]
            costs = RowCosts(tuple(r["rows"]), tuple(r["total_ms"]), tuple(r["head_ms"]), r["n_layers"], r["call_ms"])
            if costs.n_layers == model.cfg.n_layers:
                return costs
        except (KeyError, TypeError, ValueError):
            pass
    if progress:  # stderr: generated text alone goes to stdout
        print(f"measuring the row-cost curve for {key} (once; cached in {path})", file=sys.stderr, flush=True)
    costs = measure_row_costs(model, **measure_kw)
    _save_store(path, key, asdict(costs))
    return costs


def drafter_key(drafter: object, draft_dir: str | Path | None = None) -> str:
    """What a drafter's measured overhead depends on: its kind and settings (EAGLE-2's children per node,
    hidden transfer's fused pass) and its draft's architecture -- draft.json's kind and config, and the name
    and shape of every tensor in draft.safetensors (the draft vocabulary's size among them) -- not its
    trained values or held-out metrics (a retrained draft of the same shape shares the entry)."""
    import hashlib

    arch: dict[str, Any] = {}
    d = Path(draft_dir) if draft_dir is not None else None
    if d is not None and (d / "draft.json").is_file():
        try:
            meta = json.loads((d / "draft.json").read_text(encoding="utf-8"))
            arch = {"kind": meta.get("kind"), "config": meta.get("config")}
        except (OSError, ValueError, AttributeError):
            arch = {}
    if d is not None and (d / "draft.safetensors").is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(d / "draft.safetensors"), framework="pt") as f:
                arch["tensors"] = {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys())}
        except Exception:  # an unreadable file: the drafter would not have loaded; key on the rest
            pass
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16] if arch else ""
    return (f"{type(drafter).__name__}|{h}|dynamic_k={drafter.dynamic_k}"
            f"|fused={drafter.fused}" + (f"|anchors={drafter.anchors}" if drafter.anchors else ""))


def cached_overhead(model, drafter: object, costs: RowCosts, prompt_ids: Sequence[int], key: str, *,
                    refresh: bool = False, **measure_kw) -> Overhead:
    """`measure_overhead`, kept beside the row-cost curve under `key` (`cost_key` + `drafter_key`): a
    `generate --tree auto` call then pays its ~1 s once per drafter and machine. It is measured again when
    the curve it was measured against has changed (a refreshed curve), or with `refresh`."""
    path = _cache_file()
    store, k = _load_store(path), f"overhead|{key}"
    curve = [list(costs.rows), list(costs.total_ms)]
    hit = store.get(k)
    if not refresh and isinstance(hit, dict) and hit.get("curve") == curve:
        try:
            return Overhead(float(hit["plain_ms"]), float(hit["round_ms"]), float(hit["call_ms"]))
        except (KeyError, TypeError, ValueError):
            pass
    over = measure_overhead(model, drafter, costs, prompt_ids, **measure_kw)
    _save_store(path, k, {"curve": curve, **asdict(over)})
    return over


def curve_drift(costs: RowCosts, overhead: Overhead) -> float:
    """A plain token's interval when `overhead` was measured, over the one-row forward `costs` models: at least
    ~1 for a curve and an overhead measured alike (the decode loop adds to the forward, never takes from it)."""
    one = forward_ms(costs, ([1] * costs.n_layers, 1))
    return (one + overhead.plain_ms) / one if one > 0 else 1.0


# A plain token measured at under half the curve's one-row forward: the curve was measured on a busier machine
# (a seen case: -1197.99 ms "a plain token", a curve timed while other jobs ran), so every price is off by
# that factor. The upper side is not checked: a small model's decode loop can outcost its forward.
MIN_DRIFT = 0.5


def _prices(model, drafter: Drafter, prompt_ids: Sequence[int], model_name: str, weights: str, draft_key: str,
            refresh: bool, progress: bool) -> tuple[RowCosts, Overhead, str]:
    """The row-cost curve and `drafter`'s overhead `select_tree` prices with, both cached; measured again
    together, once, when they disagree (`MIN_DRIFT`). Also a note of what was measured again, or ""."""
    key = f"{cost_key(model_name, weights, model)}|{drafter_key(drafter, draft_key)}"
    costs = row_costs(model, model_name, weights, progress=progress, refresh=refresh)
    # what the forwards leave out (~1 s to measure): once per drafter and machine, then cached
    overhead = cached_overhead(model, drafter, costs, prompt_ids, key, refresh=refresh)
    drift = curve_drift(costs, overhead)
    if refresh or drift >= MIN_DRIFT:
        return costs, overhead, ""
    note = (f"the cached row-cost curve gave a one-row forward {1 / max(drift, 1e-9):.1f}x what a plain token "
            "took now (it was measured on a busier machine); measured both again")
    if progress:
        print(f"note: {note}", file=sys.stderr, flush=True)
    costs = row_costs(model, model_name, weights, progress=progress, refresh=True)
    return costs, cached_overhead(model, drafter, costs, prompt_ids, key, refresh=True), note + "\n"


def table_text(table: list[dict], chosen: DraftTree) -> str:
    """The candidates of `choose_tree` as a Markdown table, the chosen one marked (anchors: hidden transfer's
    pseudo rows for that many rows of the tree, "all": every row; of a tree's anchored rows only the fastest,
    and the chosen one, are shown)."""
    out = ["| nodes | depth | anchors | E[tokens/round] | ms/round | E[tok/s] |", "|---|---|---|---|---|---|"]
    best: dict[int, dict] = {}  # nodes -> its fastest anchored row
    for r in table:
        if r.get("anchors") and r["tok_per_s"] > best.get(r["nodes"], {"tok_per_s": -1.0})["tok_per_s"]:
            best[r["nodes"]] = r
    for r in table:
        if r.get("anchors") and r is not best[r["nodes"]] and not r.get("chosen"):
            continue
        mark = " **<-**" if r.get("chosen") else ""
        out.append(f"| {r['nodes']} | {r['depth']} | {r.get('anchors') or 'all'} | {r['tokens']:.2f} | {r['ms']:.1f} "
                   f"| {r['tok_per_s']:.1f}{mark} |")
    return "\n".join(out)


def parse_tree_spec(spec: str, what: str = "tree") -> tuple[str, int]:
    """(kind, N) of a tree spec: auto, chain (N = 0), sparse:N or dynamic:N (N a positive int); a ValueError
    naming `what` (e.g. the flag) otherwise. The one reading of the spec, for the CLI's checks and `select_tree`."""
    kind, sep, n = spec.partition(":")
    if kind in ("auto", "chain") and not sep:
        return kind, 0
    if kind not in ("sparse", "dynamic") or not sep:
        raise ValueError(f"{what}: expected auto, chain, sparse:N or dynamic:N, got {spec!r}")
    try:
        nodes = int(n)
    except ValueError:
        nodes = 0
    if nodes < 1:
        raise ValueError(f"{what} {spec!r}: N must be a positive integer")
    return kind, nodes


def check_tree_spec(drafter: Drafter, spec: str, acc: Sequence[Sequence[float]] | None = None, *,
                    acc_later: bool = False) -> tuple[str, int]:
    """`parse_tree_spec(spec)`, and the refusals of a tree this drafter cannot draft: sparse:N without per-depth
    accuracies (`acc_later`: the drafter measures them on each prompt, as prompt lookup does), dynamic:N without an
    expansion width (EAGLE's). No side effects: the API refuses in `attach`, before it changes anything."""
    kind, nodes = parse_tree_spec(spec)
    if kind == "sparse" and not acc_later and (not acc or len(acc) < 2):
        raise ValueError(f"tree {spec!r}: the draft has no per-depth accuracies to build a sparse tree; use chain")
    if kind == "dynamic" and drafter.dynamic_k is None:  # a drafter without an expansion width (EAGLE has one)
        raise ValueError(f"tree {spec!r} needs an EAGLE draft; this drafter is a {type(drafter).__name__}")
    return kind, nodes


def select_tree(model, drafter: Drafter, acc: Sequence[Sequence[float]] | None, spec: str, *, model_name: str,
                weights: str, prompt_ids: Sequence[int], draft_key: str = "", refresh: bool = False,
                progress: bool = False) -> tuple[DraftTree, str | None]:
    """The tree a generation drafts with, from a spec: "auto" (the tree of highest expected tokens/s from
    `acc` and this machine's measured row costs and overheads, cached per model, weights, machine and
    drafter, and for hidden transfer's fused pass how many of its rows carry pseudo rows, set on the drafter;
    the top-1 chain when there are no accuracies), "chain", "sparse:N" (the N nodes most likely
    accepted) or "dynamic:N" (EAGLE-2's dynamic tree of N nodes, for a drafter with an expansion width).
    Returns (tree, a text report of the choice for auto). The one implementation behind `generate` and the
    Python API."""
    # draft depth: k steps / heads; else the depths it was scored at; else (one depth measured) 3
    k = drafter.draft_steps() or (len(acc) if acc and len(acc) > 1 else 3)
    kind, nodes = check_tree_spec(drafter, spec, acc)
    if kind != "dynamic" and drafter.dynamic_k:  # a static tree asked for: the width an earlier dynamic:N call
        drafter.dynamic_k = 0                      # set would expand it (it did: a width-3 tree, not the chain)
    drafter.anchors = 0  # (auto sets its own; any other tree carries every row's pseudo rows)
    if kind == "auto" and acc:
        costs, overhead, again = _prices(model, drafter, prompt_ids, model_name, weights, draft_key, refresh, progress)
        tree, table = auto_tree(model, drafter, acc, costs, max_depth=k, overhead=overhead)
        return tree, (f"{again}measured beyond the modelled forwards: {overhead.plain_ms:+.2f} ms a plain token, "
                      f"{overhead.round_ms:+.2f} ms a round, {overhead.call_ms:+.2f} ms a draft call\n"
                      + table_text(table, tree))
    if kind in ("auto", "chain"):
        return DraftTree.chain(k), None
    if kind == "sparse":
        return DraftTree.greedy_from_accuracies(acc, nodes), None
    # dynamic: the budget: N nodes at most, as deep as the chain of k; each depth expands the best min(4, N) nodes
    drafter.dynamic_k = min(4, nodes)
    return DraftTree.greedy_from_accuracies([[1.0 - 1e-3 * i for i in range(nodes)]] * k, nodes), None


__all__ = ["parse_tree_spec", "check_tree_spec", "select_tree", "RowCosts", "Overhead", "forward_ms",
           "round_forwards", "round_ms", "draft_calls", "total_round_ms", "measure_overhead", "cached_overhead",
           "curve_drift", "MIN_DRIFT",
           "drafter_key", "split_excess", "expected_tokens", "choose_tree", "auto_tree", "measure_row_costs",
           "row_costs", "cost_key", "table_text"]

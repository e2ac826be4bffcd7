"""Model-agnostic speculative decoding: draft trees, tree-attention verification, the draft/verify loop.

Shared by every drafter of SPEC section 6 (hidden transfer, Medusa heads, early exit, layer-skip
self-speculation): a drafter only proposes candidate tokens; this module arranges them in a tree, checks
the whole tree with ONE base-model forward (tree attention, Wu et al. 2024, arXiv 2404.12022, sec. 3.4 /
3.4.1; Cai et al. 2024, Medusa), commits the accepted path plus one bonus token, and keeps the KV cache
equal to the cache of plain decoding.

Trees. A `DraftTree` is a list of root-to-node paths of top-k *ranks* (Medusa "choices"), e.g.
[(0,), (1,), (0, 0)]: node (0, 1) holds the rank-1 candidate of depth 2 under the rank-0 candidate of
depth 1. The root -- the last committed token, not yet in the cache -- is NOT a node: nodes are numbered
0..n-1 breadth-first (by depth, then by path), `parent[i] == -1` for depth-1 nodes, and node i sits at
RoPE position `last_pos + depth[i]` (the root at offset 0). During verification the forward runs over
[root, node_0, ..., node_{n-1}], i.e. node i is row i + 1.

Cache invariant (batch 1). Between rounds the cache holds exactly the committed tokens except the last
one, which is "pending": it is the next round's root and has position len(tokens) - 1 == cache.length.
`verify_tree` writes the root and all nodes, then `KVCache.keep` compacts root + accepted path to the
front, so afterwards the cache holds the committed context + root + accepted nodes -- bit for bit what
plain decoding of those tokens writes, up to float rounding (test_speculative checks 1e-5) -- and the
bonus token is the new pending token. Slots a layer does not hold (real skipping) have bias -inf; their
k/v contents are stale and never read.

Losslessness (what is exact, not approximate):
  * temperature 0, any tree, any drafter: greedy verification accepts a node only if its token is the base
    argmax at its parent, so the output equals `generate(model, [prompt], GenerationConfig(...))[0]`
    token for token (the logits are the same computation up to float rounding; a different argmax needs a
    near-exact tie).
  * temperature > 0, chain tree, drafter that gives its distribution q (`Draft.q`) and samples its tokens
    from q: speculative sampling (Leviathan et al. 2023, Alg. 1 / Thm. 1; Chen et al. 2023): accept x with
    prob min(1, p(x)/q(x)), on rejection sample from norm(max(0, p - q)), after a fully accepted chain
    sample the bonus from p. Exact: every committed token ~ p(. | prefix).
  * temperature > 0, any tree, deterministic drafter (top-k lists, no q): every candidate is a one-hot
    proposal. At a node with distinct child candidates c_1..c_m we run the rule above with q = one-hot(c_j)
    for j = 1..m in turn, each time on the residual of the previous rejection (SpecInfer's multi-round
    rule, Miao et al. 2024, with deterministic proposals): accept c_j with prob p_j(c_j), else
    p_{j+1} = p_j with c_j removed, renormalised; if every child is rejected sample from p_{m+1}. The
    resulting token is distributed exactly as p (it is sequential sampling of p over the candidates),
    so the tree walk is ancestral sampling from the base model: exact. On a chain this is the one-hot
    Leviathan rule.
  * temperature > 0, non-chain tree, drafter with q: refused (ValueError); the exact multi-candidate rule for
    sampled candidates needs the drafter's residual distributions, which this protocol does not carry.
  Temperature sampling here is plain softmax(logits / T) (no top-k / top-p). "Exact" is in distribution:
  the random stream differs from `generate(..., seed)`, so sampled tokens are not equal token for token.

Drafter protocol (`Drafter`): `propose(ctx: DraftContext) -> per-depth top-k lists | Draft`, called once per
round before verification. `DraftContext` carries everything the drafters need:
  * Medusa: `ctx.hidden[-1]`, the final residual at position len(tokens) - 2, whose LM-head output
    predicted the pending token; it is taken before the final norm (apply `model.norm` for the normed
    state that Medusa heads usually read); head i (0-based) predicts depth i + 1.
  * early exit / hidden transfer: `ctx.layer_hidden[l]`, the residual entering block l at the same rows,
    for the layers listed in the drafter's optional `hidden_layers` attribute (ModelOutput.hidden_states
    convention: l = n_layers is the final residual). Hidden transfer additionally uses the pseudo-state
    attention to the context, which lives in `ctx.cache`.
  * layer-skip self-speculation: `ctx.model` and `ctx.cache`; it may run the model on the cache (append
    draft tokens after `cache.length`) but must `cache.truncate` back to the length it found.
  * path-dependent drafters (autoregressive ones) return `Draft(node_tokens=...)`, one token per node of
    `ctx.tree` (which may be a pruned copy of the configured tree near the end of generation).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from midlayer.ops import kernels
from midlayer.engine.generate import forward_cached, validate_prompts
from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer

Path = tuple[int, ...]


# ============================================================================================ trees
class DraftTree:
    """A static draft tree given by root-to-node paths of top-k ranks (see the module docstring).

    Attributes (n = number of nodes, the root excluded):
      paths          tuple of the n paths, breadth-first (by depth, then lexicographically by rank);
      parent         LongTensor [n], index of the parent node, -1 for depth-1 nodes (parent = root);
      depth          LongTensor [n], >= 1; also the RoPE position offset from the root;
      ancestor_mask  BoolTensor [n, n], [i, j] True iff node j is node i or one of its ancestors;
      retrieve_paths LongTensor [n_leaves, max_depth], node indices from depth 1 down to each leaf
                     (leaves in node order), padded with -1;
      ranks_per_depth list[int], how many top-k candidates depth d + 1 uses (max rank + 1).
    """

    def __init__(self, paths: Iterable[Sequence[int]]) -> None:
        norm: list[Path] = []
        for p in paths:
            t = tuple(p)
            if len(t) == 0:
                raise ValueError("empty path: the root (last committed token) is implicit, not a node")
            for r in t:
                if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                    raise ValueError(f"path {t}: ranks must be non-negative ints")
            norm.append(t)
        seen: set[Path] = set()
        for t in norm:
            if t in seen:
                raise ValueError(f"duplicate path {t}")
            seen.add(t)
        for t in norm:
            for k in range(1, len(t)):
                if t[:k] not in seen:
                    raise ValueError(f"path {t} needs its prefix {t[:k]} in the tree (every node's parent)")
        # Breadth-first order: parents precede children, so the causal mask of the flattened sequence is
        # compatible with the tree mask and any BFS prefix of the nodes is itself a valid tree (pruning).
        self.paths: tuple[Path, ...] = tuple(sorted(norm, key=lambda t: (len(t), t)))
        index = {t: i for i, t in enumerate(self.paths)}
        n = len(self.paths)
        self.parent = torch.tensor([index[t[:-1]] if len(t) > 1 else -1 for t in self.paths], dtype=torch.long)
        self.depth = torch.tensor([len(t) for t in self.paths], dtype=torch.long)
        self.max_depth = int(self.depth.max()) if n else 0
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(n):  # parents come first, so their rows are complete when a child copies them
            if self.parent[i] >= 0:
                anc[i] |= anc[int(self.parent[i])]
        self.ancestor_mask = anc
        # children in the root-included numbering (root = 0, node i = i + 1), used by the verification walk
        self._children: list[list[int]] = [[] for _ in range(n + 1)]
        for i in range(n):
            self._children[int(self.parent[i]) + 1].append(i + 1)
        leaves = [i for i in range(n) if not self._children[i + 1]]
        rp = torch.full((len(leaves), self.max_depth), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            chain = anc[leaf].nonzero().flatten()  # ancestors-or-self, increasing index == increasing depth
            rp[row, :len(chain)] = chain
        self.retrieve_paths = rp
        self.ranks_per_depth = [1 + max(t[-1] for t in self.paths if len(t) == d)
                                for d in range(1, self.max_depth + 1)]
        self._mask_cache: dict[tuple[str, int], torch.Tensor] = {}

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def chain(cls, k: int) -> "DraftTree":
        """The top-1 chain of depth k (k = 0: no draft, plain decoding)."""
        if k < 0:
            raise ValueError(f"chain depth must be >= 0, got {k}")
        return cls([(0,) * d for d in range(1, k + 1)])

    @classmethod
    def from_topk(cls, k_per_depth: Sequence[int]) -> "DraftTree":
        """The full product tree: every combination of the top-k_d candidates at each depth d."""
        if any(k <= 0 for k in k_per_depth):
            raise ValueError(f"every depth needs k >= 1, got {list(k_per_depth)}")
        paths: list[Path] = []
        level: list[Path] = [()]
        for k in k_per_depth:
            level = [p + (r,) for p in level for r in range(k)]
            paths.extend(level)
        return cls(paths)

    @classmethod
    def greedy_from_accuracies(cls, acc: Sequence[Sequence[float]], n_nodes: int) -> "DraftTree":
        """The n_nodes nodes with the highest estimated acceptance probability (Medusa's sparse tree).

        acc[d][r] = probability that the rank-r candidate (0-based) of depth d + 1 is the token the base
        model accepts there (the *per-rank* top-r accuracy, measured on calibration data), for a drafter
        whose depths are treated as independent. The estimate for the node with path (r_1, ..., r_D) is

            P(node accepted) = prod_{d=1..D} acc[d-1][r_d],

        because the node is accepted iff every node on its path is (verification walks down from the
        root). The expected number of accepted draft tokens of a tree is the sum of this over its nodes,
        so taking the n best nodes maximises it for n nodes. Since acc <= 1 a child never scores above its
        parent, so the best-first expansion below yields a prefix-closed set (ties go to the shallower,
        then lexicographically smaller path, which keeps parents ahead of equal-scoring children). If fewer
        than n_nodes paths exist, all of them are taken.
        """
        if n_nodes < 0:
            raise ValueError(f"n_nodes must be >= 0, got {n_nodes}")
        for d, row in enumerate(acc):
            if len(row) == 0:
                raise ValueError(f"acc[{d}] is empty: give at least one rank per depth")
            for a in row:
                if not 0.0 <= a <= 1.0:
                    raise ValueError(f"acc[{d}] holds {a}, not a probability in [0, 1]")
        chosen: list[Path] = []
        heap: list[tuple[float, int, Path]] = []  # max-heap on the estimate via negation
        if acc:
            for r, a in enumerate(acc[0]):
                heapq.heappush(heap, (-a, 1, (r,)))
        while heap and len(chosen) < n_nodes:
            neg, depth, path = heapq.heappop(heap)
            chosen.append(path)
            if depth < len(acc):
                for r, a in enumerate(acc[depth]):
                    heapq.heappush(heap, (neg * a, depth + 1, path + (r,)))
        return cls(chosen)

    # ------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self.paths)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftTree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"DraftTree(n_nodes={len(self)}, max_depth={self.max_depth}, paths={list(self.paths)})"

    @property
    def position_offsets(self) -> torch.Tensor:
        """RoPE position of each node relative to the root: its depth (sec. 3.4.1: original positions)."""
        return self.depth

    @property
    def is_chain(self) -> bool:
        """True when every depth has exactly one node (a single root-to-leaf path)."""
        return len(self) == self.max_depth

    def level_sizes(self) -> list[int]:
        """Rows an autoregressive drafter runs per level to fill the tree: the root, then all nodes of every
        depth below the deepest (each proposes its children; the last level's nodes are never run)."""
        return [1] + [int((self.depth == d).sum()) for d in range(1, self.max_depth)] if self.max_depth else []

    def children(self, node: int) -> list[int]:
        """Child node indices of node `node` (-1: of the root)."""
        return [c - 1 for c in self._children[node + 1]]

    def prune(self, max_depth: int, max_nodes: int) -> "DraftTree":
        """The sub-tree of nodes with depth <= max_depth, cut to its first max_nodes nodes (BFS order keeps
        it prefix-closed). Used near the end of generation and of the context."""
        keep = [t for t in self.paths if len(t) <= max_depth][:max(max_nodes, 0)]
        return self if len(keep) == len(self) else DraftTree(keep)

    def verify_mask(self, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive extra_mask [1, 1, n+1, start+n+1] for `forward_cached` over [root, nodes] written at slots
        start..start+n: every row sees all committed slots < start; among the new rows a node sees only its
        ancestors, the root and itself (tree attention, sec. 3.4.1). The engine adds causality on top."""
        key = (str(device), start)
        m = self._mask_cache.get(key)
        if m is None:
            n = len(self)
            full = torch.ones(n + 1, n + 1, dtype=torch.bool)  # root row / column: root sees itself, all see root
            full[0, 1:] = False
            full[1:, 1:] = self.ancestor_mask
            block = torch.zeros(n + 1, n + 1).masked_fill(~full, float("-inf"))
            m = torch.cat([torch.zeros(n + 1, start), block], 1)[None, None].to(device)
            if len(self._mask_cache) > 64:  # start changes every round; keep the memo bounded
                self._mask_cache.clear()
            self._mask_cache[key] = m
        return m


def candidates_from_topk(per_depth_topk: Sequence[Sequence[int]], tree: DraftTree) -> torch.Tensor:
    """Node tokens [n] from per-depth candidate lists: node (r_1..r_D) gets per_depth_topk[D-1][r_D].

    The Medusa / hidden-transfer layout: a depth's candidates do not depend on the path above them.
    """
    if len(per_depth_topk) < tree.max_depth:
        raise ValueError(f"the tree has depth {tree.max_depth} but only {len(per_depth_topk)} depths of candidates")
    for d, need in enumerate(tree.ranks_per_depth):
        if len(per_depth_topk[d]) < need:
            raise ValueError(f"depth {d + 1} uses ranks up to {need - 1} but only {len(per_depth_topk[d])} "
                             "candidates were given")
    return torch.tensor([int(per_depth_topk[len(t) - 1][t[-1]]) for t in tree.paths], dtype=torch.long)


# ================================================================================ acceptance rules
def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator)[0])


def _uniform(p: torch.Tensor, generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, device=p.device, dtype=torch.float64))


def accept_among(p: torch.Tensor, candidates: Sequence[int], generator: torch.Generator | None
                 ) -> tuple[int, int]:
    """Multi-round rejection over deterministic candidates (one-hot proposals); returns (j, token).

    p [V]: the target distribution at this node. Candidate c_j is accepted with prob p_j(c_j), where p_1 = p
    and p_{j+1} = p_j with c_j removed, renormalised (Leviathan et al. 2023 with q = one-hot(c_j): accept
    min(1, p(x)/1), residual norm(max(0, p - one-hot)) ). j = -1 when all are rejected; the token is then
    sampled from the final residual. The returned token is distributed exactly as p.
    """
    p = p.double()
    p = p / p.sum()
    for j, c in enumerate(candidates):
        pc = float(p[c])
        if pc >= 1.0 or _uniform(p, generator) < pc:
            return j, int(c)
        p = p.clone()
        p[c] = 0.0
        p = p / p.sum()  # pc < 1, so mass remains
    return -1, _sample(p, generator)


def speculative_accept(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: Sequence[int] | torch.Tensor,
                       generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling over a chain (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    p [k+1, V]: base distributions at the root and after each draft token (row i conditions on
    draft_tokens[:i]). q [k, V]: the drafter's distributions that draft_tokens[i] was sampled from, or None
    for a deterministic drafter (q = one-hot on the proposal). Returns (n_accepted, next_token): the first
    n_accepted draft tokens are kept and next_token follows them -- the residual sample at the first
    rejection, or the bonus from p[k] if all k were accepted. The committed tokens are distributed exactly
    as the base model's sampling (Thm. 1 of Leviathan et al.).
    """
    draft = [int(t) for t in (draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else draft_tokens)]
    k = len(draft)
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be [k+1, V] = [{k + 1}, V], got {tuple(p.shape)}")
    if q is not None and (q.dim() != 2 or q.shape[0] < k or q.shape[1] != p.shape[1]):
        raise ValueError(f"q must be [k, V] = [{k}, {p.shape[1]}], got {tuple(q.shape)}")
    for i, x in enumerate(draft):
        if q is None:
            j, tok = accept_among(p[i], [x], generator)
            if j < 0:
                return i, tok
            continue
        pi, qi = p[i].double(), q[i].double()
        pi, qi = pi / pi.sum(), qi / qi.sum()
        if float(qi[x]) <= 0.0:
            raise ValueError(f"draft token {x} at depth {i + 1} has q = 0: it cannot have been sampled from q")
        if _uniform(pi, generator) < float(pi[x] / qi[x]):  # u < ratio  <=>  accept with prob min(1, ratio)
            continue
        residual = (pi - qi).clamp_min(0.0)
        s = float(residual.sum())
        # s == 0 means p == q, where rejection has probability 0; fall back to p for float safety.
        return i, _sample(residual / s if s > 0 else pi, generator)
    return k, _sample((p[k].double() / p[k].double().sum()), generator)


# ==================================================================================== verification
class VerifyResult(NamedTuple):
    """Outcome of one verification round (see `verify_tree`)."""

    accepted: list[int]  # accepted draft tokens, depth 1 first
    bonus: int  # the token after them (base argmax / sample); the next pending token, not in the cache
    logits: torch.Tensor  # [1 + a, V] base logits at the root and at each accepted node
    hidden: torch.Tensor  # [1 + a, d] final residual (before the last norm) at the same rows
    nodes: list[int]  # accepted node indices in the tree
    layer_hidden: dict[int, torch.Tensor]  # requested intermediate residuals at the same rows
    draft_logits: torch.Tensor | None = None  # fused drafter: its next-round logits [k, V] (see verify_tree)


def _capture_request(model: Transformer, layers: Sequence[int]) -> dict[int, torch.Tensor | None]:
    """The `capture` dict for `forward_cached`: the residual entering each block in `layers` (l ==
    n_layers, the final residual, comes from return_hidden instead)."""
    store: dict[int, torch.Tensor | None] = {}
    for layer in layers:
        if not 0 <= layer <= model.cfg.n_layers:
            raise ValueError(f"hidden layer {layer} not in [0, {model.cfg.n_layers}]")
        if layer < model.cfg.n_layers:
            store[layer] = None
    return store


def _collect_layers(model: Transformer, layers: Sequence[int], store: dict[int, torch.Tensor],
                    hidden: torch.Tensor, T: int, rows: torch.Tensor) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for layer in layers:
        if layer == model.cfg.n_layers:
            out[layer] = hidden
            continue
        h = store[layer]
        assert h is not None and h.shape[1] >= T, "forward_cached did not capture the requested layer"
        out[layer] = h[0, rows]  # rows index the first T (token) rows; joined rows come after them
    return out


def _base_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64: the distribution `sample_next` samples at this temperature."""
    return torch.softmax(logits.double() / temperature, -1)


@torch.no_grad()
def verify_tree(model: Transformer, cache: KVCache, last_token: int, last_pos: int, tree: DraftTree,
                node_tokens: torch.Tensor | Sequence[int], *, skip: bool = True, temperature: float = 0.0,
                generator: torch.Generator | None = None, draft_q: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = (), fused: "FusedDrafter | None" = None) -> VerifyResult:
    """Verify a filled draft tree with one base forward, commit the accepted path, compact the cache.

    Before: the cache (batch 1) holds the committed context except `last_token`, the pending root at
    position `last_pos`. One `forward_cached` runs [last_token, node tokens] at positions last_pos + (0,
    depth) with the tree's extra_mask. Temperature 0: walk down from the root, at each node taking the
    child whose token equals the base argmax there; the bonus is the argmax at the last accepted node.
    Temperature > 0: the exact rules of `speculative_accept` / `accept_among` (module docstring). After:
    `cache.keep` leaves committed context + root + accepted nodes; the bonus is the new pending token.

    `fused` (a drafter with `fused_rows` / `fused_draft`, e.g. hidden transfer): the same forward also
    drafts the next round (arXiv 2404.12022 sec. 3.4): the drafter's rows join mid-network for every
    possible anchor (root and each node), and after acceptance the rows of the actual anchor -- the last
    accepted node, or the root -- give `VerifyResult.draft_logits`. Their K/V slots are dropped by `keep`.
    """
    if cache.batch != 1:
        raise ValueError(f"speculative decoding supports batch 1 only; the cache has batch {cache.batch}")
    dev = cache.pos.device
    n = len(tree)
    nt = torch.as_tensor(node_tokens, dtype=torch.long).reshape(-1).cpu()
    if nt.numel() != n:
        raise ValueError(f"{nt.numel()} node tokens for a tree of {n} nodes")
    V = model.cfg.vocab_size
    if n and not (0 <= int(nt.min()) and int(nt.max()) < V):
        raise ValueError(f"node tokens must be in [0, {V}), got range [{int(nt.min())}, {int(nt.max())}]")
    if not 0 <= last_pos or last_pos + tree.max_depth >= model.cfg.max_seq_len:
        raise ValueError(f"positions {last_pos}..{last_pos + tree.max_depth} exceed the context "
                         f"{model.cfg.max_seq_len}: prune the tree")
    if temperature > 0 and draft_q is not None and not tree.is_chain:
        raise ValueError("temperature > 0 with drafter distributions q needs a chain tree: exact multi-candidate "
                         "rejection of *sampled* candidates is not implemented (deterministic top-k drafts, i.e. "
                         "q=None, work on any tree)")
    tokens = torch.cat([torch.tensor([int(last_token)]), nt]).to(dev)[None]
    positions = (last_pos + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])).to(dev)[None]
    start = cache.length
    # No extra mask without nodes: a single-token step then takes the engine's unmasked decode path,
    # exactly like plain decoding.
    extra = tree.verify_mask(start, dev) if n else None
    store = _capture_request(model, hidden_layers)
    joins = None
    rows_spec = fused.fused_rows(tree, last_pos, start) if fused is not None else None
    if rows_spec is None:
        fused = None  # e.g. no room left in the context for the joined rows' positions
    else:
        joins, join_pos, extra = rows_spec
        positions = torch.cat([positions, join_pos.to(dev)[None]], 1)
        extra = extra.to(dev)
    # The joined rows' logits are the drafter's to compute, for the accepted anchor's rows only (hidden
    # transfer: k of its N * k rows, on its draft vocabulary): the LM head reads the tree rows alone.
    logits, hidden = forward_cached(model, tokens, cache, positions, skip=skip, extra_mask=extra,
                                    return_hidden=True, capture=store, joins=joins,
                                    head_rows=n + 1 if fused is not None else None)
    join_hidden = hidden[0, n + 1:]
    logits, hidden = logits[0, :n + 1], hidden[0, :n + 1]  # row 0 = root, row i+1 = node i
    tok_list = nt.tolist()
    path: list[int] = []  # accepted nodes, root-included numbering (node i -> i + 1)
    if temperature == 0:
        target = kernels.argmax(logits).tolist()  # one host sync for the whole tree
        cur = 0
        while True:
            nxt = next((c for c in tree._children[cur] if tok_list[c - 1] == target[cur]), None)
            if nxt is None:
                bonus = target[cur]
                break
            path.append(nxt)
            cur = nxt
    elif draft_q is not None:  # chain with drafter distributions: Leviathan / Chen speculative sampling
        p = _base_probs(logits, temperature)
        a, bonus = speculative_accept(p, draft_q.to(p.device), tok_list, generator)
        path = list(range(1, a + 1))
    else:  # deterministic candidates on any tree: multi-round one-hot rejection = ancestral sampling of p
        p = _base_probs(logits, temperature)
        cur = 0
        while True:
            kids, cands = [], []
            for c in tree._children[cur]:
                if tok_list[c - 1] not in cands:  # a repeated token could never be accepted twice
                    kids.append(c)
                    cands.append(tok_list[c - 1])
            j, tok = accept_among(p[cur], cands, generator)
            if j < 0:
                bonus = tok
                break
            path.append(kids[j])
            cur = kids[j]
    rows = torch.tensor([0] + path, device=dev)
    cache.keep((start + rows)[None], start)
    layer_hidden = _collect_layers(model, hidden_layers, store, hidden[rows], n + 1, rows)
    draft_logits = fused.fused_draft(join_hidden, tree, path[-1] if path else 0) if fused is not None else None
    return VerifyResult([tok_list[c - 1] for c in path], int(bonus), logits[rows], hidden[rows],
                        [c - 1 for c in path], layer_hidden, draft_logits)


# ======================================================================================== drafters
@dataclass
class DraftContext:
    """What a drafter sees each round (batch 1). Read-only except as documented for `cache`."""

    model: Transformer
    cache: KVCache  # holds tokens[:-1]; a drafter may append after cache.length but must truncate back
    tokens: list[int]  # prompt + committed tokens; tokens[-1] is pending (position len(tokens) - 1)
    hidden: torch.Tensor  # [m, d] final residual of the last m committed-and-cached positions (m >= 1 except
    #                       for a 1-token prompt, m = 0); hidden[-1] is at position len(tokens) - 2. In the
    #                       first round m = 1, or every prompt row for a drafter with `prefill_features`
    logits: torch.Tensor  # base logits of the last rows (logits[-1] predicted tokens[-1]); after the prefill
    #                       only the last row's, [1, V], even when hidden has every prompt row
    layer_hidden: dict[int, torch.Tensor]  # residual entering block l at the same rows, for drafter.hidden_layers
    tree: DraftTree  # the tree to fill this round (the configured one, possibly pruned)
    temperature: float
    generator: torch.Generator | None  # the run's generator, for drafters that sample
    draft_logits: torch.Tensor | None = None  # a fused drafter's logits from the last verification forward


@dataclass
class Draft:
    """A drafter's proposal. Give `per_depth_topk` (Medusa layout, see `candidates_from_topk`) or
    `node_tokens` [n] (one token per node of ctx.tree, for path-dependent drafters). `q` [n, V]: only for
    sampling drafters on a chain -- the distribution each node token was sampled from."""

    per_depth_topk: Sequence[Sequence[int]] | None = None
    node_tokens: torch.Tensor | Sequence[int] | None = None
    q: torch.Tensor | None = None
    # A tree the drafter chose this round (dynamic trees, EAGLE-2), with node_tokens aligned to it: at most
    # as many nodes and as deep as ctx.tree, which is then the budget (cache slots, depth). None: ctx.tree.
    tree: DraftTree | None = None


@runtime_checkable
class FusedDrafter(Protocol):
    """A drafter whose next draft comes out of the verification forward itself (`verify_tree(fused=...)`).

    fused_rows(tree, last_pos, start) -> (JoinedRows, positions [J], extra_mask [1, 1, n+1+J, start+n+1+J]),
    or None to verify without joined rows this round;
    fused_draft(join_hidden [J, d], tree, anchor_row) -> the next round's logits from the joined rows' final
    residuals (before the final norm), anchor_row being 0 for the root or 1 + the index of the last accepted
    node; extra_slots(tree) -> J (for sizing the cache)."""

    def fused_rows(self, tree: "DraftTree", last_pos: int, start: int
                   ) -> tuple[Any, torch.Tensor, torch.Tensor] | None: ...

    def fused_draft(self, join_hidden: torch.Tensor, tree: "DraftTree", anchor_row: int) -> torch.Tensor: ...

    def extra_slots(self, tree: "DraftTree") -> int: ...


@runtime_checkable
class Drafter(Protocol):
    """propose(ctx) -> per-depth top-k lists or a `Draft`. Optional attribute `hidden_layers`: the blocks
    whose input residual the drafter needs in ctx.layer_hidden (n_layers = the final residual).
    `static_step` (default False): the drafter reads only ctx.tokens, ctx.hidden, ctx.logits and ctx.tree,
    never ctx.cache, so it also drafts for the static decode step (decode_step.py), whose cache is not a
    KVCache."""

    def propose(self, ctx: DraftContext) -> Sequence[Sequence[int]] | Draft: ...


def round_tree(draft: Sequence[Sequence[int]] | Draft, budget: DraftTree, fused: bool = False) -> DraftTree:
    """The tree a round verifies: the drafter's own (a dynamic tree, EAGLE-2), which must fit the round's budget
    tree (its nodes and depth: the cache slots and positions reserved) and, with `fused` (the dynamic
    engine's joined rows, laid out for the budget tree), cannot ride a fused pass; or else the budget tree
    itself. Both decode loops ask this (here and decode_step)."""
    if isinstance(draft, Draft) and draft.tree is not None:
        if len(draft.tree) > len(budget) or draft.tree.max_depth > budget.max_depth or fused:
            raise ValueError(f"a drafter's own tree must fit the round's budget ({len(budget)} nodes, depth "
                             f"{budget.max_depth}) and cannot ride a fused pass; got {len(draft.tree)} nodes, "
                             f"depth {draft.tree.max_depth}")
        return draft.tree
    return budget


def draft_node_tokens(draft: Sequence[Sequence[int]] | Draft, tree: DraftTree
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(draft, Draft):
        if draft.node_tokens is not None:
            return torch.as_tensor(draft.node_tokens, dtype=torch.long).reshape(-1).cpu(), draft.q
        if draft.per_depth_topk is None:
            raise ValueError("a Draft needs per_depth_topk or node_tokens")
        return candidates_from_topk(draft.per_depth_topk, tree), draft.q
    return candidates_from_topk(draft, tree), None


# ============================================================================================= loop
@dataclass
class SpecStats:
    new_tokens: int = 0  # tokens returned (committed, bonus included; cut at a stop token / the budget)
    base_forwards: int = 0  # verification forwards of the base model (the prefill is counted apart)
    prefill_forwards: int = 0
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[a]: rounds that accepted a draft tokens
    row_invariant: bool | None = None  # the static step's measured row invariance (None: not measured)

    @property
    def tau(self) -> float:
        """Mean tokens committed per base forward, bonus included (SPEC 6); 1.0 for plain decoding."""
        return self.new_tokens / self.base_forwards if self.base_forwards else 0.0


@torch.no_grad()
def speculative_generate(model: Transformer, prompt_ids: Sequence[int] | torch.Tensor, drafter: Drafter,
                         tree: DraftTree, max_new_tokens: int, stop_tokens: Sequence[int] = (),
                         temperature: float = 0.0, seed: int | None = None, *, skip: bool = True,
                         on_round: Callable[[KVCache, list[int]], None] | None = None
                         ) -> tuple[list[int], SpecStats]:
    """Draft / verify loop at batch 1. Returns (new tokens, stats), the same contract as `generate`: at most
    max_new_tokens tokens (and no more than the context allows), a stop token included and ending the row.

    The prompt minus its last token is prefilled; the last prompt token is the first pending root, so
    every base forward afterwards is a verification round. `on_round(cache, tokens)` (optional, for tests
    and tracing) is called after every round with all committed tokens; the cache then holds tokens[:-1].
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2:
            if prompt_ids.shape[0] != 1:
                raise ValueError(f"speculative decoding supports batch 1 only; got {prompt_ids.shape[0]} prompts")
            prompt_ids = prompt_ids[0]
        prompt_ids = prompt_ids.tolist()
    prompt = validate_prompts(model, [prompt_ids])[0]
    model.eval()
    cfg = model.cfg
    P, ctx_len = len(prompt), cfg.max_seq_len
    stats = SpecStats(accept_hist=[0] * (tree.max_depth + 1))
    budget = min(max_new_tokens, ctx_len - P + 1)  # as `generate_stream`: the last token needs no slot
    if budget <= 0:
        return [], stats
    if len(tree) == 0 and on_round is None:
        # An empty tree drafts nothing: plain decoding, through the one decode loop. The tree sizer prices it
        # so (tree_cost.round_forwards: one row per round); run through the rounds instead, a fused drafter
        # still paid for its joined rows (hidden transfer: 0.76x plain with the tree `--tree auto` chose
        # empty, docs/results/cuda-h100.md). Greedy: the same tokens; sampling: the same distribution.
        from midlayer.engine.generate import GenerationConfig, generate

        out = generate(model, [prompt], GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                         seed=seed, stop_tokens=tuple(stop_tokens), skip=skip))[0]
        return out, SpecStats(new_tokens=len(out), base_forwards=len(out), prefill_forwards=int(P > 1),
                              accept_hist=[len(out)])
    dev = model.tok_embeddings.weight.device
    fused = drafter if getattr(drafter, "fused", False) else None
    extra_slots = fused.extra_slots(tree) if fused is not None else 0
    # Slots: the committed text, the largest tree in flight and, for a fused drafter, its joined rows
    # (slots are not positions: the context limit applies to positions, checked in verify_tree).
    cache = KVCache.for_model(cfg, 1, max_len=P + budget + len(tree) + extra_slots, device=dev,
                              dtype=model.tok_embeddings.weight.dtype)
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed if seed is not None else torch.seed())
    hidden_layers = tuple(getattr(drafter, "hidden_layers", ()))
    stop = set(int(t) for t in stop_tokens)

    if P > 1:
        # A drafter that reads the features of the whole prompt (EAGLE's draft rows of the context) says so
        # with `prefill_features`; the others get the last row only.
        every = bool(getattr(drafter, "prefill_features", False))
        store = _capture_request(model, hidden_layers)
        logits, hidden = forward_cached(model, torch.tensor([prompt[:-1]], device=dev),
                                        cache, torch.arange(P - 1, device=dev)[None], skip=skip,
                                        last_only=True, return_hidden=True, capture=store, all_hidden=every)
        last = torch.tensor([P - 2], device=dev)
        hidden = hidden[0]  # [1, d] or [P - 1, d]; logits is already [1, V] (last_only)
        layer_hidden = _collect_layers(model, hidden_layers, store, hidden[-1:], P - 1, last)
        stats.prefill_forwards = 1
    else:
        hidden = torch.zeros(0, cfg.dim, device=dev)
        logits = torch.zeros(0, cfg.vocab_size, device=dev)
        layer_hidden = {layer: hidden for layer in hidden_layers}

    tokens = list(prompt)
    new: list[int] = []
    pruned: dict[tuple[int, int], DraftTree] = {}
    draft_logits = None
    while len(new) < budget:
        # Drafting deeper than the remaining budget is wasted work (and would make tau depend on it).
        depth_cap = budget - len(new) - 1
        room = cache.max_len - cache.length - 1
        key = (min(depth_cap, tree.max_depth), min(room, len(tree)))
        t = pruned.get(key)
        if t is None:
            t = pruned[key] = tree.prune(*key)
        dctx = DraftContext(model, cache, tokens, hidden, logits, layer_hidden, t, temperature, gen, draft_logits)
        length_before = cache.length
        draft = drafter.propose(dctx)
        t = round_tree(draft, t, fused is not None)
        node_tokens, q = draft_node_tokens(draft, t)
        if cache.length != length_before:
            raise RuntimeError(f"the drafter left the cache at length {cache.length}, not {length_before}: "
                               "truncate back after drafting with the model")
        res = verify_tree(model, cache, tokens[-1], len(tokens) - 1, t, node_tokens, skip=skip,
                          temperature=temperature, generator=gen, draft_q=q if temperature > 0 else None,
                          hidden_layers=hidden_layers, fused=fused)
        stats.base_forwards += 1
        stats.accept_hist[len(res.accepted)] += 1
        round_tokens = res.accepted + [res.bonus]
        tokens.extend(round_tokens)
        if on_round is not None:
            on_round(cache, tokens)
        hidden, logits, layer_hidden, draft_logits = res.hidden, res.logits, res.layer_hidden, res.draft_logits
        for tok in round_tokens:
            new.append(tok)
            if tok in stop or len(new) >= budget:
                stats.new_tokens = len(new)
                return new, stats
    stats.new_tokens = len(new)
    return new, stats

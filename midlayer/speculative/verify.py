"""Model-agnostic speculative decoding: tree-attention verification and the draft/verify loop.

Shared by every drafter of SPEC section 6 (hidden transfer, Medusa heads, early exit, layer-skip
self-speculation): a drafter only proposes candidate tokens; this module arranges them in a tree, checks
the whole tree with ONE base-model forward (tree attention, Wu et al. 2024, arXiv 2404.12022, sec. 3.4 /
3.4.1; Cai et al. 2024, Medusa), commits the accepted path plus one bonus token, and keeps the KV cache
equal to the cache of plain decoding.

Trees: `tree.py` (`DraftTree`: nodes, their numbering and rows, positions, the verification mask).

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

Drafters: `protocol.py` (`Drafter`, what a drafter sees each round, `DraftContext`, and returns, `Draft`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from midlayer.engine.generate import forward_cached, generate, GenerationConfig, validate_prompts
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.model.transformer import Transformer
from midlayer.ops import kernels
from .protocol import Draft, DraftContext, Drafter, FusedDrafter
from .tree import candidates_from_topk, DraftTree

Path = tuple[int, ...]


# ============================================================================================ trees




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
    """softmax(logits / T) in float64: the distribution `sample_next` samples at this temperature. The row's
    maximum is subtracted first, so a temperature tiny enough to overflow gives a one-hot row, not inf - inf."""
    x = logits.double()
    return torch.softmax((x - x.amax(-1, keepdim=True)) / temperature, -1)


@torch.no_grad()
def verify_tree(model: Transformer, cache: KVCache, last_token: int, last_pos: int, tree: DraftTree,
                node_tokens: torch.Tensor | Sequence[int], *, skip: bool = True, temperature: float = 0.0,
                generator: torch.Generator | None = None, draft_q: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = (), fused: "FusedDrafter | None" = None) -> VerifyResult:
    """Verify a filled draft tree with one base forward, commit the accepted path, compact the cache.

    Before: the cache (batch 1) holds the committed context except `last_token`, the pending root at
    position `last_pos`. One `forward_cached` runs [last_token, node tokens] at positions last_pos + (0,
    depth) with the tree's extra_mask (`tree_forward`). Temperature 0: walk down from the root, at each node
    taking the child whose token equals the base argmax there; the bonus is the argmax at the last accepted
    node. Temperature > 0: the exact rules of `speculative_accept` / `accept_among` (module docstring;
    `accept_path`). After: `cache.keep` leaves committed context + root + accepted nodes; the bonus is the
    new pending token.

    `fused` (a drafter with `fused_rows` / `fused_draft`, e.g. hidden transfer): the same forward also
    drafts the next round (arXiv 2404.12022 sec. 3.4): the drafter's rows join mid-network for every
    possible anchor (root and each node), and after acceptance the rows of the actual anchor -- the last
    accepted node, or the root -- give `VerifyResult.draft_logits`. Their K/V slots are dropped by `keep`.
    """
    nt = _check_round(model, cache, last_pos, tree, node_tokens, temperature, draft_q)
    n, start = len(tree), cache.length
    store = _capture_request(model, hidden_layers)
    logits, hidden, join_hidden, fused = tree_forward(model, cache, last_token, last_pos, tree, nt, skip=skip,
                                                      capture=store, fused=fused)
    tok_list = nt.tolist()
    path, bonus = accept_path(logits, tree, tok_list, temperature, generator, draft_q)
    # commit: root + accepted nodes move to the front of the round's slots; the rest (and joined rows) go
    rows = torch.tensor([0] + path, device=cache.pos.device)
    cache.keep((start + rows)[None], start)
    layer_hidden = _collect_layers(model, hidden_layers, store, hidden[rows], n + 1, rows)
    draft_logits = fused.fused_draft(join_hidden, tree, path[-1] if path else 0) if fused is not None else None
    return VerifyResult([tok_list[c - 1] for c in path], int(bonus), logits[rows], hidden[rows],
                        [c - 1 for c in path], layer_hidden, draft_logits)


def _check_round(model: Transformer, cache: KVCache, last_pos: int, tree: DraftTree,
                 node_tokens: torch.Tensor | Sequence[int], temperature: float, draft_q: torch.Tensor | None
                 ) -> torch.Tensor:
    """The node tokens as a CPU tensor, after refusing what a round cannot verify."""
    if cache.batch != 1:
        raise ValueError(f"speculative decoding supports batch 1 only; the cache has batch {cache.batch}")
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
    return nt


def tree_forward(model: Transformer, cache: KVCache, last_token: int, last_pos: int, tree: DraftTree,
                 node_tokens: torch.Tensor, *, skip: bool, capture: dict, fused: "FusedDrafter | None"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, "FusedDrafter | None"]:
    """The verification forward: [root, nodes] (+ a fused drafter's joined rows) at their positions under the
    tree mask, writing their K/V after cache.length. Returns (logits [n+1, V], final residuals [n+1, d], the
    joined rows' residuals, the fused drafter or None when it could not join this round)."""
    dev, n = cache.pos.device, len(tree)
    tokens = torch.cat([torch.tensor([int(last_token)]), node_tokens]).to(dev)[None]
    positions = (last_pos + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])).to(dev)[None]
    start = cache.length
    # No extra mask without nodes: a single-token step then takes the engine's unmasked decode path,
    # exactly like plain decoding.
    extra = tree.verify_mask(start, dev) if n else None
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
                                    return_hidden=True, capture=capture, joins=joins,
                                    head_rows=n + 1 if fused is not None else None)
    return logits[0, :n + 1], hidden[0, :n + 1], hidden[0, n + 1:], fused  # row 0 = root, row i+1 = node i


def accept_path(logits: torch.Tensor, tree: DraftTree, node_tokens: list[int], temperature: float,
                generator: torch.Generator | None, draft_q: torch.Tensor | None) -> tuple[list[int], int]:
    """The accepted nodes (rows: node i is i + 1) from the root down, and the bonus token after them."""
    path: list[int] = []
    if temperature == 0:
        target = kernels.argmax(logits).tolist()  # one host sync for the whole tree
        cur = 0
        while True:
            nxt = next((c for c in tree.child_rows(cur) if node_tokens[c - 1] == target[cur]), None)
            if nxt is None:
                return path, target[cur]
            path.append(nxt)
            cur = nxt
    p = _base_probs(logits, temperature)
    if draft_q is not None:  # chain with drafter distributions: Leviathan / Chen speculative sampling
        a, bonus = speculative_accept(p, draft_q.to(p.device), node_tokens, generator)
        return list(range(1, a + 1)), bonus
    cur = 0  # deterministic candidates on any tree: multi-round one-hot rejection = ancestral sampling of p
    while True:
        kids, cands = [], []
        for c in tree.child_rows(cur):
            if node_tokens[c - 1] not in cands:  # a repeated token could never be accepted twice
                kids.append(c)
                cands.append(node_tokens[c - 1])
        j, tok = accept_among(p[cur], cands, generator)
        if j < 0:
            return path, tok
        path.append(kids[j])
        cur = kids[j]


# ======================================================================================== drafters








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

    def commit(self, round_tokens: Sequence[int], new: list[int], stop: set[int] | Sequence[int], budget: int
               ) -> bool:
        """Count one verification round and append its tokens (accepted + bonus) to `new`, up to the first stop
        token or the budget. True when the generation ends there. Both decode loops commit through it."""
        self.base_forwards += 1
        self.accept_hist[len(round_tokens) - 1] += 1
        for tok in round_tokens:
            new.append(tok)
            if tok in stop or len(new) >= budget:
                self.new_tokens = len(new)
                return True
        self.new_tokens = len(new)
        return False


@torch.no_grad()
def check_draftable(model: Transformer) -> None:
    """Refuse, before any work, a model that no drafter can decode: every round rolls the cache back to the
    accepted tokens, and a state-space mixer's state cannot be rolled back (ssm.py)."""
    if model.cfg.ssm_layers:
        raise ValueError("speculative decoding rolls the cache back to the accepted tokens, and a state-space mixer's "
                         f"state cannot be rolled back (this model's ssm_layers={list(model.cfg.ssm_layers)}): "
                         "decode it without a drafter")


def speculative_generate(model: Transformer, prompt_ids: Sequence[int] | torch.Tensor, drafter: Drafter,
                         tree: DraftTree, max_new_tokens: int, stop_tokens: Sequence[int] = (),
                         temperature: float = 0.0, seed: int | None = None, *, skip: bool = True,
                         on_round: Callable[[KVCache, list[int]], None] | None = None,
                         stats: SpecStats | None = None) -> tuple[list[int], SpecStats]:
    """Draft / verify loop at batch 1. Returns (new tokens, stats), the same contract as `generate`: at most
    max_new_tokens tokens (and no more than the context allows), a stop token included and ending the row.
    `stats`: a SpecStats to count into (the caller then holds the counts of the rounds done when `on_round`
    stops the loop by raising).

    The prompt minus its last token is prefilled (`prefill_round`); the last prompt token is the first
    pending root, so every base forward afterwards is a verification round: `draft`, then `verify_tree`
    (forward, accept, commit). `on_round(cache, tokens)` (optional, for tests and tracing) is called after
    every round with all committed tokens; the cache then holds tokens[:-1].
    """
    check_draftable(model)
    # the settings checked by generation's one rule (budget, temperature, seed), kept as Python numbers
    settings = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                stop_tokens=tuple(stop_tokens), skip=skip)
    temperature = settings.temperature
    prompt = validate_prompts(model, [_one_prompt(prompt_ids)])[0]
    model.eval()
    cfg = model.cfg
    P = len(prompt)
    stats = stats if stats is not None else SpecStats()
    stats.accept_hist = [0] * (tree.max_depth + 1)
    # as `generate_stream`: the last token needs no slot
    budget = min(settings.max_new_tokens, cfg.max_seq_len - P + 1)
    if budget <= 0:
        return [], stats
    if len(tree) == 0 and on_round is None:
        # An empty tree drafts nothing: plain decoding, through the one decode loop. The tree sizer prices it
        # so (tree_cost.round_forwards: one row per round); run through the rounds instead, a fused drafter
        # still paid for its joined rows (hidden transfer: 0.76x plain with the tree `--tree auto` chose
        # empty, docs/results/cuda-h100.md). Greedy: the same tokens; sampling: the same distribution.
        out = generate(model, [prompt], settings)[0]
        stats.new_tokens = stats.base_forwards = len(out)
        stats.prefill_forwards, stats.accept_hist = int(P > 1), [len(out)]
        return out, stats
    dev = model.tok_embeddings.weight.device
    fused = drafter if drafter.fused else None
    extra_slots = fused.extra_slots(tree) if fused is not None else 0
    # Slots: the committed text, the largest tree in flight and, for a fused drafter, its joined rows
    # (slots are not positions: the context limit applies to positions, checked in verify_tree).
    # With windowed blocks beside global ones (Gemma 3) the windowed blocks keep a bounded cache, as in plain
    # generation (kv_cache.py): the W - 1 keys a later query may still see, plus room for one round -- the
    # drafter's scratch rows, then the verified tree and its joined rows -- made before each round.
    room = 2 * (len(tree) + 1) + extra_slots + 16
    W = cfg.sliding_window if cfg.mixed_windows else 0
    cache = KVCache.for_model(cfg, 1, max_len=P + budget + len(tree) + extra_slots, device=dev,
                              dtype=kv_dtype(model), local_len=W - 1 + max(W, room) if W else None)
    gen = settings.generator(dev)
    hidden, logits, layer_hidden = prefill_round(model, prompt, cache, drafter, skip)
    stats.prefill_forwards = int(P > 1)
    stop = set(int(t) for t in settings.stop_tokens)
    tokens, new = list(prompt), []
    draft_logits = None
    while len(new) < budget:
        # Drafting deeper than the remaining budget is wasted work (and would make tau depend on it).
        t = tree.prune(min(budget - len(new) - 1, tree.max_depth), min(cache.max_len - cache.length - 1, len(tree)))
        if cache.local_len:  # bounded windowed layers: drop the keys no later query sees, if room is short
            cache.make_room(room)
        dctx = DraftContext(model, cache, tokens, hidden, logits, layer_hidden, t, temperature, gen, draft_logits)
        t, node_tokens, q = draft(drafter, dctx, fused is not None)
        res = verify_tree(model, cache, tokens[-1], len(tokens) - 1, t, node_tokens, skip=skip,
                          temperature=temperature, generator=gen, draft_q=q if temperature > 0 else None,
                          hidden_layers=tuple(drafter.hidden_layers), fused=fused)
        round_tokens = res.accepted + [res.bonus]
        tokens.extend(round_tokens)
        if on_round is not None:
            on_round(cache, tokens)
        hidden, logits, layer_hidden, draft_logits = res.hidden, res.logits, res.layer_hidden, res.draft_logits
        if stats.commit(round_tokens, new, stop, budget):
            break
    return new, stats


def _one_prompt(prompt_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2:
            if prompt_ids.shape[0] != 1:
                raise ValueError(f"speculative decoding supports batch 1 only; got {prompt_ids.shape[0]} prompts")
            prompt_ids = prompt_ids[0]
        return prompt_ids.tolist()
    return list(prompt_ids)


def prefill_round(model: Transformer, prompt: list[int], cache: KVCache, drafter: Drafter, skip: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The prompt minus its last token into the cache; returns what the first `DraftContext` carries: the final
    residual(s), the last row's logits and the residuals entering the drafter's `hidden_layers`. A drafter
    that reads the features of the whole prompt (EAGLE's draft rows of the context) says so with
    `prefill_features`; the others get the last row only."""
    cfg, dev, P = model.cfg, model.tok_embeddings.weight.device, len(prompt)
    hidden_layers = tuple(drafter.hidden_layers)
    if P <= 1:
        hidden = torch.zeros(0, cfg.dim, device=dev)
        return hidden, torch.zeros(0, cfg.vocab_size, device=dev), {layer: hidden for layer in hidden_layers}
    ids = torch.tensor([prompt[:-1]], device=dev)
    step = cache.chunk(P - 1)  # bounded windowed layers take the prompt in chunks of at most their window
    parts = []
    store = _capture_request(model, hidden_layers)  # filled by the last chunk: the drafters read the last row
    for a in range(0, P - 1, step):
        b = min(a + step, P - 1)
        cache.make_room(b - a)
        logits, hidden = forward_cached(model, ids[:, a:b], cache, torch.arange(a, b, device=dev)[None], skip=skip,
                                        last_only=True, return_hidden=True, capture=store if b == P - 1 else None,
                                        all_hidden=drafter.prefill_features)
        parts.append(hidden[0])  # [1, d] or [b - a, d]; logits is already [1, V] (last_only)
    hidden = torch.cat(parts) if drafter.prefill_features else parts[-1]
    layer_hidden = _collect_layers(model, hidden_layers, store, hidden[-1:], b - a,
                                   torch.tensor([b - a - 1], device=dev))
    return hidden, logits, layer_hidden


def draft(drafter: Drafter, ctx: DraftContext, fused: bool) -> tuple[DraftTree, torch.Tensor, torch.Tensor | None]:
    """One round's draft: the tree it fills (the drafter's own, or ctx.tree), one token per node, and q for a
    sampling drafter. A drafter may run the model on the cache but must leave it as it found it."""
    length_before = ctx.cache.length
    proposal = drafter.propose(ctx)
    tree = round_tree(proposal, ctx.tree, fused)
    node_tokens, q = draft_node_tokens(proposal, tree)
    if ctx.cache.length != length_before:
        raise RuntimeError(f"the drafter left the cache at length {ctx.cache.length}, not {length_before}: "
                           "truncate back after drafting with the model")
    return tree, node_tokens, q

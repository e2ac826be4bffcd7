"""Draft modules and drafters for the speculative-decoding comparison of SPEC section 6.

Every drafter here implements the `speculative.Drafter` protocol (`propose(ctx) -> per-depth top-k lists |
Draft`) and works on any model the engine loads (our dense / gated `Transformer`s and pretrained Llama-family
checkpoints, which load into the same class): it only uses the base model's own embedding, blocks, final
norm and LM head, never anything architecture-specific. Losslessness does not depend on the drafter at all
(`speculative.verify_tree` accepts a node only if the base model agrees), so a drafter is free to be
approximate; the tests nevertheless check every drafter end to end against plain greedy decoding.

Trainable draft modules (the base model stays frozen; all decode through its frozen final norm + LM head):

  * `MedusaHeads(dim, k)` (Cai et al. 2024, "Medusa", sec. 2.1.1): head i (0-based) maps the last hidden
    state h_t of position t to a distribution over token t + 2 + i:
        x = norm(h_t),   y_i = x + SiLU(W_i x + b_i),   logits_i = LMHead(y_i).
    Medusa-1 initialises each head's output projection to the base LM head and W_i to zero; here the output
    projection IS the frozen base LM head (shared), and W_i, b_i are zero-initialised, so an untrained head
    predicts exactly the base model's next-token distribution at t (which is the best guess available
    without training). `MedusaDrafter` reads `ctx.hidden[-1]` (position len(tokens) - 2): head i then
    predicts the token at position len(tokens) + i, i.e. depth i + 1 of the tree.

  * `EarlyExitHead(dim, layer)`: logits = LMHead(norm(A h^(layer))) with h^(layer) the residual entering
    block `layer` and A a trainable d x d map initialised to the identity (so layer == n_layers gives the
    base model exactly). `EarlyExitDrafter` is the self-speculative early-exit drafter: it runs the base
    model's lower `layer` blocks *autoregressively on its own guesses* (it does not stop at one token, as
    the single-step early-exit probe of Wu et al. 2024 sec. 4.4 does; for a comparison at equal tree size
    every drafter has to fill a whole tree). See "Autoregressive tree drafting" below.

  * `eagle.EagleHead` / `eagle.EagleDrafter` (Li et al. 2024, "EAGLE"): one decoder layer, autoregressive
    over the base's top-layer features, drafting the tree level by level like early exit (see eagle.py).

  * `LayerSkipDrafter(model, skip_span)` (Zhang et al. 2023, "Draft & Verify", self-speculative decoding):
    the base model with a set of blocks skipped (residual passed through unchanged) drafts autoregressively.
    Nothing to train. With an empty span it *is* the base model, an oracle under greedy decoding.

Autoregressive tree drafting (early exit, layer skip, EAGLE). The draft tree (`ctx.tree`, nodes in
breadth-first order) is filled level by level with the same flattened layout that verification uses: the
pending root token at cache slot s0 = cache.length, node i at slot s0 + 1 + i, RoPE position last_pos +
depth, and the tree-attention mask `DraftTree.verify_mask(s0)` (each node sees the context, its ancestors
and itself). Level d (the root for d = 0) is run through the draft network in one call, writing its K/V
into those scratch slots; the rank-r child of a node gets the r-th most likely token of that node's draft
distribution. So max_depth partial forwards fill any tree, each node's token depends on its own path (a
chain is ordinary autoregressive drafting), and afterwards `cache.truncate(s0)` forgets the scratch slots
(the contract of `DraftContext`). Leaves at the last level are never run.

Gated base models in the draft networks: routers are evaluated at every first-half block, run or not (a
skipped block passes its input on, so the router reads the same residual it would read at that depth), the
second half mirrors them (eq. 2 of arXiv 2506.21103), and blocks are *computed* with the gate multiplied in
and the key bias ln(max(g, eps)) (the engine's skip=False semantics) instead of real skipping. Drafts only
need to be good guesses; this keeps the draft path one dense call per level.

Save / load: `save_draft(path, module, meta, base=model)` writes `path/draft.safetensors` (the module's
weights) and `path/draft.json` (kind, constructor config, the base model's dimensions, an optional name and
a 64-value probe of its LM head, and free-form meta). `load_draft(path, base)` rebuilds the module and
refuses a file written for another base model (different dimensions, name or LM-head probe).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from midlayer.ops import kernels
from midlayer.train.checkpoint import atomic_write_bytes
from midlayer.data.shards import file_sha256
from .draft_vocab import draft_vocab, head_logits, restrict_logits, set_draft_vocab, teacher_logits, to_token_ids
from midlayer.engine.generate import CachedStep
from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer, nonfinite_tensors
from .verify import Draft, DraftContext, DraftTree

DRAFT_FORMAT = "midlayer-draft-v1"
WEIGHTS_NAME = "draft.safetensors"
CONFIG_NAME = "draft.json"


# ============================================================================================ helpers
def apply_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x) computed in the draft module's dtype, returned in x's dtype (a bf16 base keeps fp32 drafts)."""
    return linear(x.to(linear.weight.dtype)).to(x.dtype)


def lm_logits(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    """The base model's own decoding of a residual: LMHead(norm(h))."""
    return model.output(model.norm(h))


def kl_rows(base_logits: torch.Tensor, other_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_base || p_other) per row, logits [..., V] -> [...], in fp32 (gradient only through `other`)."""
    t = F.log_softmax(base_logits.detach().float(), -1)
    s = F.log_softmax(other_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1)


def kl_to_base(base_logits: torch.Tensor, draft_logits: torch.Tensor, weight: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Mean over rows of KL(p_base || p_draft) (forward KL, the self-distillation target of Wu et al. 2024
    sec. 3.3; the teacher is detached). Logits [..., V]; computed in fp32. `weight` [...] (bool or float):
    rows to count (padding excluded); the mean is over the counted rows."""
    kl = kl_rows(base_logits, draft_logits)
    if weight is None:
        return kl.mean()
    w = weight.to(kl.dtype)
    return (kl * w).sum() / w.sum().clamp_min(1.0)


def split_batch(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A training batch is tokens [B, T] or (tokens, mask [B, T] of real, non-padding tokens); both are
    returned on `device`."""
    if isinstance(batch, (tuple, list)):
        tokens, mask = batch
        return tokens.to(device), mask.to(device)
    return batch.to(device), None


def topk_lists(logits: torch.Tensor, need: Sequence[int], vocab: torch.Tensor | None = None) -> list[list[int]]:
    """Per-depth candidate lists: the need[d] most likely tokens of logits[d] (one host sync). With a draft
    vocabulary (draft_vocab.py), logits are over its tokens (or are restricted to them first) and the
    indices are mapped back to token ids."""
    if len(need) == 0:
        return []
    kmax = max(need)
    if vocab is not None and logits.shape[-1] != vocab.numel():
        logits = restrict_logits(logits, vocab)
    idx = to_token_ids(logits[:len(need)].topk(min(kmax, logits.shape[-1]), -1).indices, vocab).tolist()
    return [row[:k] for row, k in zip(idx, need)]


def candidate_counts(tree: DraftTree, topk_per_depth: Sequence[int] | None) -> list[int]:
    """Candidates to return per depth: what the tree needs, or more if the drafter was configured so."""
    given = list(topk_per_depth or [])
    return [max(need, given[d] if d < len(given) else 0) for d, need in enumerate(tree.ranks_per_depth)]


def placeholder_candidates(need: Sequence[int], vocab_size: int) -> list[list[int]]:
    """Candidates for a round with no anchor hidden state (a 1-token prompt's first round): any tokens do,
    verification simply rejects them."""
    return [[r % vocab_size for r in range(k)] for k in need]


def _check_layer(model: Transformer, layer: int, what: str) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= model.cfg.n_layers:
        raise ValueError(f"{what} must be an int in [0, {model.cfg.n_layers}] for this model, got {layer!r}")


def model_device(model: Transformer) -> torch.device:
    """Where the base model lives (draft modules follow it; they keep their own dtype, see apply_linear)."""
    return model.tok_embeddings.weight.device


# =========================================================================== draft network on the cache
def run_blocks_cached(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      start: int, extra_mask: torch.Tensor | None, run: Callable[[int], bool], n_blocks: int,
                      skip: bool = False) -> torch.Tensor:
    """Embed tokens [1, M] and run blocks l < n_blocks with run(l) True over the KV cache; returns the
    residual [1, M, d] after block n_blocks - 1 (skipped blocks pass it through).

    The M rows are written at cache slots start..start+M-1 (already reserved) of every block that runs.
    Gated bases: routers at every first-half block (run or not), mirrored gates in the second half,
    multiply-by-gate with key bias ln(max(g, eps)) (module docstring); with `skip`, rows whose gate is 0 do
    not run the block at all (real skipping, generate.CachedStep).
    """
    h = model.embed(tokens, positions)
    cos, sin = model.rope_cos[positions][:, None], model.rope_sin[positions][:, None]
    M = tokens.shape[1]
    query_slots = torch.arange(start, start + M, device=h.device)[None]
    step = CachedStep(cache, start, query_slots, cos, sin, skip=skip, extra_mask=extra_mask,
                      position_bias=model.pos_bias, gate_mode=model.cfg.gate_attention)
    return model.run_blocks(h, step, stop=n_blocks, run=run)


def draft_tree_autoregressive(ctx: DraftContext, step: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor],
                                                                torch.Tensor], vocab: torch.Tensor | None = None,
                               root_logits: torch.Tensor | None = None) -> Draft:
    """Fill ctx.tree level by level with an autoregressive draft network (module docstring).

    step(tokens [1, M], positions [1, M], start_slot, extra_mask [1, 1, M, S]) -> logits [M, V] runs one
    level whose rows sit at the (reserved) slots start_slot..start_slot+M-1. With a draft vocabulary the
    logits are over its tokens and candidates are mapped back to token ids. `root_logits` [1, V]: the root
    row was already run, as the cache's last row (EAGLE runs it in the call that commits the context), so
    level 0 is not run again and the nodes attend to that slot.
    """
    tree, cache = ctx.tree, ctx.cache
    n = len(tree)
    if n == 0:
        return Draft(node_tokens=torch.zeros(0, dtype=torch.long))
    dev = cache.pos.device
    s0 = cache.length
    root_pos = len(ctx.tokens) - 1
    first = s0 - 1 if root_logits is not None else s0  # the root's slot
    mask = tree.verify_mask(first, dev)  # [1, 1, n+1, first+n+1]; row 0 = root, row i+1 = node i
    depth = tree.depth.tolist()
    parent = tree.parent.tolist()
    ranks = [p[-1] for p in tree.paths]
    node_tok = [0] * n
    # rows (root-included numbering) of each level; BFS order makes each level a contiguous range
    levels: list[list[int]] = [[0]] + [[i + 1 for i in range(n) if depth[i] == d] for d in range(1, tree.max_depth)]
    dense_layers = list(cache.dense_layers)  # slots < s0 are never written here, so truncating restores them
    cache.reserve(first + n + 1 - s0)
    try:
        for d, rows in enumerate(levels):
            if not rows:
                break
            a, b = rows[0], rows[-1] + 1
            if d == 0 and root_logits is not None:
                logits = root_logits
            else:
                toks = [int(ctx.tokens[-1])] if d == 0 else [node_tok[r - 1] for r in rows]
                tok_t = torch.tensor([toks], device=dev)
                pos_t = torch.full((1, len(rows)), root_pos + d, device=dev, dtype=torch.long)
                logits = step(tok_t, pos_t, first + a, mask[:, :, a:b])  # [M, V]
            kids = [i for i in range(n) if depth[i] == d + 1]
            if not kids:
                continue
            kmax = max(ranks[i] for i in kids) + 1
            k = min(kmax, logits.shape[-1])
            fast = kernels.topk(logits, k)  # one C pass where it applies (torch.topk: 40-78 us a level here)
            top = to_token_ids(fast[1] if fast is not None else logits.topk(k, -1).indices, vocab).tolist()
            for i in kids:
                row = parent[i] + 1  # root-included numbering of the parent
                node_tok[i] = top[row - a][ranks[i]]
    finally:
        cache.truncate(s0)
        cache.dense_layers = dense_layers  # a gated draft's key biases and skipped slots are gone with its slots
    return Draft(node_tokens=torch.tensor(node_tok, dtype=torch.long))


# ================================================================================================ Medusa
class MedusaHeads(nn.Module):
    """k Medusa heads sharing the base LM head (Cai et al. 2024, sec. 2.1.1); see the module docstring."""

    KIND = "medusa"

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        if k < 1:
            raise ValueError(f"need at least one Medusa head, got k={k}")
        self.dim, self.k = dim, k
        self.heads = nn.ModuleList([nn.Linear(dim, dim) for _ in range(k)])
        for lin in self.heads:  # zero init: an untrained head reproduces the base next-token prediction
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def config(self) -> dict[str, Any]:
        return {"dim": self.dim, "k": self.k}

    def logits(self, model: Transformer, hidden: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """hidden [..., d]: final residual (before the last norm). Returns [..., k, V] (all heads) or
        [..., V] (one head); V is the draft vocabulary's size when the heads have one (draft_vocab.py)."""
        x = model.norm(hidden)
        heads = range(self.k) if head is None else [head]
        outs = [head_logits(self, model, x + F.silu(apply_linear(self.heads[i], x))) for i in heads]
        return torch.stack(outs, -2) if head is None else outs[0]


class MedusaDrafter:
    """Per-depth top-k candidates from Medusa heads on ctx.hidden[-1] (head i -> depth i + 1)."""

    static_step = True  # reads ctx.hidden only

    def __init__(self, model: Transformer, heads: MedusaHeads, topk_per_depth: Sequence[int] | None = None) -> None:
        if heads.dim != model.cfg.dim:
            raise ValueError(f"Medusa heads of dim {heads.dim} for a model of dim {model.cfg.dim}")
        self.model, self.heads = model, heads.to(model_device(model))
        self.topk_per_depth = None if topk_per_depth is None else [int(k) for k in topk_per_depth]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> list[list[int]]:
        tree = ctx.tree
        if tree.max_depth > self.heads.k:
            raise ValueError(f"the tree has depth {tree.max_depth} but there are only {self.heads.k} Medusa heads")
        need = candidate_counts(tree, self.topk_per_depth)
        if ctx.hidden.shape[0] == 0:
            return placeholder_candidates(need, self.model.cfg.vocab_size)
        logits = self.heads.logits(self.model, ctx.hidden[-1])  # [k, V]
        return topk_lists(logits, need, draft_vocab(self.heads))


# ============================================================================================ early exit
class EarlyExitHead(nn.Module):
    """LMHead(norm(A h^(layer))) with A (d x d) initialised to the identity."""

    KIND = "early_exit"

    def __init__(self, dim: int, layer: int) -> None:
        super().__init__()
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        self.dim, self.layer = dim, layer
        self.proj = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(dim))

    def config(self) -> dict[str, Any]:
        return {"dim": self.dim, "layer": self.layer}

    def logits(self, model: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d]: the residual entering block `layer`. Returns [..., V] (V: the draft vocabulary's
        size when the head has one)."""
        return head_logits(self, model, model.norm(apply_linear(self.proj, hidden)))


class EarlyExitDrafter:
    """Self-speculative early exit: the lower `head.layer` blocks + the exit head draft autoregressively
    (module docstring, "Autoregressive tree drafting")."""

    def __init__(self, model: Transformer, head: EarlyExitHead) -> None:
        _check_layer(model, head.layer, "the exit layer")
        if head.dim != model.cfg.dim:
            raise ValueError(f"exit head of dim {head.dim} for a model of dim {model.cfg.dim}")
        self.model, self.head = model, head.to(model_device(model))

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, start: int, extra: torch.Tensor,
              cache: KVCache) -> torch.Tensor:
        h = run_blocks_cached(self.model, tokens, positions, cache, start, extra, lambda _: True, self.head.layer)
        return self.head.logits(self.model, h)[0]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        return draft_tree_autoregressive(ctx, lambda t, p, s, m: self._step(t, p, s, m, ctx.cache),
                                         draft_vocab(self.head))


# ============================================================================================ layer skip
class LayerSkipDrafter:
    """Draft & Verify self-speculation (Zhang et al. 2023): the base model with `skip_span` blocks passed
    through drafts autoregressively. skip_span: any collection of block indices (e.g. range(2, 6)).
    `real_skip`: a gated drafting model's rows whose gate is 0 do not run their blocks (run_blocks_cached's
    `skip`); skip_gates.GatedDrafter drafts this way with the gated twin of the base."""

    real_skip = False

    def __init__(self, model: Transformer, skip_span: Sequence[int] | range = ()) -> None:
        span = sorted(set(int(i) for i in skip_span))
        for i in span:
            if not 0 <= i < model.cfg.n_layers:
                raise ValueError(f"skipped block {i} not in [0, {model.cfg.n_layers})")
        if len(span) == model.cfg.n_layers:
            raise ValueError("skipping every block leaves a bigram model of the embeddings; keep at least one")
        self.model = model
        self.skip_span = frozenset(span)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        model = self.model

        def step(tokens: torch.Tensor, positions: torch.Tensor, start: int, extra: torch.Tensor) -> torch.Tensor:
            h = run_blocks_cached(model, tokens, positions, ctx.cache, start, extra,
                                  lambda layer: layer not in self.skip_span, model.cfg.n_layers, skip=self.real_skip)
            return lm_logits(model, h)[0]

        return draft_tree_autoregressive(ctx, step)


# ====================================================================================== training shared
class FrozenBase:
    """Context manager: base model in eval mode with requires_grad False; restores both on exit."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def __enter__(self) -> Transformer:
        self.training = self.model.training
        self.flags = [(p, p.requires_grad) for p in self.model.parameters()]
        self.model.eval()
        for p, _ in self.flags:
            p.requires_grad_(False)
        return self.model

    def __exit__(self, *exc: object) -> None:
        for p, flag in self.flags:
            p.requires_grad_(flag)
        self.model.train(self.training)


def batch_stream(batches: Any) -> Any:
    """Cycle over a re-iterable collection of LongTensor batches [B, T] (a one-shot iterator is used once)."""
    while True:
        got = False
        for b in batches:
            got = True
            yield b
        if not got:
            raise ValueError("no (more) batches: give a list of [B, T] token tensors, or enough of them")


def base_states(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [B, T, V], residual entering each block + final residual) of the frozen base, no grad."""
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
    return out.logits, out.hidden_states


@torch.no_grad()
def lower_states(model: Transformer, tokens: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """{l: the residual entering block l [B, T, d]} of a dense base (causal attention, no cache; l = L is the
    final residual before the norm), running the blocks up to the deepest l only: what a drafter reading
    those blocks can cache, since the frozen blocks below never change."""
    if model.routers is not None:
        raise ValueError("lower_states: gated bases need their gates from every lower block; run the full forward")
    T = tokens.shape[1]
    cap: dict[int, torch.Tensor | None] = dict.fromkeys(int(layer) for layer in layers)
    model.run_blocks(model.embed(tokens), model.causal(T), stop=max(cap), capture=cap)
    return {layer: h for layer, h in cap.items()}


def medusa_loss(model: Transformer, heads: MedusaHeads, tokens: torch.Tensor,
                states: tuple[torch.Tensor, list[torch.Tensor]] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[float]]:
    """sum_i KL(p_base(. | position t+1+i) || p_head_i(. | h_t)) averaged over anchors t with t+1+i < T.

    Head i predicts token t+2+i, which the base predicts at position t+1+i: the same target as hidden-
    transfer step i+1 at anchor t, so the two are trained on identical (anchor, target) pairs.
    """
    logits, hs = states if states is not None else base_states(model, tokens)
    logits = teacher_logits(logits, heads)
    T = tokens.shape[1]
    total, per = logits.new_zeros((), dtype=torch.float32), []
    for i in range(heads.k):
        A = T - 1 - i
        if A <= 0:
            break
        h, t, valid = gather_counted(hs[-1][:, :A], logits[:, 1 + i:], None if mask is None else mask[:, 1 + i:])
        kl = kl_to_base(t, heads.logits(model, h, i), valid)  # the target position must count
        total = total + kl
        per.append(float(kl.detach()))
    return total, per


def gather_counted(x: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keep only the rows a loss counts (valid [B, A] True) before they pay for the LM head and the KL:
    (x [n, d], teacher [n, V], None). Without a mask, or when no row counts (the weighted mean is then 0
    and still has a graph), everything is returned as it is."""
    if valid is None or not bool(valid.any()):
        return x, teacher, valid
    return x[valid], teacher[valid], None


def early_exit_loss(model: Transformer, head: EarlyExitHead, tokens: torch.Tensor,
                    states: tuple[torch.Tensor, list[torch.Tensor]] | None = None, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, list[float]]:
    """KL(p_base(. | t) || p_exit(. | h^(layer)_t)) averaged over all positions t (the next-token target
    the exit head drafts with, autoregressively)."""
    logits, hs = states if states is not None else base_states(model, tokens)
    h, t, valid = gather_counted(hs[head.layer], teacher_logits(logits, head), mask)
    kl = kl_to_base(t, head.logits(model, h), valid)
    return kl, [float(kl.detach())]


def optimise(params: list[nn.Parameter], loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, list[float]]],
             stream: Any, steps: int, lr: float, clip: float = 1.0,
             log: Callable[[int, float, list[float]], None] | None = None) -> list[dict[str, Any]]:
    """Adam on `params` for `steps` steps of loss_fn(batch); returns [{'loss', 'per_step'}] per step."""
    opt = torch.optim.Adam(params, lr=lr)
    hist: list[dict[str, Any]] = []
    for s in range(steps):
        batch = next(stream)
        with torch.enable_grad():
            loss, per = loss_fn(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        value = float(loss.detach())
        hist.append({"loss": value, "per_step": per})
        if log is not None:
            log(s, value, per)
    return hist


def train_medusa(model: Transformer, heads: MedusaHeads, batches: Any, steps: int, lr: float = 1e-3, *,
                 clip: float = 1.0, log: Callable[[int, float, list[float]], None] | None = None
                 ) -> list[dict[str, Any]]:
    """Train the Medusa heads with `medusa_loss` (self-distillation to the frozen base; Medusa-1 with the
    KL target of Wu et al. 2024 sec. 3.3 for a like-for-like comparison)."""
    heads.to(model_device(model)).train()
    with FrozenBase(model):
        dev = model_device(model)

        def loss_fn(b: Any) -> tuple[torch.Tensor, list[float]]:
            tokens, mask = split_batch(b, dev)
            return medusa_loss(model, heads, tokens, mask=mask)

        return optimise(list(heads.parameters()), loss_fn, batch_stream(batches), steps, lr, clip, log)


def train_early_exit(model: Transformer, head: EarlyExitHead, batches: Any, steps: int, lr: float = 1e-3, *,
                     clip: float = 1.0, log: Callable[[int, float, list[float]], None] | None = None
                     ) -> list[dict[str, Any]]:
    """Train the exit map A with `early_exit_loss` (KL to the base's own next-token distribution)."""
    _check_layer(model, head.layer, "the exit layer")
    head.to(model_device(model)).train()
    with FrozenBase(model):
        dev = model_device(model)

        def loss_fn(b: Any) -> tuple[torch.Tensor, list[float]]:
            tokens, mask = split_batch(b, dev)
            return early_exit_loss(model, head, tokens, mask=mask)

        return optimise(list(head.parameters()), loss_fn, batch_stream(batches), steps, lr, clip, log)


# ============================================================================================ save / load
class DraftMismatchError(ValueError):
    """A draft file that does not belong to the given base model (or is not a draft file)."""


_PROBE = 64


def base_signature(model: Transformer, name: str | None = None) -> dict[str, Any]:
    """What identifies the base a draft module was trained for: dimensions, an optional name, and 64
    evenly spaced entries of the LM head (cheap; robust to a dtype change, different for other weights)."""
    cfg = model.cfg
    head = model.output  # an nn.Linear, or a compressed head (q8) that carries its weight as codes
    w = (head.weight if isinstance(head, nn.Linear) else head.dequantized()).detach().reshape(-1)
    # float64: float32 rounds the last index of a 28M-entry head (SmolLM2) past the end
    idx = torch.linspace(0, w.numel() - 1, _PROBE, dtype=torch.float64).round().long().to(w.device)
    return {"name": name, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size, "gating": bool(cfg.gating),
            "norm_placement": cfg.norm_placement, "probe": [float(x) for x in w[idx].float().cpu()]}


def check_base(saved: dict[str, Any], model: Transformer, name: str | None = None, where: str = "") -> None:
    """Raise DraftMismatchError unless `saved` (a base_signature) describes `model`."""
    now = base_signature(model, name)
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "gating", "norm_placement"):
        if saved.get(key) != now[key]:
            raise DraftMismatchError(f"{where}: draft trained for a base with {key}={saved.get(key)!r}, "
                                     f"this model has {key}={now[key]!r}")
    if name is not None and saved.get("name") is not None and saved["name"] != name:
        raise DraftMismatchError(f"{where}: draft trained for base {saved['name']!r}, not {name!r}")
    try:
        a, b = torch.tensor(saved["probe"], dtype=torch.float32), torch.tensor(now["probe"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DraftMismatchError(f"{where}: the draft's base signature has no valid 'probe' ({e!r})") from None
    # 2% of the largest probe value: far above bf16 rounding (0.4%), far below the gap between two models
    if a.shape != b.shape or not bool(((a - b).abs() <= 0.02 * a.abs().max().clamp_min(1e-12)).all()):
        raise DraftMismatchError(f"{where}: the LM-head weights differ from the base this draft was trained "
                                 "for (same shape, different model)")


def _kinds() -> dict[str, type[nn.Module]]:
    from .eagle import EagleHead  # import here: eagle and hidden_transfer import this module
    from .hidden_transfer import HiddenTransfer
    from .skip_gates import SkipGates

    return {MedusaHeads.KIND: MedusaHeads, EarlyExitHead.KIND: EarlyExitHead, HiddenTransfer.KIND: HiddenTransfer,
            EagleHead.KIND: EagleHead, SkipGates.KIND: SkipGates}


def save_draft(path: str | Path, module: nn.Module, meta: dict[str, Any] | None = None, *, base: Transformer,
               base_name: str | None = None) -> Path:
    """Write `path/draft.safetensors` + `path/draft.json` (atomically each); returns the directory."""
    kinds = _kinds()
    kind = getattr(module, "KIND", None)
    if kind not in kinds or not isinstance(module, kinds[kind]):
        raise ValueError(f"not a draft module: {type(module).__name__}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    doc = {"format": DRAFT_FORMAT, "kind": kind, "config": module.config(),
           "base": base_signature(base, base_name), "meta": meta or {}}
    json.dumps(doc)  # fail before writing anything if meta is not JSON-serialisable
    atomic_write_bytes(out / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp)))
    # the weights file's checksum, verified on load (a damaged or replaced file is refused, named)
    doc["weights_sha256"] = file_sha256(out / WEIGHTS_NAME)
    atomic_write_bytes(out / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=2)))
    return out


def load_draft(path: str | Path, base: Transformer | None = None, base_name: str | None = None
               ) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a saved draft module; returns (module, meta). With `base`, refuse (DraftMismatchError) a
    file written for another base model. The module is placed on the base's device."""
    p = Path(path)
    cfg_path, w_path = p / CONFIG_NAME, p / WEIGHTS_NAME
    if not cfg_path.is_file() or not w_path.is_file():
        raise DraftMismatchError(f"{p}: not a draft directory (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        doc = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftMismatchError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != DRAFT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise DraftMismatchError(f"{cfg_path}: format {found!r}, expected {DRAFT_FORMAT!r}")
    kinds = _kinds()
    if not isinstance(doc.get("kind"), str) or doc["kind"] not in kinds:
        raise DraftMismatchError(f"{cfg_path}: unknown draft kind {doc.get('kind')!r}")
    for key in ("base", "config", "meta"):
        if not isinstance(doc.get(key, {} if key == "meta" else None), dict):
            raise DraftMismatchError(f"{cfg_path}: {key!r} is missing or not a JSON object")
    if base is not None:
        check_base(doc["base"], base, base_name, str(p))
    try:
        module = kinds[doc["kind"]](**doc["config"])
    except (TypeError, ValueError) as e:
        raise DraftMismatchError(f"{cfg_path}: invalid {doc['kind']} config ({e})") from e
    want = doc.get("weights_sha256")
    if want is not None and file_sha256(w_path) != want:
        raise DraftMismatchError(f"{w_path}: its bytes do not match the checksum in {CONFIG_NAME} (the file is "
                                 "damaged or was replaced)")
    try:
        state = load_file(str(w_path))
    except Exception as e:  # SafetensorError: truncated file, bad header, random bytes ...
        raise DraftMismatchError(f"{w_path}: corrupt or truncated safetensors file ({type(e).__name__}: {e})") from e
    bad = nonfinite_tensors(state)
    if bad:
        raise DraftMismatchError(f"{w_path}: non-finite weights (NaN or inf) in {bad[:5]}: the file is corrupt")
    if "vocab" in state:  # a draft vocabulary (draft_vocab.py): the buffer takes the saved size first
        try:
            set_draft_vocab(module, state["vocab"])
        except ValueError as e:
            raise DraftMismatchError(f"{w_path}: invalid draft vocabulary ({e})") from e
        if base is not None and state["vocab"].numel() and int(state["vocab"].max()) >= base.cfg.vocab_size:
            raise DraftMismatchError(f"{w_path}: draft vocabulary has token ids beyond the base's "
                                     f"{base.cfg.vocab_size}")
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise DraftMismatchError(f"{w_path}: weights do not match {CONFIG_NAME} "
                                 f"({' '.join(str(e).split())})") from e
    if missing or unexpected:
        raise DraftMismatchError(f"{w_path}: weights do not match the config (missing {missing}, "
                                 f"unexpected {unexpected})")
    if base is not None:
        module.to(model_device(base))
    return module, doc.get("meta", {})


def heldout_accuracies(meta: dict[str, Any], where: str = "") -> list[list[float]] | None:
    """A draft's held-out per-depth, per-rank accuracies (meta["heldout"]["acc"], what sizes its trees), or None
    when it has none. Damaged ones (another type or shape, values outside [0, 1]) are refused by name, as a
    DraftMismatchError, rather than failing inside the tree builder."""
    held = meta.get("heldout") if isinstance(meta, dict) else None
    acc = held.get("acc") if isinstance(held, dict) else None
    if acc is None:
        return None
    ok = isinstance(acc, list) and acc and all(
        isinstance(row, list) and row and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                              and 0.0 <= a <= 1.0 for a in row) for row in acc)
    if not ok:
        raise DraftMismatchError(f"{where}: its held-out accuracies (meta.heldout.acc in {CONFIG_NAME}) are damaged: "
                                 "expected a list per depth of per-rank numbers in [0, 1]")
    return [[float(a) for a in row] for row in acc]


def load_drafter(path: str | Path, model: Transformer, base_name: str | None = None, **kw: Any
                 ) -> tuple[Any, nn.Module, dict[str, Any]]:
    """(drafter, module, meta) for a saved draft directory (refused if written for another base). `kw` go to
    the drafter (e.g. fused=False for hidden transfer)."""
    from .eagle import EagleDrafter, EagleHead
    from .hidden_transfer import HiddenTransfer, HiddenTransferDrafter
    from .skip_gates import GatedDrafter, SkipGates

    module, meta = load_draft(path, model, base_name)
    module.eval()
    if isinstance(module, HiddenTransfer):
        return HiddenTransferDrafter(model, module, **kw), module, meta
    if isinstance(module, EagleHead):
        return EagleDrafter(model, module, **kw), module, meta
    if isinstance(module, MedusaHeads):
        return MedusaDrafter(model, module, **kw), module, meta
    if isinstance(module, SkipGates):
        return GatedDrafter(model, module, **kw), module, meta
    return EarlyExitDrafter(model, module, **kw), module, meta


__all__ = ["MedusaHeads", "MedusaDrafter", "EarlyExitHead", "EarlyExitDrafter", "LayerSkipDrafter",
           "train_medusa", "train_early_exit", "medusa_loss", "early_exit_loss", "kl_to_base",
           "save_draft", "load_draft", "DraftMismatchError", "base_signature", "run_blocks_cached",
           "draft_tree_autoregressive", "load_drafter", "lower_states"]

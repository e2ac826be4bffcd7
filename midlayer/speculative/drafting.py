"""The parts every drafter shares: reading the base's hidden states, the autoregressive tree fill, top-k
candidates, and the training helpers (a frozen base, batches, the KL to the base, one optimiser loop).

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
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from midlayer.engine.draft_vocab import restrict_logits, to_token_ids, vocab_topk
from midlayer.engine.generate import CachedStep
from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer
from midlayer.ops import kernels
from .protocol import Draft, DraftContext
from .tree import DraftTree
from midlayer.train.evaluate import kl_rows


def apply_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x) computed in the draft module's dtype, returned in x's dtype (a bf16 base keeps fp32 drafts)."""
    return linear(x.to(linear.weight.dtype)).to(x.dtype)


def lm_logits(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    """The base model's own decoding of a residual: LMHead(norm(h))."""
    return model.output(model.norm(h))


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
    idx = to_token_ids(vocab_topk(logits[:len(need)], kmax)[1], vocab).tolist()
    return [row[:k] for row, k in zip(idx, need)]


def candidate_counts(tree: DraftTree, topk_per_depth: Sequence[int] | None) -> list[int]:
    """Candidates to return per depth: what the tree needs, or more if the drafter was configured so."""
    given = list(topk_per_depth or [])
    return [max(need, given[d] if d < len(given) else 0) for d, need in enumerate(tree.ranks_per_depth)]


def placeholder_candidates(need: Sequence[int], vocab_size: int) -> list[list[int]]:
    """Candidates for a round with no anchor hidden state (a 1-token prompt's first round): any tokens do,
    verification simply rejects them."""
    return [[r % vocab_size for r in range(k)] for k in need]


def check_layer(model: Transformer, layer: int, what: str) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= model.cfg.n_layers:
        raise ValueError(f"{what} must be an int in [0, {model.cfg.n_layers}] for this model, got {layer!r}")


def model_device(model: Transformer) -> torch.device:
    """Where the base model lives (draft modules follow it; they keep their own dtype, see apply_linear)."""
    return model.tok_embeddings.weight.device


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
    # the rows' positions at their slots: windowed blocks mask keys by position (kv_cache.LayerView), and a
    # scratch slot holds whatever position an earlier round left there
    cache.pos[:, start:start + M] = positions
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
    node_tok = [0] * n
    levels = tree.levels()  # per depth: its nodes (a contiguous range), their parents among the depth above, ranks
    dense_layers = list(cache.dense_layers)  # slots < s0 are never written here, so truncating restores them
    cache.reserve(first + n + 1 - s0)
    try:
        for d, (ka, kb, parent, rank) in enumerate(levels):  # level d runs (d = 0: the root); it fills depth d + 1
            a, b = (0, 1) if d == 0 else (levels[d - 1][0] + 1, levels[d - 1][1] + 1)  # its rows (root: row 0)
            if d == 0 and root_logits is not None:
                logits = root_logits
            else:
                toks = [int(ctx.tokens[-1])] if d == 0 else node_tok[a - 1:b - 1]
                tok_t = torch.tensor([toks], device=dev)
                pos_t = torch.full((1, b - a), root_pos + d, device=dev, dtype=torch.long)
                logits = step(tok_t, pos_t, first + a, mask[:, :, a:b])  # [M, V]
            k = min(max(rank) + 1, logits.shape[-1])
            fast = kernels.topk(logits, k)  # one C pass where it applies (torch.topk: 40-78 us a level here)
            top = to_token_ids(fast[1] if fast is not None else vocab_topk(logits, k)[1], vocab).tolist()
            for i, p, r in zip(range(ka, kb), parent, rank):
                node_tok[i] = top[p][r]
    finally:
        cache.truncate(s0)
        cache.dense_layers = dense_layers  # a gated draft's key biases and skipped slots are gone with its slots
    return Draft(node_tokens=torch.tensor(node_tok, dtype=torch.long))


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


def gather_counted(x: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keep only the rows a loss counts (valid [B, A] True) before they pay for the LM head and the KL:
    (x [n, d], teacher [n, V], None). Without a mask, or when no row counts (the weighted mean is then 0
    and still has a graph), everything is returned as it is."""
    if valid is None or not bool(valid.any()):
        return x, teacher, valid
    return x[valid], teacher[valid], None


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

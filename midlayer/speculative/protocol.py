"""The interface between the speculative loop and its drafters: what a drafter sees each round
(`DraftContext`), what it returns (`Draft`), and what it declares (`Drafter`, `FusedDrafter`).

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

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer
from .tree import DraftTree

# One forward of a round, for the cost model (tree_cost.py): (rows through each block, rows through the LM head)
# or (..., share of the head those rows read: |draft vocabulary| / V).
Forward = tuple  # tuple[list[int], int] | tuple[list[int], int, float]


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
    """What the speculative loops (`verify.speculative_generate`, `static.static_speculative_generate`) and the
    cost model (`tree_cost.round_forwards`) see of a drafter. Subclass it to inherit the defaults below and
    implement `propose`; the loops read these members directly, with no probing.

    - `propose(ctx)`: per-depth top-k lists or a `Draft`, once per round before verification.
    - `hidden_layers`: the blocks whose input residual the drafter needs in `ctx.layer_hidden` (n_layers: the
      final residual).
    - `prefill_features`: the first round's `ctx.hidden` holds every prompt row, not only the last.
    - `static_step`: the drafter reads only ctx.tokens, ctx.hidden, ctx.logits and ctx.tree, never ctx.cache,
      so it also drafts for the static decode step (engine/decode_step.py), whose cache is not a KVCache; or
      it declares `reads_cache` too and drafts there on the device only (its `device_draft`).
    - `reads_cache`: `propose` runs the base model on ctx.cache (the self-speculative drafters: early exit,
      layer skip); with `static_step` the static step's rounds draft through the step's own blocks instead
      (speculative/static.py, `LevelTreeDraft`), never through `propose`.
    - `fused`: None for a drafter without a fused pass; True / False for one that has it (hidden transfer):
      when True it also implements `FusedDrafter` and its next draft rides the verification forward.
    - `dynamic_k`: an EAGLE-2 style expansion width, None where the drafter has none (part of the cost key).
    - `anchors`: the tree rows a round carries hidden transfer's pseudo rows for (its fused pass), 0: every
      row (part of the cost key, and of a step's device rounds).
    - `draft_steps()`: the depth it drafts at most (k heads or steps), None if unbounded.
    - `verify_forward(tree, n_layers)` and `draft_forwards(tree, n_layers)`: the forwards one round runs, as
      the cost model's `Forward` tuples (rows per block, head rows[, share of the head read]): the
      verification forward, then the drafter's own.
    """

    hidden_layers: tuple[int, ...] = ()
    prefill_features: bool = False
    static_step: bool = False
    reads_cache: bool = False
    fused: bool | None = None
    dynamic_k: int | None = None
    anchors: int = 0

    def propose(self, ctx: DraftContext) -> Sequence[Sequence[int]] | Draft: ...

    def draft_steps(self) -> int | None:
        return None

    def verify_forward(self, tree: DraftTree, n_layers: int) -> Forward:
        n = len(tree) + 1  # root + nodes, through every block and the head
        return ([n] * n_layers, n)

    def draft_forwards(self, tree: DraftTree, n_layers: int) -> list[Forward]:
        return []

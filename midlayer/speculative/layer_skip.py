"""Layer skipping (Draft & Verify): a drafter of SPEC section 6's comparison.

`LayerSkipDrafter(model, skip_span)` (Zhang et al. 2023, "Draft & Verify", self-speculative decoding):
the base model with a set of blocks skipped (residual passed through unchanged) drafts autoregressively.
Nothing to train. With an empty span it *is* the base model, an oracle under greedy decoding.
"""

from __future__ import annotations

from typing import Sequence

import torch

from midlayer.engine.batch import DraftPass
from midlayer.model.transformer import Transformer
from .drafting import draft_tree_autoregressive, lm_logits, run_blocks_cached
from .protocol import Draft, DraftContext, Drafter, Forward
from .static import LevelTreeDraft
from .tree import DraftTree


class LayerSkipDrafter(Drafter):
    """Draft & Verify self-speculation (Zhang et al. 2023): the base model with `skip_span` blocks passed
    through drafts autoregressively. skip_span: any collection of block indices (e.g. range(2, 6)).
    `real_skip`: a gated drafting model's rows whose gate is 0 do not run their blocks (run_blocks_cached's
    `skip`); skip_gates.GatedDrafter drafts this way with the gated twin of the base. On the static step it
    drafts through the step's own blocks, in device rounds (`device_draft`)."""

    real_skip = False
    static_step = True
    reads_cache = True

    def __init__(self, model: Transformer, skip_span: Sequence[int] | range = ()) -> None:
        span = sorted(set(int(i) for i in skip_span))
        for i in span:
            if not 0 <= i < model.cfg.n_layers:
                raise ValueError(f"skipped block {i} not in [0, {model.cfg.n_layers})")
        if len(span) == model.cfg.n_layers:
            raise ValueError("skipping every block leaves a bigram model of the embeddings; keep at least one")
        self.model = model
        self.skip_span = frozenset(span)

    def draft_forwards(self, tree: DraftTree, n_layers: int) -> list[Forward]:
        """One forward per level of the tree through the blocks outside the skipped span."""
        return [([0 if b in self.skip_span else r for b in range(n_layers)], r) for r in tree.level_sizes()]

    def draft_pass(self) -> DraftPass:
        """Its drafting in a continuous batch (engine/batch.py): every block outside the span, the base's head."""
        model = self.model
        return DraftPass(model, lambda layer: layer not in self.skip_span, model.cfg.n_layers, self.real_skip,
                         lambda h: lm_logits(model, h))

    def device_draft(self, step, tree: DraftTree) -> LevelTreeDraft | None:
        """Its draft on the static step: the blocks outside the span and the base's head, level by level through
        the step's own cache (speculative/static.py). None for a drafter that drafts with another model (the
        gated twin)."""
        model = self.model
        if step.model is not model:
            return None
        return LevelTreeDraft(step, tree, model.cfg.n_layers, lambda layer: layer not in self.skip_span,
                              lambda h: lm_logits(model, h), None)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        model = self.model

        def step(tokens: torch.Tensor, positions: torch.Tensor, start: int, extra: torch.Tensor) -> torch.Tensor:
            h = run_blocks_cached(model, tokens, positions, ctx.cache, start, extra,
                                  lambda layer: layer not in self.skip_span, model.cfg.n_layers, skip=self.real_skip)
            return lm_logits(model, h)[0]

        return draft_tree_autoregressive(ctx, step)

"""Self-speculative early exit: a drafter of SPEC section 6's comparison.

`EarlyExitHead(dim, layer)`: logits = LMHead(norm(A h^(layer))) with h^(layer) the residual entering
block `layer` and A a trainable d x d map initialised to the identity (so layer == n_layers gives the
base model exactly). `EarlyExitDrafter` is the self-speculative early-exit drafter: it runs the base
model's lower `layer` blocks *autoregressively on its own guesses* (it does not stop at one token, as
the single-step early-exit probe of Wu et al. 2024 sec. 4.4 does; for a comparison at equal tree size
every drafter has to fill a whole tree). See "Autoregressive tree drafting" below.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from midlayer.engine.draft_vocab import draft_vocab, head_logits, teacher_logits
from midlayer.engine.batch import DraftPass
from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer
from .drafting import (apply_linear, base_states, batch_stream, check_layer, draft_tree_autoregressive, FrozenBase,
                       gather_counted, kl_to_base, model_device, optimise, run_blocks_cached, split_batch)
from .protocol import Draft, DraftContext, Drafter, Forward
from .static import LevelTreeDraft
from .tree import DraftTree
from .tree_cost import head_share


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


class EarlyExitDrafter(Drafter):
    """Self-speculative early exit: the lower `head.layer` blocks + the exit head draft autoregressively
    (module docstring, "Autoregressive tree drafting"). On the static step it drafts through the step's own
    blocks, in device rounds (`device_draft`)."""

    static_step = True
    reads_cache = True

    def __init__(self, model: Transformer, head: EarlyExitHead) -> None:
        check_layer(model, head.layer, "the exit layer")
        if head.dim != model.cfg.dim:
            raise ValueError(f"exit head of dim {head.dim} for a model of dim {model.cfg.dim}")
        self.model, self.head = model, head.to(model_device(model))

    def draft_forwards(self, tree: DraftTree, n_layers: int) -> list[Forward]:
        """One partial forward per level of the tree through the lower `layer` blocks and the exit head."""
        ell, share = self.head.layer, head_share(self.head, self.model.cfg.vocab_size)
        return [([r if b < ell else 0 for b in range(n_layers)], r, share) for r in tree.level_sizes()]

    def draft_pass(self) -> DraftPass:
        """Its drafting in a continuous batch (engine/batch.py): blocks below the exit layer, the exit head."""
        return DraftPass(self.model, None, self.head.layer, False, lambda h: self.head.logits(self.model, h),
                         draft_vocab(self.head))

    def device_draft(self, step, tree: DraftTree) -> LevelTreeDraft | None:
        """Its draft on the static step: the blocks below the exit layer and the exit head, level by level through
        the step's own cache (speculative/static.py)."""
        if step.model is not self.model:
            return None
        return LevelTreeDraft(step, tree, self.head.layer, None, lambda h: self.head.logits(self.model, h),
                              draft_vocab(self.head))

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, start: int, extra: torch.Tensor,
              cache: KVCache) -> torch.Tensor:
        h = run_blocks_cached(self.model, tokens, positions, cache, start, extra, lambda _: True, self.head.layer)
        return self.head.logits(self.model, h)[0]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        return draft_tree_autoregressive(ctx, lambda t, p, s, m: self._step(t, p, s, m, ctx.cache),
                                         draft_vocab(self.head))


def early_exit_loss(model: Transformer, head: EarlyExitHead, tokens: torch.Tensor,
                    states: tuple[torch.Tensor, list[torch.Tensor]] | None = None, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, list[float]]:
    """KL(p_base(. | t) || p_exit(. | h^(layer)_t)) averaged over all positions t (the next-token target
    the exit head drafts with, autoregressively)."""
    logits, hs = states if states is not None else base_states(model, tokens)
    h, t, valid = gather_counted(hs[head.layer], teacher_logits(logits, head), mask)
    kl = kl_to_base(t, head.logits(model, h), valid)
    return kl, [float(kl.detach())]


def train_early_exit(model: Transformer, head: EarlyExitHead, batches: Any, steps: int, lr: float = 1e-3, *,
                     clip: float = 1.0, log: Callable[[int, float, list[float]], None] | None = None
                     ) -> list[dict[str, Any]]:
    """Train the exit map A with `early_exit_loss` (KL to the base's own next-token distribution)."""
    check_layer(model, head.layer, "the exit layer")
    head.to(model_device(model)).train()
    with FrozenBase(model):
        dev = model_device(model)

        def loss_fn(b: Any) -> tuple[torch.Tensor, list[float]]:
            tokens, mask = split_batch(b, dev)
            return early_exit_loss(model, head, tokens, mask=mask)

        return optimise(list(head.parameters()), loss_fn, batch_stream(batches), steps, lr, clip, log)

"""Medusa heads (Cai et al. 2024): a drafter of SPEC section 6's comparison.

`MedusaHeads(dim, k)` (Cai et al. 2024, "Medusa", sec. 2.1.1): head i (0-based) maps the last hidden
state h_t of position t to a distribution over token t + 2 + i:
    x = norm(h_t),   y_i = x + SiLU(W_i x + b_i),   logits_i = LMHead(y_i).
Medusa-1 initialises each head's output projection to the base LM head and W_i to zero; here the output
projection IS the frozen base LM head (shared), and W_i, b_i are zero-initialised, so an untrained head
predicts exactly the base model's next-token distribution at t (which is the best guess available
without training). `MedusaDrafter` reads `ctx.hidden[-1]` (position len(tokens) - 2): head i then
predicts the token at position len(tokens) + i, i.e. depth i + 1 of the tree.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from midlayer.engine.draft_vocab import draft_vocab, head_logits, teacher_logits, to_token_ids
from midlayer.model.transformer import Transformer
from .drafting import (apply_linear, base_states, batch_stream, candidate_counts, FrozenBase, gather_counted,
                       kl_to_base, model_device, optimise, placeholder_candidates, split_batch, topk_lists)
from .protocol import DraftContext, Drafter, Forward
from .static import last_accepted, TopkTreeDraft
from .tree import DraftTree
from .tree_cost import head_share


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

    def logits(self, model: Transformer, hidden: torch.Tensor, head: int | None = None, depth: int | None = None
               ) -> torch.Tensor:
        """hidden [..., d]: final residual (before the last norm). Returns [..., depth, V] (the first `depth`
        heads, all k by default: a tree of depth D needs heads 0..D-1 only) or [..., V] (head `head`); V is
        the draft vocabulary's size when the heads have one (draft_vocab.py)."""
        if depth is not None and (head is not None or not 0 < depth <= self.k):
            raise ValueError(f"heads asked of {self.k} Medusa heads: head={head}, depth={depth} (one, within k)")
        x = model.norm(hidden)
        heads = range(self.k if depth is None else depth) if head is None else [head]
        outs = [head_logits(self, model, x + F.silu(apply_linear(self.heads[i], x))) for i in heads]
        return torch.stack(outs, -2) if head is None else outs[0]


class MedusaDrafter(Drafter):
    """Per-depth top-k candidates from Medusa heads on ctx.hidden[-1] (head i -> depth i + 1)."""

    static_step = True  # reads ctx.hidden only
    keeps_rows = False  # in a continuous batch (its RowDrafter): it reads each row's last state, keeps no rows

    def __init__(self, model: Transformer, heads: MedusaHeads, topk_per_depth: Sequence[int] | None = None) -> None:
        if heads.dim != model.cfg.dim:
            raise ValueError(f"Medusa heads of dim {heads.dim} for a model of dim {model.cfg.dim}")
        self.model, self.heads = model, heads.to(model_device(model))
        self.topk_per_depth = None if topk_per_depth is None else [int(k) for k in topk_per_depth]

    def draft_steps(self) -> int:
        return self.heads.k

    def draft_forwards(self, tree: DraftTree, n_layers: int) -> list[Forward]:
        """The tree's depth in heads over the last row, each through the LM head (its draft vocabulary's share):
        `propose` and the device draft run heads 0..D-1 only."""
        return [([0] * n_layers, tree.max_depth, head_share(self.heads, self.model.cfg.vocab_size))]

    def device_draft(self, step, tree: DraftTree) -> TopkTreeDraft | None:
        """The heads' draft on the device, for the static step's device rounds (speculative/static.py): the heads
        read the last accepted row's residual, which the round leaves on the device."""
        if not 0 < tree.max_depth <= self.heads.k:
            return None
        return TopkTreeDraft(step, tree, candidate_counts(tree, self.topk_per_depth), draft_vocab(self.heads),
                             lambda h: self.heads.logits(self.model, h, depth=tree.max_depth),
                             lambda packed, rows, hidden, draft: (last_accepted(packed, rows, hidden),),
                             lambda tokens, hidden, draft_logits: (hidden[-1],) if hidden.shape[0] else None)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> list[list[int]]:
        tree = ctx.tree
        if tree.max_depth > self.heads.k:
            raise ValueError(f"the tree has depth {tree.max_depth} but there are only {self.heads.k} Medusa heads")
        need = candidate_counts(tree, self.topk_per_depth)
        if ctx.hidden.shape[0] == 0 or not need:
            return placeholder_candidates(need, self.model.cfg.vocab_size)
        logits = self.heads.logits(self.model, ctx.hidden[-1], depth=tree.max_depth)  # [D, V]
        return topk_lists(logits, need, draft_vocab(self.heads))

    # -------------------------------------------------------------------- in a continuous batch (`RowDrafter`)
    @torch.no_grad()
    def chains(self, rows: list[int], starts: list[int], hidden: list[torch.Tensor], tokens: list[list[int]],
               k: int) -> list[list[int]]:
        """Greedy chains of k tokens for many sequences at once (a continuous batch, engine/batch.py's
        `RowDrafter`): each row's last state hidden[i][-1] is the final residual at the position that predicted
        its pending token; head i's top-1 is the chain's token i + 1. The heads keep no state of their own."""
        if not 0 < k <= self.heads.k:
            raise ValueError(f"a chain of {k} tokens from {self.heads.k} Medusa heads")
        if not rows:
            return []
        logits = self.heads.logits(self.model, torch.stack([h[-1] for h in hidden]), depth=k)  # [n, k, V]
        return to_token_ids(teacher_logits(logits, self.heads).argmax(-1), draft_vocab(self.heads)).tolist()

    def move(self, src: int, dst: int, length: int) -> None:
        """(No state per row: nothing to move.)"""

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """(No state per row: nothing to swap.)"""


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

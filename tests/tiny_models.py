"""The tiny random models the engine, speculative and drafter tests share."""

from __future__ import annotations

import torch

from midlayer.config import ModelConfig
from midlayer.model import Transformer


def make_tiny(dims: dict, gating: bool, seed: int = 0, sparse: bool = True, **over) -> Transformer:
    """A tiny random `Transformer` in eval mode. Gated with `sparse`: routers strong enough that many tokens
    reach S >= 1 (gate exactly 0, so real skipping removes their compute and K/V) at various blocks while
    others keep fractional gates -- every code path of real skipping is exercised."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**dims, "gating": gating, **over})).eval()
    if gating and sparse:
        with torch.no_grad():
            for i, r in enumerate(model.routers):
                r.weight.normal_(0, 0.4)
                r.bias.fill_(0.1 * i)
    return model


class NoisyOracle:
    """A drafter that knows the greedy continuation `reference` (prompt + output): each depth's rank-0
    candidate is right with probability 0.7, else the true token sits at rank 1 (so acceptance takes other
    branches than the first) or nowhere. Partial acceptance at every depth, which neither an oracle (all) nor
    random drafts (none) exercise. Reads ctx.tokens and ctx.tree only, so it drafts for the static step too."""

    static_step = True

    def __init__(self, reference: list[int], vocab_size: int, seed: int = 0) -> None:
        self.reference, self.vocab_size = reference, vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, ctx) -> list[list[int]]:
        out, V = [], self.vocab_size
        for d in range(1, ctx.tree.max_depth + 1):
            i = len(ctx.tokens) - 1 + d
            true = self.reference[i] if i < len(self.reference) else 0
            u = float(torch.rand((), generator=self.gen))
            first = true if u < 0.7 else (true + 1) % V
            second = true if 0.7 <= u < 0.85 else (true + 2) % V
            out.append([first, second, (true + 3) % V][:ctx.tree.ranks_per_depth[d - 1]])
        return out

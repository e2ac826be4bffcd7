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

"""The tiny random models the engine, speculative and drafter tests share, the drafters made for tests
(an oracle, a noisy oracle, random drafts), and a benchmark script loaded as a module: test code, kept out of
the library (issue 44)."""

from __future__ import annotations

from typing import Sequence

import torch

from midlayer.config import ModelConfig
from midlayer.model.transformer import Transformer
from midlayer.speculative.protocol import Draft, DraftContext
from midlayer.speculative.protocol import Drafter


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


class NoisyOracle(Drafter):
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


class OracleDrafter(Drafter):
    """Knows the true continuation `reference` (prompt + greedy output): rank 0 of every depth is the true
    token, other ranks are junk ((true + r) % V, never the true token). Accepts everything under greedy."""

    static_step = True

    def __init__(self, reference: Sequence[int], vocab_size: int) -> None:
        self.reference = [int(t) for t in reference]
        self.vocab_size = vocab_size

    def propose(self, ctx: DraftContext) -> list[list[int]]:
        out = []
        for d in range(1, ctx.tree.max_depth + 1):
            i = len(ctx.tokens) - 1 + d
            true = self.reference[i] if i < len(self.reference) else 0
            out.append([(true + r) % self.vocab_size for r in range(ctx.tree.ranks_per_depth[d - 1])])
        return out


class RandomDrafter(Drafter):
    """Wrong on purpose: uniformly random candidates from its own seeded generator. With `with_q` (chains
    only) it samples each token from a fixed random distribution q and reports q (tests the q path)."""

    static_step = True

    def __init__(self, vocab_size: int, seed: int = 0, with_q: bool = False) -> None:
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.with_q = with_q
        # A peaked, fixed q: a bad proposal on purpose (unrelated to the base model).
        self.q = torch.softmax(3.0 * torch.randn(vocab_size, generator=self.gen, dtype=torch.float64), -1)

    def propose(self, ctx: DraftContext) -> list[list[int]] | Draft:
        if self.with_q:
            n = len(ctx.tree)
            toks = (torch.multinomial(self.q, n, replacement=True, generator=self.gen) if n
                    else torch.zeros(0, dtype=torch.long))
            return Draft(node_tokens=toks, q=self.q.expand(n, -1))
        return [torch.randint(0, self.vocab_size, (k,), generator=self.gen).tolist() for k in ctx.tree.ranks_per_depth]


def assert_drafts_lossless(model: Transformer, step, prompt: list[int], ref: list[int]):
    """Speculative decoding on the static `step` (speculative/static.py) with a noisy oracle (rounds that
    accept part of a branch, so the compaction moves rows) and random drafts (rounds that accept nothing) on a
    small branching tree gives `ref`, plain decoding's tokens, exactly. Returns the random drafter's stats
    (its rounds mostly commit one token each)."""
    from midlayer.speculative.static import static_speculative_generate
    from midlayer.speculative.tree import DraftTree

    V = model.cfg.vocab_size
    tree = DraftTree.greedy_from_accuracies([[0.6, 0.2], [0.5]], 6)
    for drafter in (NoisyOracle(prompt + ref, V), RandomDrafter(V, 0)):
        out, stats = static_speculative_generate(model, prompt, drafter, tree, len(ref), step=step)
        assert out == ref, type(drafter).__name__
    return stats


def noisy_transfer(dim: int, layers: list[int], masked: bool, seed: int = 0):
    """Hidden transfer's maps (arXiv 2404.12022) joining at `layers`: identity plus noise, so that pseudo states
    are not copies and every part of the fused pass's mask matters."""
    from midlayer.speculative.hidden_transfer import HiddenTransfer

    ht = HiddenTransfer(dim, layers, masked=masked)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in ht.maps:
            m.weight.add_(0.3 * torch.randn(dim, dim, generator=g))
    return ht


def device_drafters(model: Transformer) -> dict:
    """One drafter of each kind that drafts on the device (speculative/static.py), for a 3-block `model`:
    EAGLE-2 and EAGLE on a static tree (a perturbed head: drafts that are neither all right nor all wrong),
    Medusa (one head trained-like), hidden transfer's fused pass (joining at blocks 1, 2 and 3), early exit at
    block 2 (a perturbed exit map) and layer skip without block 1."""
    from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
    from midlayer.speculative.eagle import EagleDrafter, EagleHead
    from midlayer.speculative.hidden_transfer import HiddenTransferDrafter
    from midlayer.speculative.layer_skip import LayerSkipDrafter
    from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads

    dim = model.cfg.dim
    torch.manual_seed(0)
    eagle = EagleHead.for_model(model)
    with torch.no_grad():
        for p in eagle.parameters():
            p.add_(0.05 * torch.randn_like(p))
    heads = MedusaHeads(dim, 3)
    torch.nn.init.normal_(heads.heads[0].weight, std=0.1)
    exit_head = EarlyExitHead(dim, 2)
    with torch.no_grad():
        exit_head.proj.weight.add_(0.05 * torch.randn(dim, dim))
    return {"eagle-2": EagleDrafter(model, eagle, dynamic_k=3), "eagle": EagleDrafter(model, eagle),
            "medusa": MedusaDrafter(model, heads),
            "hidden-transfer": HiddenTransferDrafter(model, noisy_transfer(dim, [1, 2, 3], False)),
            "early-exit": EarlyExitDrafter(model, exit_head), "layer-skip": LayerSkipDrafter(model, [1])}


class RowWiseBLAS:
    """A stand-in BLAS that gives every row of a product the bits it has alone, whatever the row count M: F.linear
    and torch.bmm computed one row at a time (each a fresh contiguous one-row product). Why: the probe's verdicts
    depend on the machine's BLAS. An AMD EPYC's MKL (AVX2) gave the tiny models' rows the same bits from 8 rows
    up, and an AVX-512 Xeon's does not: there the FFN's down projection rounds a row one way at 2..8 rows and
    another from 16 up, and the probe chooses larger buckets. Tests of the probe's logic and of a step on given
    buckets install this, so that they hold on every machine; tests of the real BLAS take the probe's own
    choice. `install` patches torch.nn.functional.linear and torch.bmm (through pytest's monkeypatch: undone
    after the test). lone_row: a linear of one row rounds an ulp otherwise (up), as every CPU's fp32 GEMV seen
    here does against its GEMM of 8 rows. from_rows: so does a linear of that many rows or more, as an AVX-512
    Xeon's MKL gave SmolLM2's fp32 rows one set of bits at 2..8 rows and another from 16 (issue 42)."""

    def __init__(self, lone_row: bool = False, from_rows: int | None = None) -> None:
        self._linear, self._bmm = torch.nn.functional.linear, torch.bmm
        self.lone_row, self.from_rows = lone_row, from_rows

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if torch._C._is_torch_function_mode_enabled():  # a mode (RowLinears) sees this stand-in as F.linear
            return torch.overrides.handle_torch_function(torch.nn.functional.linear, (x, w), x, w, b)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([self._linear(rows[i:i + 1].contiguous(), w, b) for i in range(rows.shape[0])])
        M = rows.shape[0]
        nudged = self.lone_row and M == 1 or self.from_rows is not None and M >= self.from_rows
        if nudged and out.dtype == torch.float32:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out.view(*x.shape[:-1], w.shape[0])

    def bmm(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r = torch.cat([self._bmm(a[:, i:i + 1].contiguous(), b) for i in range(a.shape[1])], 1)
        return r if out is None else out.copy_(r)

    def install(self, monkeypatch) -> "RowWiseBLAS":
        monkeypatch.setattr(torch.nn.functional, "linear", self.linear)
        monkeypatch.setattr(torch, "bmm", self.bmm)
        return self


def benchmark(name: str):
    """benchmarks/<name>.py loaded as a module (the scripts are not a package), for the tests of its functions."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

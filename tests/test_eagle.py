"""EAGLE drafter (midlayer/speculative/eagle.py): lossless speculative decoding with a wrong (random) head, drafts equal to the
teacher-forced pass, oracles that accept every draft (and fail when shifted), training, save/load, train-draft
with resume. Tiny models only; run with OMP_NUM_THREADS=1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from midlayer.speculative.draft_training import DraftTrainConfig, train_draft
from midlayer.speculative.registry import DraftMismatchError, load_draft, load_drafter, save_draft
from midlayer.speculative.eagle import EagleDrafter, EagleHead, eagle_forward, eagle_loss, feature_logits, train_eagle
from midlayer.engine.generate import GenerationConfig, generate
from midlayer.model.transformer import Transformer
from midlayer.speculative.protocol import Draft, DraftContext
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from test_drafters import synthetic, trained_base  # noqa: F401 (trained_base is a fixture used below)
from test_draft_training import tiny_base, tiny_data
from tiny_models import make_tiny
from midlayer.speculative.protocol import Drafter

V = 64
D = 32
TINY = dict(dim=D, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=48, multiple_of=16)
SMALL_TREE = DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
TREES = {"chain3": DraftTree.chain(3), "tree6": SMALL_TREE}
MODELS = {g: make_tiny(TINY, g) for g in (False, True)}
PROMPT = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1)).tolist()


def greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], GenerationConfig(max_new_tokens=n))[0]


def random_head(model: Transformer, seed: int = 0, scale: float = 0.3) -> EagleHead:
    """An untrained head with every weight perturbed: wrong drafts, and every part of the layer matters."""
    head = EagleHead.for_model(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return head


def raw_features(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """The base's final residual (before the final norm) at every position, [1, T, d]: eagle_forward's input."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1]


def features(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """EAGLE's features, the normalised final residual norm(h) [1, T, d]: what the head predicts."""
    with torch.no_grad():
        return model.norm(raw_features(model, tokens))


# ============================================================================================ the module
def test_untrained_head_is_the_identity_on_the_feature():
    """fc = [I | 0] and zero output projections: fhat_{t+1} = f_t exactly, so an untrained head re-uses the
    base's own next-token prediction (like an untrained Medusa head)."""
    for gating in (False, True):
        model = MODELS[gating]
        head = EagleHead.for_model(model)
        assert head.config() == {"dim": D, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": model.cfg.ffn_hidden_dim,
                                 "norm_eps": 1e-5, "norm_placement": model.cfg.norm_placement, "qkv_bias": False}
        f = features(model, PROMPT)
        with torch.no_grad():
            fhat = eagle_forward(model, head, torch.tensor([PROMPT]), raw_features(model, PROMPT), n_steps=3)
        assert torch.equal(fhat[0], f[:, :-1])
        assert [x.shape[1] for x in fhat] == [8, 7, 6]
        assert torch.equal(fhat[1], f[:, :-2]) and torch.equal(fhat[2], f[:, :-3])  # copies of the copy
    with pytest.raises(ValueError, match="head_dim"):
        EagleDrafter(MODELS[False], EagleHead(D, 8, 2, 64))


# ============================================================================================ lossless
@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("gating", [False, True])
def test_eagle_is_lossless_with_a_wrong_head(gating, tree_name):
    model = MODELS[gating]
    drafter = EagleDrafter(model, random_head(model))
    out, stats = speculative_generate(model, PROMPT, drafter, TREES[tree_name], 20)
    assert out == greedy(model, PROMPT, 20)
    assert stats.new_tokens == 20 and sum(stats.accept_hist) == stats.base_forwards


@pytest.mark.parametrize("gating", [False, True])
def test_edge_cases_and_reuse_across_generations(gating):
    model = MODELS[gating]
    drafter = EagleDrafter(model, random_head(model, seed=3))
    one = PROMPT[:1]  # no feature in the first round: placeholder drafts
    assert speculative_generate(model, one, drafter, SMALL_TREE, 10)[0] == greedy(model, one, 10)
    long_prompt = (PROMPT * 5)[:40]  # the context end: trees pruned, positions up to max_seq_len - 1
    assert speculative_generate(model, long_prompt, drafter, SMALL_TREE, 30)[0] == greedy(model, long_prompt, 30)
    out, _ = speculative_generate(model, PROMPT, drafter, SMALL_TREE, 12, temperature=1.0, seed=0)
    assert len(out) == 12 and all(0 <= t < V for t in out)
    # One drafter over several generations (the benchmark's use): its kept state is checked against the
    # tokens every round, so it drafts as a fresh drafter does -- also for a prompt sharing a prefix.
    for prompt in (PROMPT, PROMPT[:5] + [7, 7, 1], PROMPT):
        fresh = EagleDrafter(model, drafter.head)
        a, sa = speculative_generate(model, prompt, drafter, SMALL_TREE, 16)
        b, sb = speculative_generate(model, prompt, fresh, SMALL_TREE, 16)
        assert a == b == greedy(model, prompt, 16) and sa.accept_hist == sb.accept_hist


# =============================================================== inference == the teacher-forced pass
@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("gating", [False, True])
def test_drafts_equal_the_teacher_forced_pass(gating, tree_name):
    """Every row the drafter runs (root and inner nodes, through its KV cache and the tree mask) gives the
    logits that `eagle_forward` gives for the same path with the last cached position as anchor: the
    context rows, the chaining of predicted features and the tree attention are one computation."""
    model = MODELS[gating]
    inner = EagleDrafter(model, random_head(model, seed=1))
    errs: list[float] = []

    class Checking(Drafter):
        def propose(self, ctx: DraftContext):
            draft = inner.propose(ctx)
            if not isinstance(draft, Draft) or inner.last_logits is None:
                return draft
            tree, toks = ctx.tree, draft.node_tokens.tolist()
            p = len(ctx.tokens) - 1
            for row in range(inner.last_logits.shape[0]):  # root-included numbering; leaves are never run
                path, node = [], row - 1
                while node >= 0:
                    path.insert(0, toks[node])
                    node = int(tree.parent[node])
                seq = ctx.tokens + path
                with torch.no_grad():
                    fhat = eagle_forward(model, inner.head, torch.tensor([seq]), raw_features(model, seq), len(path) + 1)
                ref = feature_logits(model, fhat[-1][0, p - 1])  # depth len(path) + 1 of anchor p - 1
                errs.append(float((inner.last_logits[row] - ref).abs().max()))
            return draft

    out, stats = speculative_generate(model, PROMPT, Checking(), TREES[tree_name], 20)
    assert out == greedy(model, PROMPT, 20)
    assert len(errs) >= 3 * (stats.base_forwards - 2)
    # gated: verification skips tokens for real (skipped keys -inf instead of ln(1e-6) in the full forward)
    assert max(errs) < (1e-5 if not gating else 1e-4), max(errs)


# ================================================================================================ oracles
class OracleFeatures(EagleDrafter):
    """The head replaced by the truth: a row (f, e_x) at position pos predicts the base's feature at pos on
    the reference sequence (prompt + greedy output) when x is the reference token there, else garbage.
    `shift` = 1 returns the feature one position early: the same oracle with an off-by-one, which must fail."""

    def __init__(self, model: Transformer, reference: list[int], shift: int = 0) -> None:
        super().__init__(model, EagleHead.for_model(model))
        self.ref, self.ref_feats, self.shift = reference, features(model, reference)[0], shift

    def _run(self, feats, tokens, positions, start, extra):
        out = torch.zeros(1, tokens.shape[1], self.model.cfg.dim)
        for j, (tok, pos) in enumerate(zip(tokens[0].tolist(), positions[0].tolist())):
            if pos < len(self.ref) and tok == self.ref[pos]:
                out[0, j] = self.ref_feats[pos - self.shift]
        return out


@pytest.mark.parametrize("gating", [False, True])
def test_oracle_features_accept_every_draft(gating):
    """With the true next feature, the drafter's decoding (final norm + LM head, ranks, node tokens and
    positions of every level) drafts exactly the base's greedy path: every round accepts the whole depth.
    Shifting the oracle by one position drafts the wrong tokens, so the check can fail."""
    model = MODELS[gating]
    n = 20
    ref = PROMPT + greedy(model, PROMPT, n + 4)
    for tree in (DraftTree.chain(3), SMALL_TREE):
        out, stats = speculative_generate(model, PROMPT, OracleFeatures(model, ref), tree, n)
        assert out == ref[len(PROMPT):len(PROMPT) + n]
        assert stats.accept_hist[tree.max_depth] == stats.base_forwards == n // (tree.max_depth + 1)
        out, stats = speculative_generate(model, PROMPT, OracleFeatures(model, ref, shift=1), tree, n)
        assert out == ref[len(PROMPT):len(PROMPT) + n]
        assert stats.accept_hist[0] >= 0.6 * stats.base_forwards and stats.tau < 1.5


@pytest.mark.parametrize("gating", [False, True])
def test_real_head_is_an_oracle_on_a_bigram_base(gating):
    """A base whose blocks add nothing (and, here, no final norm) has the feature f_t = e_t (the normalised
    embedding of token t). The real head with fc = [0 | I] (and its zero-initialised layer) then predicts fhat_{t+1} = e_{t+1} = f_{t+1}
    exactly, through the real KV-cache path: every draft is accepted. The untrained head (fc = [I | 0],
    fhat_{t+1} = f_t) repeats the pending token's prediction and is rejected almost always."""
    model = make_tiny(TINY, gating, seed=4)
    model.norm = torch.nn.Identity()  # so that the feature norm(h_t) is e_t exactly (h_t = e_t below)
    with torch.no_grad():
        for block in model.layers:
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
    f = features(model, PROMPT)
    assert torch.allclose(f, model.emb_norm(model.tok_embeddings(torch.tensor([PROMPT]))).detach())
    oracle = EagleHead.for_model(model)
    with torch.no_grad():
        oracle.fc.weight.zero_()
        oracle.fc.weight[:, D:].copy_(torch.eye(D))
    ref = greedy(model, PROMPT, 20)
    assert all(a != b for a, b in zip(ref, ref[1:]))  # no fixed point, where repeating the last token is right
    for tree in (DraftTree.chain(3), SMALL_TREE):
        out, stats = speculative_generate(model, PROMPT, EagleDrafter(model, oracle), tree, 20)
        assert out == ref and stats.accept_hist[tree.max_depth] == stats.base_forwards == 5
        out, stats = speculative_generate(model, PROMPT, EagleDrafter(model, EagleHead.for_model(model)), tree, 20)
        assert out == ref and stats.tau < 1.5


# ================================================================================================ training
def test_training_reduces_both_terms_and_drafts_better(trained_base):  # noqa: F811 (the fixture)
    model = trained_base
    batches = list(synthetic(16 * 10, seed=2).split(16))
    held = synthetic(32, seed=3)

    def depth1_acc(head: EagleHead) -> float:
        with torch.no_grad():
            logits = model(held, output_hidden_states=True)
            fhat = eagle_forward(model, head, held, logits.hidden_states[-1])[0]
            return float((feature_logits(model, fhat).argmax(-1) == logits.logits[:, 1:].argmax(-1)).float().mean())

    head = EagleHead.for_model(model)
    before = eagle_loss(model, head, held)[1]
    acc_before = depth1_acc(head)
    flags = [p.requires_grad for p in model.parameters()]
    hist = train_eagle(model, head, batches, 40, lr=3e-3)
    after = eagle_loss(model, head, held)[1]
    assert len(hist) == 40 and all(a < 0.7 * b for a, b in zip(after, before)), (before, after)  # KL and SmoothL1
    assert depth1_acc(head) > acc_before + 0.2, (acc_before, depth1_acc(head))
    assert [p.requires_grad for p in model.parameters()] == flags and not model.training  # base restored
    prompt = synthetic(1, T=8, seed=4)[0].tolist()
    ref = greedy(model, prompt, 24)
    out, stats = speculative_generate(model, prompt, EagleDrafter(model, head), DraftTree.chain(3), 24)
    out0, stats0 = speculative_generate(model, prompt, EagleDrafter(model, EagleHead.for_model(model)),
                                        DraftTree.chain(3), 24)
    assert out == ref == out0 and stats.tau > stats0.tau + 0.5, (stats.tau, stats0.tau)


def test_save_load_roundtrip(tmp_path):
    model = MODELS[True]
    head = random_head(model, seed=2)
    path = save_draft(tmp_path / "eagle", head, {"steps": 3}, base=model, base_name="tiny")
    loaded, meta = load_draft(path, model, base_name="tiny")
    assert type(loaded) is EagleHead and loaded.config() == head.config() and meta == {"steps": 3}
    assert list(loaded.state_dict()) == list(head.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    drafter, module, _ = load_drafter(path, model)
    assert isinstance(drafter, EagleDrafter) and module is drafter.head
    a = speculative_generate(model, PROMPT, EagleDrafter(model, head), SMALL_TREE, 12)[1]
    b = speculative_generate(model, PROMPT, drafter, SMALL_TREE, 12)[1]
    assert a.accept_hist == b.accept_hist
    with pytest.raises(DraftMismatchError, match="gating"):
        load_draft(path, MODELS[False])


def test_padding_does_not_change_the_loss():
    base = tiny_base()
    head = random_head(base, scale=0.1)
    x = torch.randint(1, 48, (1, 12))
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 12, dtype=torch.bool), torch.zeros(1, 5, dtype=torch.bool)], 1)
    with torch.no_grad():
        a, pa = eagle_loss(base, head, x)
        b, pb = eagle_loss(base, head, padded, mask=mask)
    assert abs(float(a) - float(b)) < 1e-5 and all(abs(u - v) < 1e-5 for u, v in zip(pa, pb))


# =========================================================================================== train-draft
def eagle_cfg(out, **kw) -> DraftTrainConfig:
    return DraftTrainConfig(method="eagle", out_dir=str(out), epochs=kw.pop("epochs", 6), lr=kw.pop("lr", 1e-2),
                            batch_tokens=64, seq_len=32, bf16=False, ckpt_every=5, **kw)


def test_train_draft_eagle_lowers_loss_saves_and_scores(tmp_path):
    import json

    base, data = tiny_base(), tiny_data()
    run = train_draft(eagle_cfg(tmp_path / "e"), base, data, progress=False, log=lambda s: None)
    losses = [h["loss"] for h in run.history]
    assert losses[-1] < 0.7 * losses[0]
    m = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert len(m["acc"]) == 3 and all(len(a) == 4 for a in m["acc"])  # k = 3 depths x 4 ranks
    assert all(0 <= x <= 1 for a in m["acc"] for x in a) and m["top1"] == [a[0] for a in m["acc"]]
    module, meta = load_draft(tmp_path / "e", base)
    assert isinstance(module, EagleHead) and meta["heldout"]["top1"] == m["top1"]
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), run.module.state_dict().values()))


def test_round_cost_for_auto_trees():
    """`tree_cost` costs an EAGLE round by what it runs: the verification forward, the call that commits
    the context with the root row (one head row), and per deeper level r rows through the one draft layer
    (a block's shape) and the LM head."""
    from midlayer.speculative import tree_cost as tc

    model = MODELS[True]
    drafter = EagleDrafter(model, random_head(model))
    assert SMALL_TREE.level_sizes()[:3] == [1, 2, 3]
    assert tc.round_forwards(drafter, SMALL_TREE, 4) == [([7] * 4, 7), ([1, 0, 0, 0], 1, 1.0),
                                                         ([2, 0, 0, 0], 2, 1.0), ([3, 0, 0, 0], 3, 1.0)]
    costs = tc.RowCosts((1, 8), (10.0, 11.0), (1.0, 1.2), 4)  # rows nearly free: drafting pays
    tree, _ = tc.auto_tree(model, drafter, [[0.9, 0.1], [0.8, 0.1], [0.7, 0.1]], costs)
    assert len(tree) > 0 and tree.max_depth <= 3  # at most the depths the accuracies cover
    out, _ = speculative_generate(model, PROMPT, drafter, tree, 12)
    assert out == greedy(model, PROMPT, 12)


# ============================================================================== EAGLE-2 dynamic trees
@pytest.mark.parametrize("gating", [False, True])
def test_dynamic_trees_are_lossless_and_pick_the_best_scoring_nodes(gating):
    model = MODELS[gating]
    head = random_head(model, seed=5)
    drafter = EagleDrafter(model, head, dynamic_k=2)
    budget = SMALL_TREE  # 6 nodes, depth 3: the round's budget, not its shape
    seen: list[DraftTree] = []

    class Watch(Drafter):
        prefill_features = True

        def propose(self, ctx):
            d = drafter.propose(ctx)
            if len(ctx.tree) == 0:  # the last round of the budget: nothing to draft
                return d
            seen.append(d.tree)
            scores = drafter.last_scores
            best = sorted(scores, key=lambda x: (-scores[x][1], len(x), x))[:len(ctx.tree)]  # the (pruned) budget
            assert set(d.tree.paths) == set(best)  # the top-scoring nodes, prefix-closed (DraftTree checks)
            assert all(scores[x][1] <= scores[x[:-1]][1] for x in best if len(x) > 1)
            assert d.node_tokens.tolist() == [scores[x][0] for x in d.tree.paths]
            # the same tree drafted statically (tested against the teacher-forced pass) gives the same tokens:
            # the multi-row levels of the dynamic pass see what they should (masks, positions, features)
            static = EagleDrafter(model, head).propose(dataclasses.replace(ctx, tree=d.tree))
            assert static.node_tokens.tolist() == d.node_tokens.tolist()
            return d

    out, stats = speculative_generate(model, PROMPT, Watch(), budget, 16)
    assert out == greedy(model, PROMPT, 16)
    assert all(len(t) <= len(budget) and t.max_depth <= budget.max_depth for t in seen)
    assert len({t.paths for t in seen}) > 1  # the shape changes with the drafts


def test_dynamic_with_one_child_per_node_is_the_static_chain():
    model = MODELS[False]
    head = random_head(model, seed=6)
    a, b = EagleDrafter(model, head, dynamic_k=1), EagleDrafter(model, head)
    drafts: dict[str, list] = {"dyn": [], "static": []}

    def rec(name, inner):
        class R(Drafter):
            prefill_features = True

            def propose(self, ctx):
                d = inner.propose(ctx)
                drafts[name].append(d.node_tokens.tolist())
                if name == "dyn" and len(ctx.tree):
                    assert d.tree == ctx.tree  # the (possibly pruned) chain itself
                return d
        return R()

    out_a, _ = speculative_generate(model, PROMPT, rec("dyn", a), DraftTree.chain(3), 16)
    out_b, _ = speculative_generate(model, PROMPT, rec("static", b), DraftTree.chain(3), 16)
    assert out_a == out_b == greedy(model, PROMPT, 16)
    assert drafts["dyn"] == drafts["static"]


def test_a_drafter_tree_over_budget_is_refused():
    model = MODELS[False]

    class Greedy(Drafter):
        def propose(self, ctx):
            return Draft(node_tokens=[0] * 4, tree=DraftTree.chain(4))

    with pytest.raises(ValueError, match="budget"):
        speculative_generate(model, PROMPT, Greedy(), DraftTree.chain(3), 8)


# ======================================================================= draft-layer calls per round
@pytest.mark.parametrize("dynamic_k", [0, 2])
def test_the_root_row_rides_the_call_that_commits_the_context(monkeypatch, dynamic_k):
    """A round runs the draft layer once for the context rows the last round accepted together with this
    round's root row, then once per deeper level (the deepest nodes are never run); the root row is kept
    as context, so the next round commits exactly the tokens that round added, never a row twice."""
    model = MODELS[False]
    drafter = EagleDrafter(model, random_head(model, seed=2), dynamic_k=dynamic_k)
    rows: list[int] = []
    rounds: list[tuple[int, int]] = []  # (root position p, tree depth) per round
    run, propose = EagleDrafter._run, EagleDrafter.propose

    def counting_run(self, feats, tokens, *a):
        rows.append(tokens.shape[1])
        return run(self, feats, tokens, *a)

    def recording_propose(self, ctx):
        rounds.append((len(ctx.tokens) - 1, ctx.tree.max_depth))
        return propose(self, ctx)

    monkeypatch.setattr(EagleDrafter, "_run", counting_run)
    monkeypatch.setattr(EagleDrafter, "propose", recording_propose)
    tree = DraftTree.chain(3)
    out, _ = speculative_generate(model, PROMPT, drafter, tree, 24)
    assert out == greedy(model, PROMPT, 24)
    expected: list[int] = []
    prev = 0
    for p, depth in rounds:
        expected.append(p - prev)  # the context rows since the last round's root, with this round's root
        expected += [dynamic_k or 1] * max(0, depth - 1)
        prev = p
    assert rows == expected and len(rounds) > 5


# ============================================================================== a compressed base
@pytest.mark.parametrize("fmt", ["q4", "bf16"])
def test_beside_a_compressed_base_the_draft_layer_runs_in_its_format(fmt):
    """Beside a base in weight format fmt the drafter runs a copy of its layer in that format (the trained
    head is untouched), its predicted features stay those of the fp32 layer up to the format's rounding,
    and the output is still exactly plain greedy."""
    import copy

    from midlayer.ops import kernels
    from midlayer.engine.quantization import BF16Linear, Q4Linear, Q8Linear, compress_weights

    base = compress_weights(copy.deepcopy(MODELS[False]), fmt).eval()
    head = random_head(MODELS[False], seed=5)
    drafter = EagleDrafter(base, head)
    kind = Q4Linear if fmt == "q4" else BF16Linear
    assert isinstance(drafter.layer.attention.wqkv, kind) and isinstance(drafter.layer.feed_forward.w2, kind)
    if fmt == "q4" and kernels.available():  # the fc in Q8_0 (the q4 format's head format), within its rounding
        assert isinstance(drafter.fc, Q8Linear) and isinstance(head.fc, torch.nn.Linear)
        x = torch.randn(5, 2 * head.dim, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            err = float((drafter.fc(x) - head.fc(x)).norm() / head.fc(x).norm())
        assert 0 < err < 0.02, err
    else:
        assert drafter.fc is head.fc
    assert drafter.layer.attention.row_invariant == (fmt == "q4")  # q4: the C attention kernel, as the base's
    assert isinstance(head.layer.attention.wq, torch.nn.Linear) and head.layer.attention.wqkv is None
    # the two layers on the same rows (a causal pass): equal up to the format's rounding, not equal
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = eagle_forward(base, head, tokens, raw_features(base, PROMPT))[0]
        saved = head.layer
        head.layer = drafter.layer
        try:
            got = eagle_forward(base, head, tokens, raw_features(base, PROMPT))[0]
        finally:
            head.layer = saved
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel < (0.15 if fmt == "q4" else 0.02)  # 4-bit groups vs 8-bit mantissas; a wrong layer gives ~1
    for tree in TREES.values():
        assert speculative_generate(base, PROMPT, drafter, tree, 20)[0] == greedy(base, PROMPT, 20)
    dynamic = EagleDrafter(base, head, dynamic_k=2)  # EAGLE-2's masks through the compressed layer's attention
    assert speculative_generate(base, PROMPT, dynamic, SMALL_TREE, 20)[0] == greedy(base, PROMPT, 20)

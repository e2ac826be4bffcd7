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

SECTIONS: dict[str, type] = {"model": ModelConfig, "sparsity": SparsityConfig, "train": TrainConfig}


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
            help_text = f"default {default!r} (before the preset's overrides)"
            if typ is bool:
                group.add_argument(flag_name(f.name), dest=f"{section}.{f.name}", default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            else:
                group.add_argument(flag_name(f.name), dest=f"{section}.{f.name}", default=None, type=typ,
                                   metavar=typ.__name__.upper(), help=help_text)


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
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import train

    model_cfg, sparsity_cfg, train_cfg = get_preset(args.preset, **overrides_from_args(args))
    result = train(model_cfg, sparsity_cfg, train_cfg, resume=args.resume, device=args.device,
                   progress=not args.no_progress, stop_after=args.stop_after)
    from .distributed import print0
    print0(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import list_checkpoints, load_checkpoint
    from .config import from_dict
    from .data import TokenWindows, resolve_data
    from .evaluate import evaluate
    from .model import Transformer
    from .train import default_cache_dir, resolve_dtype

    path = Path(args.checkpoint)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise ValueError(f"no checkpoints in {path}")
        path = found[-1]
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt = load_checkpoint(path, map_location=dev)
    model_cfg = from_dict(ModelConfig, ckpt["configs"]["model"])
    train_cfg = from_dict(TrainConfig, ckpt["configs"]["train"])
    model = Transformer(model_cfg).to(dev)
    model.load_state_dict(ckpt["model"])
    files = resolve_data(train_cfg.data, default_cache_dir(), train_cfg.tokenizer_vocab, train_cfg.val_data)
    res = evaluate(model, TokenWindows(files.val, train_cfg.seq_len),
                   eval_tokens=train_cfg.eval_tokens if args.eval_tokens is None else args.eval_tokens,
                   batch_size=args.batch_size or train_cfg.micro_batch_size, device=dev,
                   dtype=resolve_dtype(train_cfg.dtype, dev))
    res.update(checkpoint=str(path), step=int(ckpt["step"]))
    text = json.dumps(res, indent=2)
    if args.output:
        Path(args.output).write_text(text)
    print(text)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"train": _cmd_train, "eval": _cmd_eval, "flops": _cmd_flops, "presets": _cmd_presets}[args.command]
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

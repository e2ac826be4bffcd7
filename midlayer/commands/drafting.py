"""`midlayer distill`, `train-draft`, `train-gates`: the draft pipeline (self-distillation data, then drafters
or skip gates trained on a frozen base).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import add_config_flags, check_stop_after, overrides_from_args
from midlayer.speculative import distill as distill_module
from midlayer.speculative.draft_training import check_used, DraftTrainConfig, METHODS, train_drafts
from midlayer.train.distributed import resolve_device




def add_distill(sub: argparse._SubParsersAction) -> None:
    distill_module.build_parser(sub.add_parser("distill", help="self-distillation data for draft training: the "
                                               "base model's own answers to the prompt set (resumable)",
                                               description=distill_module.DESCRIPTION))


def add_train_draft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train a drafter (hidden transfer, Medusa, early exit, EAGLE) on a frozen base "
                                           "by self-distillation (data: midlayer distill)")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a resumable state) after N steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--methods", default=None, metavar="M1,M2,...",
                   help="train these drafters together on the same batches, one base forward per batch shared "
                        "(each to OUT_DIR/<method>); replaces --method")
    p.set_defaults(draft_configs=draft_configs)  # (what --print-config shows: the configs the command trains)
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


def add_train_gates(sub: argparse._SubParsersAction) -> None:
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
    add_config_flags(p, ["draft"], defaults=GATES_DEFAULTS)
    p.set_defaults(draft_configs=lambda args: [gates_config(args)])


def cmd_train_draft(args: argparse.Namespace) -> int:
    cfgs = draft_configs(args)
    if args.export_now and args.stop_after is not None:
        raise ValueError("--export-now trains nothing; --stop-after has no meaning with it")
    train_drafts(cfgs, progress=not args.no_progress, stop_after=args.stop_after,
                 device=resolve_device(args.device), export_now=args.export_now, overwrite=args.overwrite)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    return distill_module.run(args)


def cmd_train_gates(args: argparse.Namespace) -> int:
    check_stop_after(args)
    train_drafts([gates_config(args)], progress=not args.no_progress, stop_after=args.stop_after,
                 device=resolve_device(args.device), overwrite=args.overwrite)
    return 0


GATES_DEFAULTS = {"method": "gates", "out_dir": "runs/gates"}  # train-gates' settings where train-draft's differ


def gates_config(args: argparse.Namespace) -> DraftTrainConfig:
    """The config `train-gates` trains, checked."""
    over = overrides_from_args(args).get("draft", {})
    if over.get("method", "gates") != "gates":
        raise ValueError(f"train-gates trains skip gates; --method {over['method']} belongs to train-draft")
    check_used(over, ["gates"])
    return DraftTrainConfig(**{**GATES_DEFAULTS, **over})


def draft_configs(args: argparse.Namespace) -> list[DraftTrainConfig]:
    """The configs `train-draft` trains (one, or one per --methods entry into OUT_DIR/<method>), checked."""

    check_stop_after(args)
    over = overrides_from_args(args).get("draft", {})
    if args.methods is None:
        if "out_dir" not in over:
            over["out_dir"] = f"runs/draft/{over.get('method', DraftTrainConfig.method)}"
        check_used(over, [over.get("method", DraftTrainConfig.method)])
        return [DraftTrainConfig(**over)]
    if "method" in over:
        raise ValueError("give --methods or --method, not both")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown or len(set(methods)) != len(methods):
        raise ValueError(f"--methods: a comma-separated list of distinct methods among {', '.join(METHODS)}, "
                         f"got {args.methods!r}")
    check_used(over, methods)
    root = Path(over.pop("out_dir", "runs/draft"))
    return [DraftTrainConfig(**over, method=m, out_dir=str(root / m)) for m in methods]

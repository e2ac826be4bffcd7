"""`midlayer train`, `eval`, `flops`, `presets`: training and evaluating our own models.

    midlayer train tiny --steps 300 --mu-final 0.25
    torchrun --nproc_per_node 8 -m midlayer train paper-12l --data 'data/fineweb10B/*.bin'
    midlayer eval runs/tiny
    midlayer flops paper-12l --seq-len 1024
"""

from __future__ import annotations

import argparse
import json

from .options import add_config_flags, check_output, overrides_from_args, write_output
from midlayer.common import cache_dir, json_safe, resolve_dtype
from midlayer.config import get_preset, PRESETS
from midlayer.data.shards import resolve_data, TokenWindows
from midlayer.model.flops import format_breakdown
from midlayer.train.checkpoint import load_model
from midlayer.train.distributed import print0, resolve_device
from midlayer.train.evaluate import evaluate
from midlayer.train.loop import train




def add_train(sub: argparse._SubParsersAction) -> None:
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


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint: validation CE, gate statistics, estimated FLOPs")
    p.add_argument("checkpoint", help="a run directory (its newest checkpoint) or a ckpt_*.pt file")
    p.add_argument("--eval-tokens", type=int, default=None, help="validation tokens (0 = whole split)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per forward")
    p.add_argument("--device", default=None)
    p.add_argument("--output", default=None, help="write the JSON here (default: print only)")


def add_flops(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flops", help="estimated forward FLOPs (paper section 3) for a preset")
    p.add_argument("preset", choices=list(PRESETS))
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--sparsity", default=None,
                   help="per first-half block gate sparsity, comma-separated (e.g. 0,0.1,0.2,0.3,0.4,0.5)")
    add_config_flags(p, ["model"])


def add_presets(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("presets", help="list the named presets")


# the model's gate settings (the sparsity section's are all gates' too): read by a gated model alone
GATE_FIELDS = ("gate_attention", "gate_grad", "gate_values", "gate_eps")


def cmd_train(args: argparse.Namespace) -> int:
    over = overrides_from_args(args)
    model_cfg, sparsity_cfg, train_cfg = get_preset(args.preset, **over)
    if not model_cfg.gating:  # (a dense run took them, trained without them, and recorded them in config.json)
        given = [*over.get("sparsity", {}), *(f for f in over.get("model", {}) if f in GATE_FIELDS)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is a setting of the gates, and this model has none "
                             "(--no-gating, or a dense preset)")
    result = train(model_cfg, sparsity_cfg, train_cfg, resume=args.resume, device=args.device,
                   progress=not args.no_progress, stop_after=args.stop_after)
    print0(json.dumps(json_safe({k: v for k, v in result.items() if not isinstance(v, list)}), indent=2))
    return 0


def check_eval_args(args: argparse.Namespace) -> None:
    """What `eval` checks before reading the checkpoint (ValueError naming the flag)."""

    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.eval_tokens is not None and args.eval_tokens < 0:
        raise ValueError(f"--eval-tokens must be >= 0 (0 = the whole split), got {args.eval_tokens}")
    check_output("--output", args.output, {"checkpoint": args.checkpoint})
    if args.device is not None:
        resolve_device(args.device)


def cmd_eval(args: argparse.Namespace) -> int:
    check_eval_args(args)  # every flag checked before the checkpoint is read: no evaluation run and then lost
    model, ckpt, train_cfg = load_model(args.checkpoint, args.device)
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
    write_output(args.output, text)
    print(text)
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
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


def cmd_presets(args: argparse.Namespace) -> int:
    for name, p in PRESETS.items():
        print(f"{name:16s} model={p.get('model', {})} train={p.get('train', {})}")
    return 0

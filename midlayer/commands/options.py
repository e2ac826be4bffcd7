"""What every command shares: flags generated from the config dataclasses (config.py, the single source of
truth for names, types and defaults; a preset supplies the base values and flags override them), and the
checks of paths and numbers that run before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, Sequence

from midlayer.common import atomic_write
from midlayer.config import ModelConfig, SparsityConfig, TrainConfig
from midlayer.output_lock import refuse_overwrite
from midlayer.speculative.draft_training import DraftTrainConfig



SECTIONS: dict[str, type] = {"model": ModelConfig, "sparsity": SparsityConfig, "train": TrainConfig,
                             "draft": DraftTrainConfig}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser, sections: Sequence[str],
                     defaults: dict[str, Any] | None = None) -> None:
    """One flag per dataclass field. Defaults are None so that only flags given override the preset. `defaults`:
    what this command uses where the field's own default is not it (the help said so: train-gates' method)."""
    for section in sections:
        cls = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group(f"{section} config ({cls.__name__})")
        for f in dataclasses.fields(cls):
            typ = hints[f.name]
            default = (defaults or {}).get(f.name, f.default)
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


def positive(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value}")


def label_dirs(flag: str, spec: str, what: str, reserved: tuple[str, ...] = (), names: tuple[str, ...] = ()
               ) -> dict[str, str]:
    """{label: directory} of a comma-separated LABEL=DIR flag, every entry checked (distinct labels, none
    of `reserved`, existing directories, or one of `names`: drafters that need no directory, e.g. lookup)."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"{flag}: expected LABEL=DIR, got {item!r}")
        if label in out:
            raise ValueError(f"{flag}: label {label!r} given twice")
        if label in reserved:
            raise ValueError(f"{flag}: label {label!r} is taken by a row of its own; choose another")
        if path not in names and not Path(path).is_dir():
            raise ValueError(f"{flag} {label}={path}: no such directory (expected {what})")
        out[label] = path
    return out


def check_stop_after(args: argparse.Namespace) -> None:
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after must be >= 1, got {args.stop_after}")


def check_output(flag: str, path: str | None, inputs: dict[str, str | None] | None = None) -> None:
    """A results file that can be written without overwriting work: checked before the work whose result it
    would hold. Refused: a folder, a missing folder, what `output_lock.refuse_overwrite` refuses (a
    checkpoint's name, a file of a run), and the command's own input files (`inputs`, flag -> path: `bench
    gates --output` on its --data replaced the distillation data with its table)."""
    if path is None:
        return
    p = Path(path)
    for name, given in (inputs or {}).items():
        if given and p.resolve() == Path(given).resolve():
            raise ValueError(f"{flag} {path}: that is the {name} file this command reads; the results would "
                             "overwrite it")
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {p.parent} does not exist")
    refuse_overwrite(flag, path)


def write_output(path: str | None, text: str) -> None:
    """The results file, written whole or not at all (a full disk leaves the earlier file, never a part)."""
    if path:
        atomic_write(Path(path), text.encode("utf-8"))

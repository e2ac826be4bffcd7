"""Config files for every command (issue 45, item 5): `--config FILE` (TOML, or YAML with PyYAML installed)
with the precedence command line > file > preset defaults, and `--print-config` to show the resolved
settings.

A file holds the command's flags by their names (dashes or underscores), and, for the commands whose flags
are generated from the config dataclasses (train, flops, train-draft, train-gates), tables named after the
sections:

    # train.toml                          midlayer train tiny --config train.toml --steps 50
    preset = "tiny"                       # positionals too (the command line's, when given, wins)
    [model]
    n_layers = 8
    [train]
    steps = 300
    lr = 1e-3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from midlayer.commands.options import overrides_from_args
from midlayer.config import get_preset, to_dict
from midlayer.speculative.draft_training import DraftTrainConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def read(path: str) -> dict[str, Any]:
    """A config file's contents as a dict (TOML by default; .yaml / .yml with PyYAML)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = p.read_bytes()
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml  # optional: YAML configs only (TOML needs nothing beyond Python)
        except ImportError:
            raise ValueError(f"--config {path}: YAML needs PyYAML (pip install pyyaml); or write it as TOML") from None
        try:
            data = yaml.safe_load(text.decode("utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    else:
        try:
            data = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--config {path}: not valid TOML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of settings, got {type(data).__name__}")
    return data


def _given(action: argparse.Action, argv: Sequence[str]) -> bool:
    """Whether the command line set this action (by any of its option strings, `--x v` or `--x=v`)."""
    for a in argv:
        if a == "--":
            break
        for opt in action.option_strings:
            if a == opt or a.startswith(opt + "="):
                return True
    return False


def apply(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str], path: str,
          sections: Sequence[str]) -> argparse.Namespace:
    """`args` with the file's values wherever the command line did not set them. Keys: the command's flags (dashes
    or underscores) and, for `sections`, tables of config fields. Unknown keys are refused by name; values go
    through the flag's own type and choices."""
    data = read(path)
    by_dest = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "print_config")}
    # positionals are required on the command line, which wins over the file
    positional_given = {a.dest for a in parser._actions if not a.option_strings and a.dest in by_dest}
    for key, value in data.items():
        name = key.replace("-", "_")
        if isinstance(value, dict):
            if name not in sections:
                raise ValueError(f"--config {path}: [{key}] is not a section of this command"
                                 + (f" (its sections: {', '.join(sections)})" if sections else ""))
            for field, v in value.items():
                dest = f"{name}.{field.replace('-', '_')}"
                if dest not in by_dest:
                    raise ValueError(f"--config {path}: [{key}] has no setting {field!r}")
                _set(parser, args, by_dest[dest], v, argv, path, f"[{key}] {field}")
            continue
        if name not in by_dest:
            raise ValueError(f"--config {path}: {key!r} is not a setting of this command")
        if name in positional_given:
            continue
        _set(parser, args, by_dest[name], value, argv, path, key)
    return args


def _set(parser: argparse.ArgumentParser, args: argparse.Namespace, action: argparse.Action, value: Any,
         argv: Sequence[str], path: str, key: str) -> None:
    """The file's `value` for `action`, unless the command line set it; converted as the flag converts."""
    if _given(action, argv):
        return  # the command line wins
    flag = action.option_strings[-1] if action.option_strings else action.dest
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # switches
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {key} ({flag}) must be true or false, got {value!r}")
    elif isinstance(value, list):  # comma-separated flags (--layers 14,19,19), or nargs="+"
        text = ",".join(str(v) for v in value)
        try:
            value = action.type(text) if action.type is not None and action.nargs is None else \
                [action.type(str(v)) if action.type else v for v in value]
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"--config {path}: {key} ({flag}): {e}") from None
    elif value is not None and action.type is not None:
        if isinstance(value, bool) or (action.type is int and isinstance(value, float)):
            raise ValueError(f"--config {path}: {key} ({flag}) must be {getattr(action.type, '__name__', 'a value')}, "
                             f"got {value!r}")
        try:
            value = action.type(value) if action.type in (int, float, str) else action.type(str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"--config {path}: {key} ({flag}): {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"--config {path}: {key} ({flag}) must be one of {', '.join(map(str, action.choices))}, "
                         f"got {value!r}")
    setattr(args, action.dest, value)


def resolved(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a command runs with, as a nested dict: its flags, and each config section as the command
    builds it (the preset with the file's and the command line's overrides; a draft config's defaults)."""
    sections = {k.split(".", 1)[0] for k in vars(args) if "." in k}
    over = overrides_from_args(args)
    full: dict[str, Any] = {}
    if sections & {"model", "sparsity", "train"} and getattr(args, "preset", None):
        model, sparsity, train = get_preset(args.preset, **over)
        full = {"model": to_dict(model), "sparsity": to_dict(sparsity), "train": to_dict(train)}
    if "draft" in sections:
        full["draft"] = to_dict(DraftTrainConfig(**over.get("draft", {})))
    out: dict[str, Any] = {}
    for key, value in sorted(vars(args).items()):
        if key in ("config", "print_config", "command") or callable(value):
            continue
        if "." not in key:
            out[key] = value
    for section in sorted(sections):
        out[section] = full.get(section, {k: v for k, v in over.get(section, {}).items()})
    return out


def print_config(config: dict[str, Any]) -> None:
    json.dump(config, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")

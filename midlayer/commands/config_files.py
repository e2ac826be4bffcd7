"""Config files for every command (issue 45, item 5): `--config FILE` (TOML, or YAML with PyYAML installed)
with the precedence command line > file > preset defaults, and `--print-config` to show the resolved
settings.

A file holds the command's flags by their names (dashes or underscores), and, for the commands whose flags
are generated from the config dataclasses (train, flops, train-draft, train-gates), tables named after the
sections:

    # train.toml                          midlayer train tiny --config train.toml --steps 50
    preset = "tiny"                       # positionals must be on the command line, whose value wins
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
    for key, value in data.items():  # (YAML reads `1:` and `yes:` as an int and a bool key)
        for k in [key, *(value if isinstance(value, dict) else ())]:
            if not isinstance(k, str):
                raise ValueError(f"--config {path}: a setting's name must be text, got {k!r}")
    return data


def _given(parser: argparse.ArgumentParser, action: argparse.Action, argv: Sequence[str]) -> bool:
    """Whether the command line set this action: by any of its option strings, `--x v` or `--x=v`, or by a
    prefix of one that argparse took for it (`--ste 3` for `--steps`: the file's value won over it)."""
    every = {o for a in parser._actions for o in a.option_strings}
    for a in argv:
        if a == "--":
            break
        name = a.split("=", 1)[0]
        for opt in action.option_strings:
            if name == opt or (parser.allow_abbrev and name.startswith("--") and len(name) > 2
                               and name not in every and opt.startswith(name)):
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
            home = [s for s in sections if f"{s}.{name}" in by_dest]
            raise ValueError(f"--config {path}: {key!r} is not a setting of this command"
                             + (f" at the top; it is one of [{home[0]}]: write it under [{home[0]}]" if home else ""))
        if name in positional_given:
            continue
        _set(parser, args, by_dest[name], value, argv, path, key)
    return args


def _set(parser: argparse.ArgumentParser, args: argparse.Namespace, action: argparse.Action, value: Any,
         argv: Sequence[str], path: str, key: str) -> None:
    """The file's `value` for `action`, unless the command line set it; converted as the flag converts (a flag
    without a type takes text, as on the command line: a list or a number was passed through raw)."""
    if _given(parser, action, argv):
        return  # the command line wins
    flag = action.option_strings[-1] if action.option_strings else action.dest
    where = f"--config {path}: {key} ({flag})"
    if value is None:  # (YAML's null: no flag of ours takes "nothing" as its value)
        raise ValueError(f"{where} needs a value, got null")
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # switches
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
    elif action.nargs in ("+", "*"):  # a list flag: a list, or one value
        value = [_converted(action, v, where) for v in (value if isinstance(value, list) else [value])]
    else:  # a list for a comma-separated flag (--layers 14,19,19) is its text
        value = _converted(action, ",".join(str(v) for v in value) if isinstance(value, list) else value, where)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"--config {path}: {key} ({flag}) must be one of {', '.join(map(str, action.choices))}, "
                         f"got {value!r}")
    setattr(args, action.dest, value)


def _converted(action: argparse.Action, value: Any, where: str) -> Any:
    """One value of a file converted by the flag's type (text where it has none); a bool, a float for an int,
    and anything but text for a text flag are refused rather than coerced."""
    kind = action.type or str
    if (isinstance(value, bool) or (kind is int and isinstance(value, float))
            or (kind is str and not isinstance(value, str))):
        raise ValueError(f"{where} must be {getattr(kind, '__name__', 'a value')}, got {value!r}")
    try:
        return kind(value) if kind in (int, float, str) else kind(str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def resolved(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a command runs with, as a nested dict: its flags, and each config section as the command
    builds it (the preset with the file's and the command line's overrides; a draft config's defaults)."""
    sections = {k.split(".", 1)[0] for k in vars(args) if "." in k}
    over = overrides_from_args(args)
    full: dict[str, Any] = {}
    if sections & {"model", "sparsity", "train"} and getattr(args, "preset", None):
        model, sparsity, train = get_preset(args.preset, **over)
        full = {"model": to_dict(model), "sparsity": to_dict(sparsity), "train": to_dict(train)}
    if "draft" in sections:  # the command's own configs (train-gates' defaults; one per --methods entry)
        made = [to_dict(c) for c in args.draft_configs(args)] if hasattr(args, "draft_configs") else \
            [to_dict(DraftTrainConfig(**over.get("draft", {})))]
        full["draft"] = made[0] if len(made) == 1 else made
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

"""Checkpoints that carry everything a run needs to continue exactly, written atomically.

A checkpoint `ckpt_{step:07d}.pt` in the run directory holds: the model, optimizer, LR-scheduler and
sparsity-controller states, the torch RNG states, the step (which is also the data position: the data
reader is a pure function of (seed, step), see data.py), and the three configs as plain dicts. The configs
are also written as `config.json` beside it for people and tools.

Writes go to a temporary file in the same directory, then `os.replace` -- a killed process never leaves a
half-written checkpoint under the real name. Loading refuses, with a clear message and without touching
anything on disk, a file that is not a midlayer checkpoint, is truncated/corrupt (a sha256 over everything it
holds -- weights, optimizer moments, schedule, controller, RNG states, configs -- is stored in it and checked:
torch.load does not check the zip's CRCs, so a damaged optimizer moment would otherwise load), or whose model
config differs from the run being resumed.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from midlayer.common import atomic_write
from midlayer.config import ModelConfig, TrainConfig, from_dict
from midlayer.model.transformer import Transformer, nonfinite_tensors

FORMAT = "midlayer-checkpoint-v1"
_NAME = re.compile(r"ckpt_(\d{7})\.pt$")
_TEMP = re.compile(r"\.(ckpt_\d{7}\.pt|config\.json)\.tmp\.(\d+)(?:\.[0-9a-f]{8})?$")  # common.atomic_write's temporary files


class CheckpointError(ValueError):
    pass


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:07d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints in `run_dir`, oldest first (temporary files are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process (or an absurd pid): leave its file alone
    return True


def remove_stale_temp_files(run_dir: Path) -> list[Path]:
    """Delete the temporary files a killed checkpoint write left in `run_dir` (`.ckpt_NNNNNNN.pt.tmp.PID[.TAG]`,
    `.config.json.tmp.PID` whose process is gone); nothing else is touched. Returns the deleted paths. Call it
    before this process writes a checkpoint there (its own PID's files are then stale too: a reused PID)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    stale = [p for p in sorted(run_dir.iterdir()) if (m := _TEMP.match(p.name)) and p.is_file()
             and (int(m.group(2)) == os.getpid() or not _pid_alive(int(m.group(2))))]
    for p in stale:
        p.unlink()
    return stale



def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], configs: dict[str, dict],
                    keep_last: int) -> Path:
    """Write ckpt for `step` atomically, then `config.json`, then prune to the newest `keep_last`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir, step)
    payload = {"format": FORMAT, "step": step, "configs": configs, **state}
    payload["sha256"] = state_digest(payload)  # of everything in the file, verified on load (load_checkpoint)
    atomic_write(path, writer=lambda p: torch.save(payload, p))
    atomic_write(run_dir / "config.json", json.dumps(configs, indent=2, sort_keys=True).encode("utf-8"))
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink()
    return path


def is_run_config(doc: Any) -> bool:
    """Whether a parsed config.json is the one `save_checkpoint` writes beside a run's checkpoints (its model and
    train sections), not a Hugging Face model's or anything else's."""
    return isinstance(doc, dict) and isinstance(doc.get("model"), dict) and isinstance(doc.get("train"), dict)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and sanity-check a checkpoint; raise CheckpointError with the reason on any problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, random bytes, pickle of something else ...
        why = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]  # torch's messages run to paragraphs
        raise CheckpointError(f"checkpoint {path} is corrupt or not a torch file ({type(e).__name__}: {why})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    for key in ("step", "configs", "model"):
        if key not in ckpt:
            raise CheckpointError(f"checkpoint {path} lacks '{key}'")
    configs = ckpt["configs"]
    if not isinstance(configs, dict) or not all(isinstance(configs.get(k), dict) for k in ("model", "sparsity", "train")):
        raise CheckpointError(f"checkpoint {path}: its configs are not midlayer's model/sparsity/train configs")
    if not isinstance(ckpt["model"], dict) or not all(isinstance(v, torch.Tensor) for v in ckpt["model"].values()):
        raise CheckpointError(f"checkpoint {path}: its 'model' is not a dict of weight tensors")
    if "sha256" in ckpt and ckpt["sha256"] != state_digest({k: v for k, v in ckpt.items() if k != "sha256"}):
        raise CheckpointError(f"checkpoint {path}: its contents do not match their checksum (the file is damaged)")
    if "model_sha256" in ckpt and ckpt["model_sha256"] != weights_digest(ckpt["model"]):  # (files before "sha256")
        raise CheckpointError(f"checkpoint {path}: its weights do not match their checksum (the file is damaged)")

    bad = nonfinite_tensors(ckpt["model"])
    if bad:
        raise CheckpointError(f"checkpoint {path} has non-finite weights in {bad[:5]}")
    return ckpt


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors of a state dict (names, dtypes, shapes and bytes, in name order): a flipped bit
    anywhere in the weights changes it."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def state_digest(obj: Any) -> str:
    """sha256 over a checkpoint's contents: nested dicts (in key order), lists and tuples (alike: a file's
    tuples may load as lists), tensors (dtype, shape and bytes) and scalars (repr). A flipped bit anywhere
    changes it."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"D{len(x)}|".encode())
            for k in sorted(x, key=repr):
                h.update(f"{k!r}=".encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}|".encode())
            for v in x:
                feed(v)
        else:
            h.update(f"S{x!r}|".encode())

    feed(obj)
    return h.hexdigest()


def load_weights(model: torch.nn.Module, ckpt: dict[str, Any], path: Path | str) -> None:
    """model.load_state_dict(ckpt["model"]), refused in one line (CheckpointError) when the weights do not fit
    the model the checkpoint's config builds: a missing or extra weight, a tensor of another shape."""
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"checkpoint {path}: its weights do not fit its model config ({first})") from None


def load_newest_checkpoint(paths: list[Path], map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load the newest of `paths` (oldest first, as `list_checkpoints`); if it is refused, the error also names
    the newest one that loads, so the user knows what remains. Nothing on disk is changed."""
    try:
        return load_checkpoint(paths[-1], map_location=map_location)
    except CheckpointError as e:
        good = None
        for p in reversed(paths[:-1]):
            try:
                load_checkpoint(p, map_location="cpu")
            except CheckpointError:
                continue
            good = p
            break
        hint = (f"the newest good checkpoint is {good}: move {paths[-1].name} out of {paths[-1].parent} to use it"
                if good else f"no other checkpoint in {paths[-1].parent} loads either")
        raise CheckpointError(f"{e}; {hint}; nothing was changed") from None


def config_mismatch(saved: dict[str, Any], current: dict[str, Any], cls: type | None = None) -> list[str]:
    """Fields whose values differ between two config dicts, as 'name: saved -> current'. Values compare as
    JSON does (a tuple equals the list a config file stores). With the config class `cls`, a field the saved
    dict lacks -- written before the field existed -- counts as that field's default, the behaviour the
    older version had."""
    if cls is not None:  # only the fields the comparison is about (the caller may have left some out)
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        saved = {**{k: defaults[k] for k in current if k in defaults and k not in saved}, **saved}

    def norm(v: Any) -> Any:
        return [norm(x) for x in v] if isinstance(v, (list, tuple)) else v

    keys = sorted(set(saved) | set(current))
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if norm(saved.get(k)) != norm(current.get(k))]


def load_model(checkpoint: str | Path, device: str | torch.device | None = None
               ) -> tuple[Transformer, dict[str, Any], TrainConfig]:
    """(model, checkpoint dict, train config) of a run directory (its newest checkpoint that loads; a refusal
    names the newest good one) or a ckpt_*.pt file, on `device` (default: cuda if available, else cpu). The
    one loader of our runs for `eval`, `generate --checkpoint`, the Python API and the evaluation helpers."""
    path = Path(checkpoint)
    found = None
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise ValueError(f"no checkpoints in {path}")
        path = found[-1]
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = load_newest_checkpoint(found, map_location=dev) if found else load_checkpoint(path, map_location=dev)
    ckpt["path"] = str(path)
    try:
        model = Transformer(from_dict(ModelConfig, ckpt["configs"]["model"])).to(dev)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: its model config is not valid ({e})") from None
    load_weights(model, ckpt, path)
    try:
        train_cfg = from_dict(TrainConfig, ckpt["configs"]["train"])
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: its train config is not valid ({e})") from None
    return model, ckpt, train_cfg

"""Draft files: save, load and check against the base, and the drafter a saved module drafts with.

Save / load: `save_draft(path, module, meta, base=model)` writes `path/draft.safetensors` (the module's
weights) and `path/draft.json` (kind, constructor config, the base model's dimensions, an optional name and
a 64-value probe of its LM head, its blocks' output on a fixed input in its own weight format and in q4 and int4,
and free-form meta). `load_draft(path, base)` rebuilds the module and refuses a file written for another base model
(different dimensions, name, LM-head probe or blocks' output).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from midlayer.common import atomic_write, file_sha256
from midlayer.engine.draft_vocab import set_draft_vocab
from midlayer.engine.quantization import compress_weights
from midlayer.ops import kernels
from midlayer.model.transformer import nonfinite_tensors, Transformer
from .drafting import model_device
from .eagle import EagleDrafter, EagleHead, EagleRows
from .early_exit import EarlyExitDrafter, EarlyExitHead
from .hidden_transfer import HiddenTransfer, HiddenTransferDrafter, HiddenTransferRows
from .layer_skip import LayerSkipDrafter
from .lookup import PromptLookupDrafter
from .medusa import MedusaDrafter, MedusaHeads
from .protocol import Drafter
from .skip_gates import GatedDrafter, SkipGates


DRAFT_FORMAT = "midlayer-draft-v1"


WEIGHTS_NAME = "draft.safetensors"


CONFIG_NAME = "draft.json"


class DraftMismatchError(ValueError):
    """A draft file that does not belong to the given base model (or is not a draft file)."""


_PROBE = 64
# `forward_probe`'s relative L2 bound: in the weight format the draft was made with (a base whose one FFN matrix
# of SmolLM2 is scaled by 1.05: 5e-3 from the base), and in another (q4 against fp32: 2.7e-2 on SmolLM2, 0.17 on
# the tests' tiny random model; its blocks drawn again under the same head: 1.35). bf16 is bounded as another
# format: its rounding depends on the kernels. (One-off scripts, 50th session.)
FORWARD_BOUND = {"same": 1e-3, "other": 0.5}
# Formats a draft's signature also probes the base in, beside the base's own (`forward_in`), so that a draft made
# on an fp32 base is held to the same-format bound where the engine loads it. In q4 the 0.5 bound let a base with
# block 20's w2 scaled by 1.05 through (3.3e-2 from the q4 probe of the right base; 52nd session's review); in int4
# it refused Gemma 3 270M's own base (8.2e-1 from its fp32 probe; 53rd session's review).
PROBE_FORMATS = ("q4", "int4")


def forward_probe(model: Transformer) -> list[float]:
    """The base's blocks at work: the final-normed residual of a fixed 16-token sequence (ids spread over the
    vocabulary), 16 dims at each of positions 1-15 (position 0 is an attention sink, whose size would dominate).
    The LM head alone (`base_signature`'s probe) does not tell a base from a fine-tune of its blocks."""
    dev = model.tok_embeddings.weight.device
    n = min(16, model.cfg.max_seq_len)
    ids = torch.linspace(0, model.cfg.vocab_size - 1, n, dtype=torch.float64).round().long()[None].to(dev)
    with torch.no_grad():
        h = model(ids, return_logits=False, output_hidden_states=True).hidden_states[-1]
        h = model.norm(h)[0, 1:].float()
    dims = torch.linspace(0, h.shape[-1] - 1, 16, dtype=torch.float64).round().long().to(dev)
    return [float(x) for x in h[:, dims].reshape(-1).cpu()]


def weights_kind(model: Transformer) -> str:
    """The weight format of a base (compressed: fp32, bf16, int4, q4; else its parameters' dtype)."""
    fmt = getattr(model, "weight_format", None)
    return fmt or {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(model.tok_embeddings.weight.dtype,
                                                                       str(model.tok_embeddings.weight.dtype))


def _probe_formats(model: Transformer, formats: tuple[str, ...]) -> dict[str, list[float]]:
    """`forward_probe` of copies of an uncompressed fp32 CPU base compressed to each of `formats` (q4 only with
    the compiled kernels, whose bits every SIMD level gives alike; the torch fallback rounds otherwise). A format
    the base cannot take (block widths not a multiple of its group size) is left out: it can never load there."""
    if weights_kind(model) != "fp32" or model_device(model).type != "cpu":
        return {}
    out = {}
    for fmt in formats:
        if fmt == "q4" and not kernels.available():
            continue
        try:
            compressed = compress_weights(copy.deepcopy(model), fmt)
        except ValueError:  # (e.g. "q4: in_features 48 is not a multiple of 32")
            continue
        out[fmt] = forward_probe(compressed)
    return out


def base_signature(model: Transformer, name: str | None = None, forward: bool = True,
                   formats: tuple[str, ...] = ()) -> dict[str, Any]:
    """What identifies the base a draft module was trained for: dimensions, an optional name, 64 evenly spaced
    entries of the LM head (cheap; robust to a dtype change), and (`forward`) its blocks' output on a fixed input
    (`forward_probe`, with the weight format it was taken in; with `formats`, also `forward_in` {format: probe}
    taken in those formats, see PROBE_FORMATS)."""
    cfg = model.cfg
    head = model.output  # an nn.Linear, or a compressed head (q8) that carries its weight as codes
    w = (head.weight if isinstance(head, nn.Linear) else head.dequantized()).detach().reshape(-1)
    # float64: float32 rounds the last index of a 28M-entry head (SmolLM2) past the end
    idx = torch.linspace(0, w.numel() - 1, _PROBE, dtype=torch.float64).round().long().to(w.device)
    sig = {"name": name, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
           "n_kv_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size, "gating": bool(cfg.gating),
           "norm_placement": cfg.norm_placement, "probe": [float(x) for x in w[idx].float().cpu()]}
    if forward:
        sig.update(weights=weights_kind(model), forward=forward_probe(model))
        extra = _probe_formats(model, formats)
        if extra:
            sig["forward_in"] = extra
    return sig


def check_base(saved: dict[str, Any], model: Transformer, name: str | None = None, where: str = "") -> None:
    """Raise DraftMismatchError unless `saved` (a base_signature) describes `model`. (The base's forward only
    where `saved` holds one to compare with: signatures written before the 50th session have none.)"""
    now = base_signature(model, name, forward="forward" in saved)
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "gating", "norm_placement"):
        if saved.get(key) != now[key]:
            raise DraftMismatchError(f"{where}: draft trained for a base with {key}={saved.get(key)!r}, "
                                     f"this model has {key}={now[key]!r}")
    if name is not None and saved.get("name") is not None and saved["name"] != name:
        raise DraftMismatchError(f"{where}: draft trained for base {saved['name']!r}, not {name!r}")
    try:
        a, b = torch.tensor(saved["probe"], dtype=torch.float32), torch.tensor(now["probe"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DraftMismatchError(f"{where}: the draft's base signature has no valid 'probe' ({e!r})") from None
    # 2% of the largest probe value: far above bf16 rounding (0.4%), far below the gap between two models
    if a.shape != b.shape or not bool(((a - b).abs() <= 0.02 * a.abs().max().clamp_min(1e-12)).all()):
        raise DraftMismatchError(f"{where}: the LM-head weights differ from the base this draft was trained "
                                 "for (same shape, different model)")
    if "forward" in saved:
        _check_forward(saved, now, where, model_device(model).type == "cpu")


def _check_forward(saved: dict[str, Any], now: dict[str, Any], where: str, cpu: bool) -> None:
    """The blocks' probe against the saved one taken in this base's weight format, with the same-format bound;
    else against the saved base's own, with the cross-format bound. Held to the cross-format bound against its own
    format's probe: bf16 (its rounding depends on the kernels), q4 without the compiled kernels (the torch
    fallback rounds otherwise), and a `forward_in` probe (taken on the CPU) off the CPU (int4 on CUDA multiplies
    in bf16; Gemma 3's int4 is 0.82 from its fp32 probe, beyond the cross-format bound)."""
    probes = saved.get("forward_in", {})
    if not isinstance(probes, dict):
        raise DraftMismatchError(f"{where}: the draft's base signature has an invalid 'forward_in' ({probes!r:.80})")
    fmt = now["weights"]
    own = fmt == saved.get("weights")
    # the probe compared with, and its format: the saved base's own, unless the file has one in this format
    ref_fmt, ref = (saved.get("weights"), saved["forward"]) if own or fmt not in probes else (fmt, probes[fmt])
    same = (own or (fmt in probes and cpu)) and fmt != "bf16" and (fmt != "q4" or kernels.available())
    try:
        a = torch.tensor(ref, dtype=torch.float32)
        b = torch.tensor(now["forward"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise DraftMismatchError(f"{where}: the draft's base signature has no valid 'forward' ({e!r})") from None
    bound = FORWARD_BOUND["same" if same else "other"]
    rel = float((a - b).norm() / a.norm().clamp_min(1e-12)) if a.shape == b.shape else float("inf")
    if not rel <= bound:
        raise DraftMismatchError(
            f"{where}: this base's blocks compute otherwise than those of the base this draft was made with "
            f"({rel:.1e} relative on a fixed input, more than {bound:g}"
            + (f" within the {fmt} format" if same else f"; {ref_fmt} (saved) against {fmt}")
            + "): another model with the same shape and LM head")


# a draft file's kind -> (its module, the drafter that drafts with it)
KINDS: dict[str, tuple[type[nn.Module], type[Drafter]]] = {
    MedusaHeads.KIND: (MedusaHeads, MedusaDrafter), EarlyExitHead.KIND: (EarlyExitHead, EarlyExitDrafter),
    HiddenTransfer.KIND: (HiddenTransfer, HiddenTransferDrafter), EagleHead.KIND: (EagleHead, EagleDrafter),
    SkipGates.KIND: (SkipGates, GatedDrafter),
}


def _kinds() -> dict[str, type[nn.Module]]:
    return {kind: module for kind, (module, _) in KINDS.items()}


def save_draft(path: str | Path, module: nn.Module, meta: dict[str, Any] | None = None, *, base: Transformer,
               base_name: str | None = None) -> Path:
    """Write `path/draft.safetensors` + `path/draft.json` (atomically each); returns the directory."""
    kinds = _kinds()
    kind = getattr(module, "KIND", None)
    if kind not in kinds or not isinstance(module, kinds[kind]):
        raise ValueError(f"not a draft module: {type(module).__name__}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    doc = {"format": DRAFT_FORMAT, "kind": kind, "config": module.config(),
           "base": base_signature(base, base_name, formats=PROBE_FORMATS), "meta": meta or {}}
    json.dumps(doc)  # fail before writing anything if meta is not JSON-serialisable
    atomic_write(out / WEIGHTS_NAME, writer=lambda tmp: save_file(state, str(tmp)))
    # the weights file's checksum, verified on load (a damaged or replaced file is refused, named)
    doc["weights_sha256"] = file_sha256(out / WEIGHTS_NAME)
    atomic_write(out / CONFIG_NAME, writer=lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=2)))
    return out


def load_draft(path: str | Path, base: Transformer | None = None, base_name: str | None = None
               ) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a saved draft module; returns (module, meta). With `base`, refuse (DraftMismatchError) a
    file written for another base model. The module is placed on the base's device."""
    p = Path(path)
    cfg_path, w_path = p / CONFIG_NAME, p / WEIGHTS_NAME
    if not cfg_path.is_file() or not w_path.is_file():
        raise DraftMismatchError(f"{p}: not a draft directory (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        doc = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftMismatchError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != DRAFT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise DraftMismatchError(f"{cfg_path}: format {found!r}, expected {DRAFT_FORMAT!r}")
    kinds = _kinds()
    if not isinstance(doc.get("kind"), str) or doc["kind"] not in kinds:
        raise DraftMismatchError(f"{cfg_path}: unknown draft kind {doc.get('kind')!r}")
    for key in ("base", "config", "meta"):
        if not isinstance(doc.get(key, {} if key == "meta" else None), dict):
            raise DraftMismatchError(f"{cfg_path}: {key!r} is missing or not a JSON object")
    if base is not None:
        check_base(doc["base"], base, base_name, str(p))
    try:
        module = kinds[doc["kind"]](**doc["config"])
    except (TypeError, ValueError) as e:
        raise DraftMismatchError(f"{cfg_path}: invalid {doc['kind']} config ({e})") from e
    want = doc.get("weights_sha256")
    if want is not None and file_sha256(w_path) != want:
        raise DraftMismatchError(f"{w_path}: its bytes do not match the checksum in {CONFIG_NAME} (the file is "
                                 "damaged or was replaced)")
    try:
        state = load_file(str(w_path))
    except Exception as e:  # SafetensorError: truncated file, bad header, random bytes ...
        raise DraftMismatchError(f"{w_path}: corrupt or truncated safetensors file ({type(e).__name__}: {e})") from e
    bad = nonfinite_tensors(state)
    if bad:
        raise DraftMismatchError(f"{w_path}: non-finite weights (NaN or inf) in {bad[:5]}: the file is corrupt")
    if "vocab" in state:  # a draft vocabulary (draft_vocab.py): the buffer takes the saved size first
        try:
            set_draft_vocab(module, state["vocab"])
        except ValueError as e:
            raise DraftMismatchError(f"{w_path}: invalid draft vocabulary ({e})") from e
        if base is not None and state["vocab"].numel() and int(state["vocab"].max()) >= base.cfg.vocab_size:
            raise DraftMismatchError(f"{w_path}: draft vocabulary has token ids beyond the base's "
                                     f"{base.cfg.vocab_size}")
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise DraftMismatchError(f"{w_path}: weights do not match {CONFIG_NAME} "
                                 f"({' '.join(str(e).split())})") from e
    if missing or unexpected:
        raise DraftMismatchError(f"{w_path}: weights do not match the config (missing {missing}, "
                                 f"unexpected {unexpected})")
    if base is not None:
        module.to(model_device(base))
    return module, doc.get("meta", {})


def heldout_accuracies(meta: dict[str, Any], where: str = "") -> list[list[float]] | None:
    """A draft's held-out per-depth, per-rank accuracies (meta["heldout"]["acc"], what sizes its trees), or None
    when it has none. Damaged ones (another type or shape, values outside [0, 1]) are refused by name, as a
    DraftMismatchError, rather than failing inside the tree builder."""
    held = meta.get("heldout") if isinstance(meta, dict) else None
    acc = held.get("acc") if isinstance(held, dict) else None
    if acc is None:
        return None
    ok = isinstance(acc, list) and acc and all(
        isinstance(row, list) and row and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                              and 0.0 <= a <= 1.0 for a in row) for row in acc)
    if not ok:
        raise DraftMismatchError(f"{where}: its held-out accuracies (meta.heldout.acc in {CONFIG_NAME}) are damaged: "
                                 "expected a list per depth of per-rank numbers in [0, 1]")
    return [[float(a) for a in row] for row in acc]


def load_drafter(path: str | Path, model: Transformer, base_name: str | None = None,
                 dtype: torch.dtype | None = None, **kw: Any) -> tuple[Any, nn.Module, dict[str, Any]]:
    """(drafter, module, meta) for a saved draft directory (refused if written for another base). `dtype`: the
    draft module's (None: its own, fp32, which a bf16 base's drafters keep: drafting.apply_linear). It is cast
    before the drafter is built, because a drafter may copy from it then: EAGLE's draft layer in the base's
    weight format (a module cast afterwards left that copy in fp32 beside a bf16 fc). `kw` go to the drafter
    (e.g. fused=False for hidden transfer)."""
    module, meta = load_draft(path, model, base_name)
    module.eval()
    if dtype is not None:
        module.to(dtype)
    drafter = KINDS[module.KIND][1](model, module, **kw)
    if isinstance(drafter, HiddenTransferDrafter):  # (its anchors are the rows its accuracies rank likeliest)
        drafter.acc = heldout_accuracies(meta, str(path))
    return drafter, module, meta


# the longest chain an autoregressive drafter (EAGLE, early exit, layer skip) drafts in a continuous batch (each
# step then drafts as deep as pays, engine/batch.py); the EAGLE paper's trees are 5-6 deep (Li et al. 2024,
# arXiv 2401.15077, sec. 5)
CHAIN = 5


def batch_drafting(drafter: Drafter | None, rows: int, prior: float | None = None) -> dict[str, Any] | None:
    """How `drafter` drafts in a continuous batch (engine/batch.py): the `ContinuousBatch` arguments that attach it
    ({} without a drafter), or None where it cannot. rows: the batch's cache rows (max_rows + memory_rows).
    prior: a trained draft's expected acceptance (its held-out depth-1 top-1), the rows' prior; prompt lookup
    prices each prompt itself. The one mapping the API's batch (and so the server) and `bench decode`'s one-row
    "-steps" rows use.

    Prompt lookup proposes from tokens; Medusa heads and EAGLE read the base's final residuals (EAGLE keeps a
    draft KV cache row per batch row); hidden transfer's pseudo rows ride the batch's forward; early exit, layer
    skip and skip gates run the base's own blocks over the batch's cache, a partial forward per chain token."""
    def acc(ids: Any) -> float | None:
        return prior

    if drafter is None:
        return {}
    if isinstance(drafter, PromptLookupDrafter):
        return dict(propose=drafter.chain, k=drafter.k, accept_prior=drafter.prompt_prior)
    if isinstance(drafter, MedusaDrafter):
        return dict(row_drafter=drafter, k=drafter.heads.k, accept_prior=acc)
    if isinstance(drafter, EagleDrafter):
        return dict(row_drafter=EagleRows(drafter, rows), k=CHAIN, accept_prior=acc)
    if isinstance(drafter, HiddenTransferDrafter):
        return dict(fused=HiddenTransferRows(drafter), k=drafter.transfer.k, accept_prior=acc)
    if isinstance(drafter, (EarlyExitDrafter, LayerSkipDrafter)):  # skip gates' GatedDrafter is a LayerSkipDrafter
        return dict(self_drafter=drafter, k=CHAIN, accept_prior=acc)
    return None

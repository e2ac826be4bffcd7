"""Self-distillation data for draft models: the base model's own greedy answers to the prompt set.

A draft model is trained to predict what the *base* model would say, so its training text is the base's
own output, not human-written text (self-distillation, as in Medusa-2 and the hidden-transfer paper). Each
prompt (`midlayer.data.prompts.Prompt`) is sent as one chat user message; the base answers greedily with
`midlayer.engine.generate.generate` until a stop token (kept, so drafts learn where answers end) or
`max_new_tokens`. Generation is batched (left-padded) with prompts of similar length together.

File format (JSON lines, written incrementally so an interrupted run loses at most one batch):

* line 1, the header: {"format": "midlayer-distill-v1", "base": drafters.base_signature(model, name),
  "max_new_tokens", "stop_tokens", "weights"}. Resuming checks it: another model (dimensions, name or
  LM-head probe) or other settings are refused with `DistillMismatchError`, because mixing responses of
  two models or two length limits would silently give a draft the wrong target.
* one line per prompt: {"id", "category", "split", "prompt_ids", "response_ids"}.

Resuming skips ids already in the file. A last line cut off by an interruption (no trailing newline or
not valid JSON) is dropped with a warning and the file truncated to the last complete record; damage
anywhere else (header included) raises `DistillFormatError`, since guessing there could lose data.

`midlayer distill --model smollm2-135m --out runs/distill/smollm2-135m.jsonl` builds the set for
the full prompt set (`prompts.prompt_set()`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from midlayer.data.prompt_recipe import load as load_scaled
from midlayer.data.prompts import Prompt, prompt_set
from midlayer.engine.generate import generate, GenerationConfig
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights
from midlayer.model.transformer import Transformer
from midlayer.output_lock import OutputBusy, OutputLock, refuse_overwrite
from .registry import base_signature, check_base, DraftMismatchError
from midlayer.train.distributed import resolve_device

DISTILL_FORMAT = "midlayer-distill-v1"
# header fields that must match to resume (batch_size: batches fix the sampling seeds and, in formats that
# are not row-invariant, even greedy outputs)
_SETTINGS = ("max_new_tokens", "stop_tokens", "weights", "temperature", "sample_seed", "batch_size")
# what files written before these settings existed used (batch_size was not recorded: any is accepted)
_DEFAULTS = {"temperature": 0.0, "sample_seed": 0}


class DistillFormatError(ValueError):
    """The file is not a (readable) distillation file."""


class DistillMismatchError(ValueError):
    """The file was made by another base model or with other settings."""


@dataclass
class DistillRecord:
    id: str
    category: str
    split: str
    prompt_ids: list[int]
    response_ids: list[int]

    def to_json(self) -> str:
        # fixed key order and separators: a resumed run writes byte-identical lines
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> DistillRecord:
        try:
            rec = cls(str(d["id"]), str(d["category"]), str(d["split"]), d["prompt_ids"], d["response_ids"])
        except (KeyError, TypeError) as e:
            raise DistillFormatError(f"{where}: record lacks a field ({e!r}): {str(d)[:200]}") from e
        for name in ("prompt_ids", "response_ids"):
            v = getattr(rec, name)
            if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise DistillFormatError(f"{where}: {name} of {rec.id!r} is not a list of ints")
        return rec


def _header_line(header: dict[str, Any]) -> str:
    return json.dumps(header, separators=(",", ":"), sort_keys=True)


def _read(path: Path) -> tuple[dict[str, Any], list[DistillRecord], int, bool]:
    """(header, records, byte length of the intact part, whether a damaged last line was found)."""
    data = path.read_bytes()
    lines = data.split(b"\n")  # the last element is b"" when the file ends with a newline
    try:
        header = json.loads(lines[0].decode("utf-8"))
        if len(lines) < 2:
            raise ValueError("no newline after the header")
    except (ValueError, UnicodeDecodeError) as e:
        raise DistillFormatError(f"{path}: corrupt header line ({e}); this is not a complete distillation file, "
                                 "delete it to start over") from e
    if not isinstance(header, dict) or header.get("format") != DISTILL_FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise DistillFormatError(f"{path}: format {got!r}, expected {DISTILL_FORMAT!r}")
    stops = header.get("stop_tokens", [])
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
        raise DistillFormatError(f"{path}: the header's stop_tokens must be a list of token ids, got {stops!r}")
    records: list[DistillRecord] = []
    good = len(lines[0]) + 1
    damaged = False
    body = lines[1:]
    for i, raw in enumerate(body):
        is_last = i == len(body) - 1 or (i == len(body) - 2 and body[-1] == b"")
        if raw == b"" and i == len(body) - 1:
            break
        try:
            rec = DistillRecord.from_dict(json.loads(raw.decode("utf-8")), f"{path}:{i + 2}")
            complete = i < len(body) - 1  # has its newline
        except (ValueError, UnicodeDecodeError) as e:
            if not is_last:
                raise DistillFormatError(f"{path}:{i + 2}: corrupt record in the middle of the file ({e})") from e
            complete = False
        if not complete:
            damaged = True
            break
        records.append(rec)
        good += len(raw) + 1
    ids = Counter(r.id for r in records)
    dup = [k for k, c in ids.items() if c > 1]
    if dup:
        raise DistillFormatError(f"{path}: ids appear more than once: {dup[:5]}")
    return header, records, good, damaged


@dataclass
class DistillSet:
    """The records of a distillation file, with helpers for draft training."""

    records: list[DistillRecord]
    header: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @classmethod
    def load(cls, path: str | Path) -> DistillSet:
        """Read a file; a truncated last line is ignored with a warning (the file is not modified)."""
        p = Path(path)
        header, records, _, damaged = _read(p)
        if damaged:
            warnings.warn(f"{p}: ignoring a truncated last line (interrupted write)", stacklevel=2)
        return cls(records, header, p)

    def __len__(self) -> int:
        return len(self.records)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse (DistillFormatError, naming the file and line) a token id outside [0, vocab_size): a file of
        another tokenizer, or damage. Checked once, at load, instead of failing as an IndexError mid-run."""
        bad = next((t for t in self.stop_tokens if t >= vocab_size), None)
        if bad is not None:  # (the batches' padding id: an IndexError in the first step)
            raise DistillFormatError(f"{self.path}:1: the header's stop token {bad} is outside the base's vocabulary "
                                     f"[0, {vocab_size})")
        for j, r in enumerate(self.records):
            bad = next((t for t in (*r.prompt_ids, *r.response_ids) if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise DistillFormatError(f"{self.path}:{j + 2}: token id {bad} is outside the base's vocabulary "
                                         f"[0, {vocab_size})")

    def split(self, name: str) -> list[DistillRecord]:
        """Records of one split ("train" or "heldout"), in file order."""
        if name not in ("train", "heldout"):
            raise ValueError(f"unknown split {name!r}: use 'train' or 'heldout'")
        return [r for r in self.records if r.split == name]

    def _pick(self, split: str | None) -> list[DistillRecord]:
        return self.records if split is None else self.split(split)

    def sequences(self, split: str | None = None) -> list[list[int]]:
        """prompt_ids + response_ids per record (all records if split is None)."""
        return [r.prompt_ids + r.response_ids for r in self._pick(split)]

    def prompt_lens(self, split: str | None = None) -> list[int]:
        """Prompt length per record, aligned with `sequences(split)` (the response starts there)."""
        return [len(r.prompt_ids) for r in self._pick(split)]

    def fingerprint(self) -> str:
        """sha256 (16 hex) of every record's id, split and tokens in file order: what draft training's resume
        compares, so that a run is never continued on other data (e.g. a distill file that has grown)."""
        h = hashlib.sha256()
        for r in self.records:
            h.update(json.dumps([r.id, r.split, r.prompt_ids, r.response_ids]).encode())
        return h.hexdigest()[:16]

    @property
    def stop_tokens(self) -> list[int]:
        return list(self.header.get("stop_tokens", []))

    @property
    def pad_id(self) -> int:
        """The id to pad training batches with: the smallest stop token (an EOS id), else 0."""
        return min(self.stop_tokens) if self.stop_tokens else 0


def _check_resumable(old: dict[str, Any], new: dict[str, Any], model: Transformer, name: str | None,
                     path: Path) -> None:
    try:
        check_base(old.get("base", {}), model, name, str(path))
    except (DraftMismatchError, KeyError, TypeError) as e:
        raise DistillMismatchError(f"{path} was made by a different base model; use another --out or delete "
                                   f"it ({e})") from e
    for key in _SETTINGS:
        if key == "batch_size" and key not in old:
            continue
        if old.get(key, _DEFAULTS.get(key)) != new[key]:
            was = old.get(key, _DEFAULTS.get(key))
            raise DistillMismatchError(f"{path} was made with {key}={was!r}, this run has {key}={new[key]!r}; "
                                       "use another output file or delete it")


@torch.no_grad()
def distill(model: Transformer, tok: Any, prompts: Sequence[Prompt], out_path: str | Path, *,
            max_new_tokens: int = 128, batch_size: int = 8, weights_note: str = "fp32",
            model_name: str | None = None, progress: bool = True, temperature: float = 0.0,
            sample_seed: int = 0) -> DistillSet:
    """Greedy responses of `model` to each prompt (a chat user message), appended to `out_path` as JSON
    lines; resumes an existing file made by the same model and settings. Returns the whole file's set.

    `tok` needs `encode_chat(messages) -> list[int]` and `eos_ids`. `weights_note` names the weights'
    precision (it changes greedy outputs, and the LM-head probe cannot tell fp32 from bf16).

    temperature > 0 samples instead (plain temperature sampling). Each batch draws from its own generator
    seeded by (sample_seed, the batch's first prompt id); batches are fixed chunks of a fixed order of all
    the prompts, so an interrupted and resumed run writes the same responses as an uninterrupted one (for
    the same prompt list and batch size).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    out = Path(out_path)
    stop = tuple(sorted(int(t) for t in tok.eos_ids))
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    header = {"format": DISTILL_FORMAT, "base": base_signature(model, model_name),
              "max_new_tokens": int(max_new_tokens), "stop_tokens": list(stop), "weights": weights_note,
              "temperature": float(temperature), "sample_seed": int(sample_seed) if temperature > 0 else 0,
              "batch_size": int(batch_size)}
    ids = Counter(p.id for p in prompts)
    if any(c > 1 for c in ids.values()):
        raise ValueError(f"duplicate prompt ids: {[k for k, c in ids.items() if c > 1][:5]}")
    # encode everything first: cheap, and a changed tokenizer/template is caught before any generation
    encoded = {p.id: tok.encode_chat([{"role": "user", "content": p.text}]) for p in prompts}

    # one writer per output file (output_lock.py), from before the file is read for resuming
    with OutputLock(out, "distill", is_dir=False):
        done: set[str] = set()
        if out.is_file() and out.stat().st_size > 0:
            old, records, good, damaged = _read(out)
            _check_resumable(old, header, model, model_name, out)
            for r in records:
                if r.id in encoded and r.prompt_ids != encoded[r.id]:
                    raise DistillMismatchError(f"{out}: prompt {r.id!r} was tokenised differently (another "
                                               "tokenizer or prompt text); use another output file or delete it")
            if damaged:
                warnings.warn(f"{out}: dropping a truncated last line (interrupted write) and resuming", stacklevel=2)
                with open(out, "r+b") as f:
                    f.truncate(good)
            done = {r.id for r in records}
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(_header_line(header) + "\n", encoding="utf-8")

        # similar lengths together: less padding per batch; (length, id) makes the order and so the file
        # content independent of the order of `prompts`. Batches are fixed chunks of the order over *all*
        # prompts, done or not: a chunk that an interruption left half-written is generated again whole (same
        # rows, same seed, so the same responses) and only its missing records are written.
        order = sorted(prompts, key=lambda p: (len(encoded[p.id]), p.id))
        chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        chunks = [c for c in chunks if any(p.id not in done for p in c)]
        from tqdm import tqdm

        t0, new_tokens = time.perf_counter(), 0
        with open(out, "a", encoding="utf-8") as f, \
                tqdm(total=sum(p.id not in done for p in prompts), unit="prompt", disable=not progress,
                     desc="distill") as bar:
            for batch in chunks:
                seed = int.from_bytes(hashlib.sha256(f"{sample_seed}-{batch[0].id}".encode()).digest()[:7], "big")
                cfg = GenerationConfig(max_new_tokens=max_new_tokens, stop_tokens=stop, temperature=temperature,
                                       seed=seed if temperature > 0 else None)
                responses = generate(model, [encoded[p.id] for p in batch], cfg)
                todo = [(p, r) for p, r in zip(batch, responses) if p.id not in done]
                for p, resp in todo:
                    f.write(DistillRecord(p.id, p.category, p.split, encoded[p.id], resp).to_json() + "\n")
                # one fsync per batch: an interruption loses at most this batch, and costs nothing next to it
                f.flush()
                os.fsync(f.fileno())
                new_tokens += sum(len(r) for _, r in todo)
                bar.update(len(todo))
                bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.1f}")
    return DistillSet.load(out)


def batches(sequences: Sequence[Sequence[int]], batch_tokens: int, seq_len: int, seed: int, *,
            pad_id: int = 0, prompt_lens: Sequence[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Training batches for draft training: a list of (tokens [B, T] long, mask [B, T] bool).

    Sequences are cut to their first `seq_len` tokens and grouped by length (ascending, ties broken by a
    seeded draw) so little of a batch is padding; a batch takes sequences while B * T <= batch_tokens (T the
    longest in it; at least one sequence per batch). Padding (right, with `pad_id`, e.g. an EOS id) has
    mask False so losses can ignore it. Sequences shorter than 2 tokens give no next-token pair and are
    dropped. The batch order is shuffled by `seed`; the same inputs and seed give the same batches.
    `prompt_lens` (one per sequence): the mask keeps only the positions whose next token is a response
    token (or the one after the response), t >= P - 1 -- the positions a drafter guesses from at decode
    time; the batches themselves (grouping, order, padding) are the same as without it.
    """
    if prompt_lens is not None and len(prompt_lens) != len(sequences):
        raise ValueError(f"prompt_lens: {len(prompt_lens)} lengths for {len(sequences)} sequences")
    if batch_tokens < 1 or seq_len < 2:
        raise ValueError(f"need batch_tokens >= 1 and seq_len >= 2, got {batch_tokens}, {seq_len}")
    keep = [i for i, s in enumerate(sequences) if len(s) >= 2]
    seqs = [[int(t) for t in sequences[i][:seq_len]] for i in keep]
    first = [0] * len(keep) if prompt_lens is None else [max(int(prompt_lens[i]) - 1, 0) for i in keep]
    rng = random.Random(seed)
    ties = [rng.random() for _ in seqs]
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), ties[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i]) > batch_tokens:  # ascending: seqs[i] is the longest so far
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    out = []
    for g in groups:
        T = max(len(seqs[i]) for i in g)
        tokens = torch.full((len(g), T), pad_id, dtype=torch.long)
        mask = torch.zeros((len(g), T), dtype=torch.bool)
        for b, i in enumerate(g):
            tokens[b, :len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
            mask[b, first[i]:len(seqs[i])] = True
        out.append((tokens, mask))
    return out


def describe(ds: DistillSet) -> str:
    """Counts per split: records, prompt/response tokens, share of responses that ended with a stop token."""
    stop = set(ds.stop_tokens)
    rows = []
    for name in ("train", "heldout"):
        recs = ds.split(name)
        p = sum(len(r.prompt_ids) for r in recs)
        g = sum(len(r.response_ids) for r in recs)
        fin = sum(1 for r in recs if r.response_ids and r.response_ids[-1] in stop)
        rows.append(f"{name:<8} {len(recs):>4} records  prompt tokens {p:>6}  response tokens {g:>6}  "
                    f"ended by a stop token {fin}/{len(recs)}")
    return "\n".join(rows)


DESCRIPTION = "Generate the self-distillation set (greedy base responses)."


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The flags of `midlayer distill` (the CLI's subparser, passed as `ap`) and of `python -m midlayer.speculative.distill`."""
    if ap is None:
        ap = argparse.ArgumentParser(prog="python -m midlayer.speculative.distill", description=DESCRIPTION)
    ap.add_argument("--model", required=True, help="pretrained name or path (see midlayer.engine.pretrained)")
    ap.add_argument("--out", required=True, help="JSON-lines output; resumed if it exists")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--seed", type=int, default=0, help="prompt-set seed (which Shakespeare passages)")
    ap.add_argument("--prompts", choices=("base", "scaled"), default="base",
                    help="base: the 268 prompts of midlayer.data.prompts; scaled: the ~22k of midlayer.data.prompt_recipe")
    ap.add_argument("--split", choices=("all", "train", "heldout"), default="all")
    ap.add_argument("--weights", choices=("dtype", "q4"), default="dtype",
                    help="q4: generate with the batch-invariant q4 kernels (CPU; the default speculative format)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled")
    ap.add_argument("--sample-seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all), for quick tries")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Refuse (ValueError naming the flag) every value outside its meaning, before any model is loaded."""
    import math


    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    for flag, v in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if args.limit < 0:  # prompts[:-1] would silently drop the last prompt
        raise ValueError(f"--limit must be >= 0 (0 = every prompt), got {args.limit}")
    if not args.out.strip() or Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r}: give a .jsonl file path, not a folder")
    if Path(args.out).parent.exists() and not Path(args.out).parent.is_dir():
        raise ValueError(f"--out {args.out}: {Path(args.out).parent} is a file, not a folder")
    refuse_overwrite("--out", args.out)  # (a checkpoint, a run's log: not a distillation file to resume)
    dev = resolve_device(args.device)
    args.device = str(dev)
    if args.weights == "q4" and dev.type != "cpu":
        raise ValueError(f"--weights q4 runs the CPU kernels; use --device cpu (got {args.device})")


def _main(argv: list[str] | None = None) -> None:
    """`python -m midlayer.speculative.distill`: `run` with its own parser; every refusal one line, exit 2."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        run(args)
    except (ValueError, DistillMismatchError, DistillFormatError, OutputBusy) as e:  # the file is left as it was
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # whole batches only are ever appended: the file is a valid prefix
        print(f"\ninterrupted: {args.out} keeps every finished batch; the same command continues it",
              file=sys.stderr)
        raise SystemExit(130) from None


def run(args: argparse.Namespace) -> int:
    """Distill with parsed flags (`midlayer distill` and `python -m midlayer.speculative.distill` both): every flag is
    checked before the model is loaded; refusals raise ValueError (DistillMismatchError, DistillFormatError,
    output_lock.OutputBusy) with one line."""

    check_args(args)  # before anything is loaded or written
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, tok = load_pretrained(args.model, dtype)
    if tok is None:
        raise ValueError(f"{args.model}: no tokenizer found; distillation needs one for the chat template")
    model.to(args.device)
    note = args.dtype
    if args.weights == "q4":
        model, note = compress_weights(model, "q4").eval(), "q4"
    if args.prompts == "scaled":
        prompts = load_scaled()
    else:
        prompts = prompt_set(args.seed)
    if args.split != "all":
        prompts = [p for p in prompts if p.split == args.split]
    if args.limit:
        prompts = prompts[:args.limit]
    t0 = time.perf_counter()
    ds = distill(model, tok, prompts, args.out, max_new_tokens=args.max_new_tokens,
                 batch_size=args.batch_size, weights_note=note, model_name=args.model,
                 progress=not args.no_progress, temperature=args.temperature, sample_seed=args.sample_seed)
    print(f"{args.out}: {len(ds)} records, this run {time.perf_counter() - t0:.1f} s on {args.device}")
    print(describe(ds))
    return 0


if __name__ == "__main__":
    _main()


__all__ = ["distill", "batches", "DistillSet", "DistillRecord", "DistillFormatError", "DistillMismatchError",
           "describe", "DISTILL_FORMAT"]

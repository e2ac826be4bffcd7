"""Add the blocks' probes to draft files whose base signature predates them.

    python scripts/sign_drafts.py drafts/smollm2-135m/medusa [more draft folders ...]

A draft made before the 50th session names its base by dimensions, name and LM head only, so a base whose blocks
were fine-tuned under the same head loads it. This loads each draft's named base (a short name: `load_pretrained`),
checks it against the signature the file holds (`check_base`), and adds what `save_draft` writes today: the
blocks' output on a fixed input in fp32 and in the formats of `registry.PROBE_FORMATS` (q4, int4). A file that
already has them all, or whose base does not match, is left as it is. The weights and their checksum do not change.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from midlayer.common import atomic_write
from midlayer.engine.pretrained import load_pretrained
from midlayer.speculative.registry import (CONFIG_NAME, PROBE_FORMATS, DraftMismatchError, base_signature,
                                           check_base)


def sign(folder: Path, cache: dict) -> str:
    """Sign one draft folder; returns what was done, in words."""
    path = folder / CONFIG_NAME
    try:
        doc = json.loads(path.read_text())
        saved = doc["base"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # (no folder, no draft.json, not JSON, no base)
        return f"not signed: not a draft folder ({type(e).__name__}: {e})"
    if "forward" in saved and set(PROBE_FORMATS) <= set(saved.get("forward_in", {})):
        return "already has the blocks' probes"
    name = saved.get("name")
    if not name:
        return "names no base (made from a folder): load it and save the draft again"
    if name not in cache:
        cache[name] = load_pretrained(name)[0]
    model = cache[name]
    try:
        check_base(saved, model, name, str(folder))
    except DraftMismatchError as e:
        return f"not signed: {e}"
    now = base_signature(model, name, formats=PROBE_FORMATS)
    doc["base"] = {**saved, "weights": now["weights"], "forward": now["forward"],
                   "forward_in": {**saved.get("forward_in", {}), **now.get("forward_in", {})}}
    atomic_write(path, writer=lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=2)))
    return f"signed in {now['weights']} and {', '.join(now.get('forward_in', {})) or 'no other format'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="draft folders (each holds draft.json)")
    args = ap.parse_args(argv)
    cache: dict = {}
    for folder in args.folders:
        print(f"{folder}: {sign(folder, cache)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

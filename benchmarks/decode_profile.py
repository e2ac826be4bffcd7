"""Where a decode step's time goes (docs/results/decode-cpu.md): aten op count of one step, and a cProfile
of 40 steps by function, for SmolLM2-135M in a weight format (default q4).

    python benchmarks/decode_profile.py [FORMAT]
"""

from __future__ import annotations

import cProfile
import pstats

import torch

from midlayer.engine.generate import decode_one_token, prefill
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights


def main(fmt: str = "q4") -> None:
    model, tok = load_pretrained("smollm2-135m")
    model = compress_weights(model, fmt).eval()
    ids = tok.encode_chat([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    cache = KVCache.for_model(model.cfg, 1, len(ids) + 64, dtype=kv_dtype(model))
    logits, pos = prefill(model, [ids], cache)
    tok_ = logits.argmax(-1)

    def step():
        nonlocal tok_, pos
        out = decode_one_token(model, cache, tok_, pos)
        tok_, pos = out.argmax(-1), pos + 1

    for _ in range(5):
        step()
    with torch.profiler.profile() as prof:
        step()
    events = prof.key_averages()
    print(f"{fmt}: {sum(e.count for e in events if e.key.startswith('aten::'))} aten ops in one decode step")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(40):
        step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # (--help was taken for a weight format)
    p.add_argument("format", nargs="?", default="q4", help="weight format (fp32, bf16, int4, q4)")
    main(p.parse_args().format)

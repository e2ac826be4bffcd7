"""ms per new token of the dynamic engine in one weight format, for before/after comparisons of a change
(docs/results/static-step.md, "The CPU's own speed is unchanged"): the package is imported from ROOT (a
worktree of the commit to time), SmolLM2 is compressed to FORMAT, 4 chat prompts x 64 new tokens are
generated 3 times after a warm-up, and the median over the 12 calls of (call time / tokens) is printed,
prefill included. Run the two roots in turn, several rounds, in one loop.

    python benchmarks/decode_ms.py ROOT [FORMAT]
"""

import argparse
import statistics
import sys
import time

import os  # noqa: E402

_p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # (--help was an AssertionError)
_p.add_argument("root", help="a checkout (worktree) of the commit to time")
_p.add_argument("format", nargs="?", default="q4", help="weight format (fp32, bf16, int4, q4)")
_args = _p.parse_args()
ROOT = os.path.realpath(_args.root)  # (a relative ROOT such as "." failed the check below)
sys.path.insert(0, ROOT)

import midlayer  # noqa: E402

assert os.path.realpath(midlayer.__file__).startswith(ROOT + os.sep), midlayer.__file__
try:
    from midlayer.engine.generate import GenerationConfig, generate  # noqa: E402
    from midlayer.engine.pretrained import load_pretrained  # noqa: E402
    from midlayer.engine.quantization import compress_weights  # noqa: E402
except ModuleNotFoundError:  # a commit before the package split (5f373cf): the flat layout
    from midlayer.generate import GenerationConfig, generate  # noqa: E402
    from midlayer.pretrained import load_pretrained  # noqa: E402
    from midlayer.quantization import compress_weights  # noqa: E402

fmt = _args.format
m, tok = load_pretrained("smollm2-135m")
m = compress_weights(m, fmt).eval()
prompts = ["Write a haiku about rain on a tin roof.", "Explain what a hash map is.", "List three uses of copper.",
           "Why is the sky blue?"]
enc = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
cfg = GenerationConfig(max_new_tokens=64)
for ids in enc:
    generate(m, [ids], cfg)
ts = []
for _ in range(3):
    for ids in enc:
        t = time.perf_counter()
        out = generate(m, [ids], cfg)[0]
        ts.append((time.perf_counter() - t) / len(out))
print(f"{_args.root} {fmt} median ms/token {1e3 * statistics.median(ts):.3f}")

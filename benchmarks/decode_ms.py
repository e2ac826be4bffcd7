"""ms per new token of the dynamic engine in one weight format, for before/after comparisons of a change
(docs/results/static-step.md, "The CPU's own speed is unchanged"): the package is imported from ROOT (a
worktree of the commit to time), SmolLM2 is compressed to FORMAT, 4 chat prompts x 64 new tokens are
generated 3 times after a warm-up, and the median over the 12 calls of (call time / tokens) is printed,
prefill included. Run the two roots in turn, several rounds, in one loop.

    python benchmarks/decode_ms.py ROOT [FORMAT]
"""

import statistics
import sys
import time

import os  # noqa: E402

ROOT = os.path.realpath(sys.argv[1])  # (a relative ROOT such as "." failed the check below)
sys.path.insert(0, ROOT)

import midlayer  # noqa: E402

assert os.path.realpath(midlayer.__file__).startswith(ROOT + os.sep), midlayer.__file__
from midlayer.engine.generate import GenerationConfig, generate  # noqa: E402
from midlayer.engine.pretrained import load_pretrained  # noqa: E402
from midlayer.engine.quantization import compress_weights  # noqa: E402

fmt = sys.argv[2] if len(sys.argv) > 2 else "q4"
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
print(f"{sys.argv[1]} {fmt} median ms/token {1e3 * statistics.median(ts):.3f}")

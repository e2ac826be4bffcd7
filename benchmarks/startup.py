"""Where a CLI call's start-up goes: importing torch and midlayer, loading SmolLM2's GGUF, compressing it to
q4, loading a draft, and its first speculative call against a second one (docs/results/decode-cpu.md, 29th
session). One process, each phase once, in order, as
`midlayer generate` runs them; run it twice to see the second call's (cached) GGUF index.

    python benchmarks/startup.py [--draft drafts/smollm2-135m-scale/eagle]
"""

from __future__ import annotations

import argparse
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t1 = time.perf_counter()
from midlayer import cli  # noqa: E402, F401  (what `python -m midlayer` imports)
from midlayer.speculative.registry import load_drafter  # noqa: E402
from midlayer.engine.pretrained import load_pretrained  # noqa: E402
from midlayer.engine.quantization import compress_weights  # noqa: E402

t2 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="drafts/smollm2-135m-scale/eagle", help="'' for none")
    args = ap.parse_args()
    s = {"import torch": t1 - t0, "import midlayer": t2 - t1}
    t = time.perf_counter()
    model, tok = load_pretrained("smollm2-135m")
    s["load_pretrained (GGUF)"] = time.perf_counter() - t
    t = time.perf_counter()
    model = compress_weights(model, "q4").eval()
    s["compress to q4"] = time.perf_counter() - t
    if args.draft:
        t = time.perf_counter()
        drafter, _, _ = load_drafter(args.draft, model)
        s["load the draft"] = time.perf_counter() - t
        # the first speculative call builds what the drafter keeps (e.g. its draft-vocabulary head); the
        # second shows the warm cost of the same 64 tokens
        from midlayer.speculative.tree import DraftTree
        from midlayer.speculative.verify import speculative_generate

        ids = tok.encode_chat([{"role": "user", "content": "Why is the sky blue?"}])
        for name in ("first speculative call, 64 tokens", "second call, the same"):
            t = time.perf_counter()
            with torch.inference_mode():
                speculative_generate(model, ids, drafter, DraftTree.chain(3), 64)
            s[name] = time.perf_counter() - t
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n\n| phase | s |\n|---|---|")
    for k, v in s.items():
        print(f"| {k} | {v:.2f} |")
    print(f"| total | {sum(s.values()):.2f} |")


if __name__ == "__main__":
    main()

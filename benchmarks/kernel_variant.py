"""What one change to the C kernels (midlayer/ops/csrc/qkernels.c) costs in q4 decoding: the library as shipped
against a variant compiled, by the same command, from a copy of the source with one text replaced. Both run in one
process, turn about (A B, then B A), on the same prompt; the table gives each side's ms/token and the per-pair
ratio. A speed change must not change the tokens: the run stops if the variant's differ.

    python benchmarks/kernel_variant.py --replace 'OLD TEXT' 'NEW TEXT' [--model smollm2-135m] [--pairs 10]
        [--new-tokens 64] [--prompt TEXT]

Example (docs/results/decode-cpu.md): the quantiser's finiteness check of each activation group, left out:
    --replace 'if (!q8_group_finite(xg)) {' 'if (0 && !q8_group_finite(xg)) {'
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from midlayer.engine.generate import GenerationConfig, generate
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights
from midlayer.ops import kernels


def variant_library(old: str, new: str, folder: Path):
    """The kernels compiled from the shipped source with every `old` replaced by `new` (which must occur)."""
    src = kernels._SRC.read_text()
    n = src.count(old)
    if n == 0:
        raise ValueError(f"--replace: {old!r} does not occur in {kernels._SRC.name}")
    path = folder / "variant.c"
    path.write_text(src.replace(old, new))
    kernels.compile_library(path, folder / "libvariant.so")
    print(f"variant: {n} occurrence(s) of {old!r} replaced by {new!r}")
    return kernels.open_library(folder / "libvariant.so")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replace", nargs=2, metavar=("OLD", "NEW"), required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="The history of the Roman empire begins with")
    args = ap.parse_args()
    if args.pairs < 1 or args.new_tokens < 1:
        ap.error(f"--pairs and --new-tokens must be >= 1, got {args.pairs} and {args.new_tokens}")
    if not args.prompt.strip():
        ap.error("--prompt is empty")
    shipped = kernels.library()
    if shipped is None:
        raise SystemExit("the kernels are not built (no C compiler?): nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        try:  # (before the model loads: a replacement that does not apply fails at once)
            libs = {"shipped": shipped, "variant": variant_library(*args.replace, Path(tmp))}
        except ValueError as e:
            ap.error(str(e))
        model, tok = load_pretrained(args.model)
        model = compress_weights(model, "q4")
        prompt = tok.encode(args.prompt)
        cfg = GenerationConfig(max_new_tokens=args.new_tokens)
        ms: dict[str, list[float]] = {k: [] for k in libs}
        tokens: dict[str, list[int]] = {}
        generate(model, [prompt], cfg)  # warm-up (buffers, the OpenMP pool)
        for i in range(args.pairs):
            for name in (("shipped", "variant") if i % 2 == 0 else ("variant", "shipped")):
                kernels._lib = libs[name]
                t = time.perf_counter()
                out = generate(model, [prompt], cfg)[0]
                ms[name].append((time.perf_counter() - t) / len(out) * 1e3)
                if tokens.setdefault(name, out) != out or tokens.get("shipped", out) != out:
                    raise SystemExit(f"the {name} library decoded other tokens: not a speed-only change")
        kernels._lib = shipped
    ratios = [a / b for a, b in zip(ms["shipped"], ms["variant"])]
    print(f"\n{args.model} q4, {len(prompt)}-token prompt, {args.new_tokens} new tokens (prefill included), "
          f"{args.pairs} pairs, kernels at SIMD level {kernels.SIMD_LEVELS[shipped.qk_simd_level()]}\n")
    print("| library | ms/token median | min | max |\n|---|---|---|---|")
    for name, v in ms.items():
        print(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print(f"\nshipped / variant per pair: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()

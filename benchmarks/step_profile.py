"""Where one plain decode step's time goes (issue 42), engine by engine, from torch.profiler: our static step
eager and captured in CUDA graphs, our static step through torch.compile (Inductor, CUDA graphs), and
transformers' StaticCache + compiled-step recipe, all on SmolLM2-135M (fused projections, as `bench static` runs it) after
the same held-out prompt. Per engine it prints the step's wall time (timed without the profiler), the kernels
a step runs, their summed GPU time, and the kernels that take the most of it.

Why: on an H200 our captured step took 4.32 ms for ~890 kernels in bf16, the recipe 1.54 ms, and our
compiled step 2.92 (docs/results/static-step.md). Whether the gap is the count of kernels (the gaps between
them in a graph replay) or the time inside a few of them decides what to fuse next: the step's wall time
against its kernels' summed time says which.

    python benchmarks/step_profile.py [--device cuda] [--dtype bf16] [--steps 20] [--engines ...]

On a CPU (a dry run: no CUDA graphs) the table lists the aten ops by self CPU time instead of kernels.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("MIDLAYER_NO_KERNELS", "1")  # (before midlayer loads its C library: as on a GPU)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from midlayer.engine.decode_step import DecodeStep  # noqa: E402
from midlayer.engine.pretrained import load_pretrained, resolve_pretrained  # noqa: E402
from midlayer.engine.quantization import fuse_projections  # noqa: E402
from midlayer.experiments.bench import heldout_chats, load_hf_same_weights  # noqa: E402
from midlayer.experiments.static_bench import DTYPES, HFRecipe, machine_lines  # noqa: E402

# eager first: its kernels are the captured step's, each launched from the host, so their summed time is the
# captured step's kernel time even where a profiler shows a graph's replay as one launch
ENGINES = ("eager", "cudagraph", "compile", "recipe")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def stepper(name: str, model, hf_cpu, ids: list[int], max_len: int):
    """A function that runs the engine's next plain decode step (after `ids`, each call one position on), warmed
    up: its graphs captured or compiled."""
    dev, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    P = len(ids)
    if name == "recipe":
        hf = HFRecipe(copy.deepcopy(hf_cpu).to(dev, dtype), max_len)
        state = {"tok": hf.prefill(ids), "pos": P}

        def one() -> None:
            state["tok"] = hf.next(state["tok"], state["pos"])
            state["pos"] += 1
    else:
        st = DecodeStep(model, max_len=max_len, graphs=name)
        st.prefill(torch.tensor([ids], device=dev))
        state = {"tok": torch.tensor([ids[-1]], device=dev), "pos": P}

        def one() -> None:
            logits, _ = st.decode(state["tok"], state["pos"])
            state["tok"] = logits.argmax(-1)
            state["pos"] += 1
    for _ in range(3):  # capture / compile, then settle
        one()
    _sync(dev)
    return one


def profile_engine(one, dev: torch.device, steps: int) -> tuple[float, list[tuple[str, int, float]]]:
    """(wall ms a step, unprofiled; [(kernel or op, calls, total us)] over `steps` profiled steps)."""
    _sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        one()
    _sync(dev)
    wall = 1e3 * (time.perf_counter() - t) / steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            one()
        _sync(dev)
    rows = []
    for e in prof.key_averages():
        on_gpu = dev.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA
        if dev.type == "cuda" and not on_gpu:
            continue
        if dev.type != "cuda" and not e.key.startswith("aten::"):
            continue
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, e.count, float(us)))
    return wall, sorted(rows, key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled")
    ap.add_argument("--engines", default=None, help=f"comma-separated, of {', '.join(ENGINES)} (on a CPU, no "
                                                     "cudagraph); default all")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per engine")
    args = ap.parse_args()
    dev = torch.device(args.device)
    names = [x.strip() for x in (args.engines or ",".join(ENGINES)).split(",") if x.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or args.steps < 1:
        ap.error(f"--engines: choose from {', '.join(ENGINES)}, got {bad}; --steps >= 1")
    if dev.type != "cuda":
        names = [n for n in names if n != "cudagraph"]
    base, tok = load_pretrained("smollm2-135m")
    model = fuse_projections(copy.deepcopy(base).to(dev, DTYPES[args.dtype]).eval())
    ids = heldout_chats(tok, 1)[0]
    max_len = len(ids) + 3 + 2 * args.steps + 8
    hf_cpu = load_hf_same_weights(resolve_pretrained("smollm2-135m").path) if "recipe" in names else None
    print("\n".join(machine_lines(dev)))
    print(f"smollm2-135m {args.dtype}, fused projections; one plain decode step after a {len(ids)}-token held-out "
          f"prompt; {args.steps} steps timed, then {args.steps} profiled\n")
    unit = "kernels" if dev.type == "cuda" else "aten ops (self CPU time)"
    head = (f"| engine | wall ms/step | {unit} per step | their time, ms/step | wall / their time |\n"
            "|---|---|---|---|---|")
    lines = []
    for n in names:  # each engine's table as it is done (a run cut short keeps what it finished)
        with torch.no_grad():
            wall, rows = profile_engine(stepper(n, model, hf_cpu, ids, max_len), dev, args.steps)
        count = sum(c for _, c, _ in rows) / args.steps
        busy = sum(us for _, _, us in rows) / args.steps / 1e3
        lines.append(f"| {n} | {wall:.2f} | {count:.0f} | {busy:.2f} | {wall / max(busy, 1e-9):.2f} |")
        print(f"{head}\n{lines[-1]}\n\n{n}: the {min(args.top, len(rows))} largest by time\n\n"
              "| kernel | per step | us each | us per step |\n|---|---|---|---|", flush=True)
        for key, c, us in rows[:args.top]:
            print(f"| {key[:90]} | {c / args.steps:.1f} | {us / c:.1f} | {us / args.steps:.1f} |")
        print(flush=True)
    print(f"All engines\n\n{head}\n" + "\n".join(lines))

if __name__ == "__main__":
    main()

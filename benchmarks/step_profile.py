"""Where one plain decode step's time goes (issue 42), engine by engine, from torch.profiler: our static step
eager and captured in CUDA graphs, our static step through torch.compile (Inductor, CUDA graphs), and
transformers' StaticCache + compiled-step recipe, all on SmolLM2-135M (fused projections, as `bench static`
runs it) after the same held-out prompt. Per engine it prints the step's wall time (timed without the
profiler), the kernels a step runs, their summed GPU time, and the kernels that take the most of it.

Why: on an H200 our captured step took 4.32 ms for ~890 kernels in bf16, the recipe 1.54 ms, and our
compiled step 2.92 (docs/results/static-step.md). Whether the gap is the count of kernels (the gaps between
them in a graph replay) or the time inside a few of them decides what to fuse next: the step's wall time
against its kernels' summed time says which.

    python benchmarks/step_profile.py [--device cuda] [--dtype bf16] [--steps 20] [--engines ...] \\
        [--drafts eagle=drafts/smollm2-135m-scale/eagle,...]

With --drafts, each drafter's device round (24-node tree, as `bench static`) is profiled too, in the step's
captured mode (eager on a CPU): per round its wall time, tau and kernels, from the difference between two
generations of different lengths (so the prefill cancels). On an H200 hidden transfer's 128-row round cost
1.67 plain steps where its kernels were 1.16 times a step's (static-step.md): this says where that goes.

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

from midlayer.engine.decode_step import any_round_slots, BUCKET_CANDIDATES, DecodeStep, invariant_buckets  # noqa: E402
from midlayer.engine.pretrained import load_pretrained, resolve_pretrained  # noqa: E402
from midlayer.engine.quantization import fuse_projections  # noqa: E402
from midlayer.experiments.bench import heldout_chats, load_hf_same_weights  # noqa: E402
from midlayer.common import device_sync  # noqa: E402
from midlayer.experiments.static_bench import DTYPES, HFRecipe, machine_lines, static_methods  # noqa: E402
from midlayer.speculative.static import fused_steps, static_speculative_generate  # noqa: E402

# eager first: its kernels are the captured step's, each launched from the host, so their summed time is the
# captured step's kernel time even where a profiler shows a graph's replay as one launch
# "cudagraph-torch": the captured step with `attend` in PyTorch ops in buckets 8.. (unprobed), beside the probe's
# choice, which on CUDA may be the row-attention kernel: the two attentions' cost in one run
ENGINES = ("eager", "cudagraph", "cudagraph-torch", "compile", "recipe")


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
        kw = dict(buckets=BUCKET_CANDIDATES[1], attention="torch") if name.endswith("-torch") else {}
        st = DecodeStep(model, max_len=max_len, graphs=name.split("-")[0], **kw)
        st.prefill(torch.tensor([ids], device=dev))
        state = {"tok": torch.tensor([ids[-1]], device=dev), "pos": P}

        def one() -> None:
            state["tok"] = st.greedy(state["tok"], state["pos"])
            state["pos"] += 1
    for _ in range(3):  # capture / compile, then settle
        one()
    device_sync(dev)
    return one


def kernels(fn, dev: torch.device) -> dict[str, tuple[int, float]]:
    """{kernel (aten op on a CPU): (calls, total us)} of one call of fn under torch.profiler."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        device_sync(dev)
    out = {}
    for e in prof.key_averages():
        on_gpu = dev.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA
        if dev.type == "cuda" and not on_gpu or dev.type != "cuda" and not e.key.startswith("aten::"):
            continue
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us > 0:
            out[e.key] = (e.count, float(us))
    return out


def wall_s(fn, dev: torch.device) -> float:
    device_sync(dev)
    t = time.perf_counter()
    fn()
    device_sync(dev)
    return time.perf_counter() - t


def profile_engine(one, dev: torch.device, steps: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """(wall ms a step, unprofiled; {kernel: (calls, us) a step}) over `steps` steps each."""

    def run() -> None:
        for _ in range(steps):
            one()

    wall = 1e3 * wall_s(run, dev) / steps
    return wall, {k: (c / steps, us / steps) for k, (c, us) in kernels(run, dev).items()}


def profile_rounds(model, drafter, tree, ids: list[int], graphs: str, short: int, long: int
                   ) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """(wall ms a round, tau, {kernel: (calls, us) a round}) of `drafter`'s device rounds on `tree` through the
    step in mode `graphs`: the difference between a generation of `long` and one of `short` new tokens, over
    the rounds between them, so that the prefill, the drafter's pass over the prompt and the first round cancel
    (greedy: the short run's rounds are the long run's first ones). The wall times are the best of two; the
    kernels come from one profiled run of each (noisier)."""
    dev = model.tok_embeddings.weight.device
    st = DecodeStep(model, max_len=len(ids) + long + any_round_slots(len(tree), fused_steps(drafter)), graphs=graphs)
    runs = {}
    for n in (long, short, long, short, long):  # (the first: every round shape captured; then the best of two)
        box = {}
        s = wall_s(lambda: box.update(r=static_speculative_generate(model, ids, drafter, tree, n, step=st)), dev)
        out, stats = box["r"]
        runs[n] = (min(s, runs[n][0]) if n in runs else s, stats.base_forwards, len(out))
    (s1, r1, n1), (s2, r2, n2) = runs[short], runs[long]
    rounds = max(r2 - r1, 1)
    ks = kernels(lambda: static_speculative_generate(model, ids, drafter, tree, short, step=st), dev)
    kl = kernels(lambda: static_speculative_generate(model, ids, drafter, tree, long, step=st), dev)
    diff = {k: ((c - ks.get(k, (0, 0.0))[0]) / rounds, (us - ks.get(k, (0, 0.0))[1]) / rounds)
            for k, (c, us) in kl.items()}
    return 1e3 * (s2 - s1) / rounds, (n2 - n1) / rounds, {k: v for k, v in diff.items() if v[1] > 0}


def table(label: str, wall: float, ks: dict[str, tuple[float, float]], top: int, unit: str, per: str) -> str:
    """One engine's or drafter's line and its `top` kernels by time."""
    count = sum(c for c, _ in ks.values())
    busy = sum(us for _, us in ks.values()) / 1e3
    line = f"| {label} | {wall:.2f} | {count:.0f} | {busy:.2f} | {wall / max(busy, 1e-9):.2f} |"
    rows = sorted(ks.items(), key=lambda kv: -kv[1][1])[:top]
    body = [f"| {k[:90]} | {c:.1f} | {us / max(c, 1e-9):.1f} | {us:.1f} |" for k, (c, us) in rows]
    return "\n".join([f"| engine | wall ms/{per} | {unit} per {per} | their time, ms/{per} | wall / their time |",
                      "|---|---|---|---|---|", line, "", f"{label}: the {len(rows)} largest by time", "",
                      f"| kernel | per {per} | us each | us per {per} |", "|---|---|---|---|", *body, ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled")
    ap.add_argument("--engines", default=None, help=f"comma-separated, of {', '.join(ENGINES)} (on a CPU, no "
                                                     "cudagraph); default all")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per engine")
    ap.add_argument("--drafts", default="", help="comma-separated LABEL=DIR of drafts: also one device round of "
                                                 "each (the `bench static` tree, 24 nodes), against the plain step")
    args = ap.parse_args()
    dev = torch.device(args.device)
    names = [x.strip() for x in (args.engines or ",".join(ENGINES)).split(",") if x.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or args.steps < 1:
        ap.error(f"--engines: choose from {', '.join(ENGINES)}, got {bad}; --steps >= 1")
    entries = [x.strip() for x in args.drafts.split(",") if x.strip()]
    wrong = [x for x in entries if "=" not in x or not x.split("=", 1)[0] or not os.path.isdir(x.split("=", 1)[1])]
    if wrong:
        ap.error(f"--drafts: LABEL=DIR of a train-draft output each, got {', '.join(wrong)}")
    if dev.type != "cuda":
        names = [n for n in names if not n.startswith("cudagraph")]
    base, tok = load_pretrained("smollm2-135m")
    model = fuse_projections(copy.deepcopy(base).to(dev, DTYPES[args.dtype]).eval())
    ids = heldout_chats(tok, 1)[0]
    max_len = len(ids) + 3 + 2 * args.steps + 8
    hf_cpu = load_hf_same_weights(resolve_pretrained("smollm2-135m").path) if "recipe" in names else None
    print("\n".join(machine_lines(dev)))
    print(f"smollm2-135m {args.dtype}, fused projections; one plain decode step after a {len(ids)}-token held-out "
          f"prompt; {args.steps} steps timed, then {args.steps} profiled\n")
    unit = "kernels" if dev.type == "cuda" else "aten ops (self CPU time)"
    lines = []
    mode = "cudagraph" if dev.type == "cuda" else "eager"
    (buckets, rows, attention, linear), ok = invariant_buckets(model, max_len, mode)  # (the probe's; memoised)
    print(f"the step (probed in {mode} mode): buckets {buckets}, attention {attention}"
          f"{f' in groups of {rows}' if rows else ''}, linears {linear}, row-invariant {ok}\n", flush=True)
    methods = static_methods(model, dict(x.split("=", 1) for x in entries), 24)
    # each table as it is done (a run cut short keeps what it finished); the compile, the slowest to build, last
    for n in [n for n in names if n != "compile"] + ["drafts"] + [n for n in names if n == "compile"]:
        if n == "drafts":
            for label, (drafter, tree) in methods.items():
                with torch.no_grad():
                    wall, tau, ks = profile_rounds(model, drafter, tree, ids, mode, 16, 16 + args.steps * 2)
                print(f"{label} ({len(tree)} nodes), device rounds in {mode}: tau {tau:.2f}, "
                      f"{wall / tau:.2f} ms/token\n")
                print(table(f"{label} round", wall, ks, args.top, unit, "round"), flush=True)
            continue
        with torch.no_grad():
            wall, ks = profile_engine(stepper(n, model, hf_cpu, ids, max_len), dev, args.steps)
        text = table(n, wall, ks, args.top, unit, "step")
        lines.append(text.splitlines()[2])
        print(text, flush=True)
    print(f"All engines\n\n| engine | wall ms/step | {unit} per step | their time, ms/step | wall / their time |\n"
          "|---|---|---|---|---|\n" + "\n".join(lines))

if __name__ == "__main__":
    main()

"""How many kernels one static decode step launches (issue 42): on a GPU a CUDA-graph replay pays per kernel,
so the count bounds how close the captured step can come to transformers' compiled recipe. Counts every
aten op that launches a kernel (views excluded) in one plain decode step of SmolLM2 (bucket 8, 100 tokens of
context), through PyTorch's own ops (the C kernels of the CPU are switched off, as they are on a GPU):
the model as loaded, and as the static benchmarks and `generate` run it (q|k|v and w1|w3 fused:
quantization.fuse_projections). On CUDA each RMSNorm at inference is aten's rms_norm, one fused kernel where
that build has one (layers.RMSNorm.FUSED_DEVICES); on a CPU it decomposes, so its column is a projection:
five fewer kernels per norm. Where Triton imports, also the step through its Triton kernels (the row
attention and the row-wise kernels, ops/fused_rows.py; a round's acceptance, a dynamic tree's rows and
layout), each call counted as one launch, what runs inside it not counted: its PyTorch formula (`stand_ins`),
or with --interpret the kernel in Triton's interpreter (the same counts: the step's shapes are static). Then each draft's device round
(speculative/static.py: the draft, the verification, the acceptance, the compaction, one graph on a GPU)
against the fused plain step, with the tree `bench static` gives it, and by phase (the draft; the verification
forward; the acceptance, the compaction and the round's own ops): where a replay is bound by its kernels, a
drafter gains about tau / that ratio. `--rounds triton`: the rounds through the Triton kernels, against the
plain step through them.

    python benchmarks/step_kernels.py [--drafts eagle=drafts/smollm2-135m-scale/eagle,...] [--rounds triton]
                                      [--interpret]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os

os.environ.setdefault("MIDLAYER_NO_KERNELS", "1")  # (before midlayer loads its C library)
os.environ.setdefault("TRITON_INTERPRET", "1")  # (the Triton kernels' row on a CPU: run, and counted as launches)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from midlayer.engine.decode_step import DecodeStep  # noqa: E402
from midlayer.engine.pretrained import load_pretrained  # noqa: E402
from midlayer.engine.quantization import fuse_projections  # noqa: E402
from midlayer.experiments.static_bench import static_methods  # noqa: E402
from midlayer.model.layers import RMSNorm  # noqa: E402
from midlayer.ops import row_attention  # noqa: E402
from midlayer.ops.triton_build import NEEDS  # noqa: E402
from midlayer.speculative.static import DeviceRounds, static_speculative_generate  # noqa: E402

DRAFTS = ",".join(f"{k}=drafts/smollm2-135m-scale/{k}" for k in ("eagle", "medusa", "hidden-transfer", "early-exit"))

VIEWS = {"view", "unsqueeze", "_unsafe_view", "expand", "transpose", "t", "select", "slice", "lift_fresh", "alias",
         "detach", "as_strided", "squeeze", "permute", "split", "unbind", "empty", "empty_strided",
         "new_empty"}  # (no kernel)


class Kernels(TorchDispatchMode):
    """Counts the kernel ops run inside it, in `ops`, and by phase in `phases` (the innermost `phase` entered)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.phases: collections.Counter = collections.Counter()
        self.now = ["rest"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.count(name)
        return func(*args, **(kwargs or {}))

    def count(self, name: str, n: int = 1) -> None:
        self.ops[name] += n
        self.phases[self.now[-1]] += n

    @contextlib.contextmanager
    def phase(self, name: str):
        self.now.append(name)
        try:
            yield
        finally:
            self.now.pop()


def _sites() -> list:
    """(module, name) of each Triton kernel's launch function the static step calls."""
    from midlayer.ops import acceptance, fused_rows, row_attention, row_linear, tree_layout

    return [(fused_rows, "rms_norm"), (fused_rows, "add_rms_norm"), (fused_rows, "silu_mul"),
            (fused_rows, "rope_store"), (row_attention, "row_attention"), (row_attention, "row_keys"),
            (row_linear, "row_linear"), (row_linear, "swiglu_linear"), (row_linear, "norm_linear"),
            (acceptance, "accept"),
            (tree_layout, "layout"), (tree_layout, "rows")]


@contextlib.contextmanager
def replaced(sites: list, fns: list):
    """Each site's function replaced by the one in `fns`, then restored."""
    saved = [getattr(mod, name) for mod, name in sites]
    for (mod, name), fn in zip(sites, fns):
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for (mod, name), fn in zip(sites, saved):
            setattr(mod, name, fn)


@contextlib.contextmanager
def standing_in():
    """Within it, each Triton kernel's call runs its PyTorch formula (`stand_ins`) instead of the kernel (on a
    CPU, Triton's interpreter): a launch's count does not depend on the values (the step's shapes are static),
    and the interpreter takes minutes a round (hidden transfer's 128 rows: far longer). The values round
    otherwise, so the generation around a counted round may differ from the kernels'."""
    fns = stand_ins()
    sites = _sites()
    with replaced(sites, [fns[name] for _, name in sites]):
        yield


def stand_ins() -> dict:
    """The PyTorch formulas of the Triton kernels, by kernel name."""
    import torch.nn.functional as F

    from midlayer.ops import acceptance, fused_rows, row_attention, tree_layout

    def rms_norm(x, w, eps):  # (layers.RMSNorm's formula, as it runs on CUDA)
        return F.rms_norm(x.float(), x.shape[-1:], w.float(), eps).to(x.dtype)

    def attention(q, kl, vl, keys, kmask, positions, out=None, dtype=torch.float32, counts=None, start=None):
        o = row_attention.reference(q, kl, vl, keys, kmask).to(dtype).contiguous()
        return o if out is None else out.copy_(o)

    def silu_mul(ab):
        a, b = ab.float().chunk(2, -1)
        return (F.silu(a) * b).to(ab.dtype)

    def linear(x, w, b=None):  # (not F.linear: the step's RowLinears mode, nested in a round, would route it again)
        return x @ w.T if b is None else x @ w.T + b

    def norm_linear(x, a, g, eps, w, rope=None):
        h = x if a is None else x + a
        y = linear(rms_norm(h, g, eps), w)
        if rope is None:
            return h, y
        cos, sin, H, kc, vc, slots = rope
        return h, fused_rows.reference_rope_store(y.view(*y.shape[:2], -1, kc.shape[-1]), cos, sin, H, kc, vc, slots)

    return {"rms_norm": rms_norm, "add_rms_norm": lambda x, a, w, eps: (x + a, rms_norm(x + a, w, eps)),
            "silu_mul": silu_mul, "rope_store": fused_rows.reference_rope_store, "row_attention": attention,
            "row_keys": row_attention.reference_keys, "row_linear": linear,
            "swiglu_linear": lambda ab, w: linear(silu_mul(ab), w), "norm_linear": norm_linear,
            "accept": acceptance.reference,
            "layout": tree_layout.reference, "rows": tree_layout.reference_rows}


@contextlib.contextmanager
def triton_launches(k: Kernels):
    """Each call of the static step's Triton kernels counted as its launches (one; the row attention's two
    passes two where they are not one launch) under its own name; what runs inside it is not counted (the
    kernel in Triton's interpreter on a CPU, or within `standing_in` its PyTorch formula)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from midlayer.ops import row_attention

    sites = _sites()

    def counting(real, name):
        def launch(*a, **kw):
            two = name == "row_attention" and not row_attention.ONE_PASS  # (its two passes: two launches)
            k.count(f"triton {name}", 2 if two else 1)
            with _disable_current_modes():
                return real(*a, **kw)
        return launch

    with replaced(sites, [counting(getattr(mod, name), name) for mod, name in sites]):
        yield


def counted(model, fn, *args, k: Kernels | None = None):
    """(fn(*args), its kernel ops, the RMSNorm calls in it); counted into `k` (default: a new counter)."""
    norms = []
    hooks = [m.register_forward_hook(lambda *a: norms.append(1)) for m in model.modules() if isinstance(m, RMSNorm)]
    k = k or Kernels()
    try:
        with k, triton_launches(k):
            out = fn(*args)
    finally:
        for h in hooks:
            h.remove()
    return out, k.ops, len(norms)


@contextlib.contextmanager
def phases(k: Kernels, step: DecodeStep, rounds: DeviceRounds):
    """A device round's kernels counted by phase: "draft" (the drafter's draft, and what it carries to the next
    round), "forward" (the verification's blocks, its final norm and LM head), and "rest": the round's own
    ops, the acceptance and the compaction (`DecodeStep.verify_round`)."""
    dd, m, saved = rounds.draft, step.model, []

    def labelled(obj, name: str, label: str) -> None:
        real = getattr(obj, name)
        saved.append((obj, name, real))

        def run(*a, **kw):
            with k.phase(label):
                return real(*a, **kw)
        setattr(obj, name, run)

    for obj, name, label in ((dd, "draft", "draft"), (dd, "after", "draft"), (step, "blocks", "forward")):
        labelled(obj, name, label)
    hooks = [mod.register_forward_pre_hook(lambda *a: k.now.append("forward")) for mod in (m.norm, m.output)]
    hooks += [mod.register_forward_hook(lambda *a: k.now.pop() and None) for mod in (m.norm, m.output)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for obj, name, real in saved:
            setattr(obj, name, real)


# --rounds: the step's kernels, (attention, linear) of DecodeStep
MODES = {"torch": (None, None), "triton": ("triton", None), "both": ("triton", "triton")}


def step_kernels(model, mode: str = "torch") -> tuple[collections.Counter, int]:
    """(kernel ops of one plain decode step, RMSNorm calls in it); mode: `MODES`."""
    attention, linear = MODES[mode]
    st = DecodeStep(model, max_len=200, buckets=(8, 16, 32, 64), attention=attention, linear=linear)
    st.prefill(torch.arange(100)[None] % model.cfg.vocab_size)
    with torch.no_grad():
        st.decode(torch.tensor([5]), 100)  # (first call: any lazy set-up)
        _, ops, norms = counted(model, st.decode, torch.tensor([5]), 101)
    return ops, norms


def round_kernels(model, drafter, tree, mode: str = "torch") -> tuple[int, int, collections.Counter]:
    """(kernel ops of one device round of `drafter` on `tree`, RMSNorm calls in it, the ops by phase: `phases`),
    a round in the middle of a generation from a 30-token prompt (a static step's count does not depend on the
    context's length)."""
    attention, linear = MODES[mode]
    st = DecodeStep(model, max_len=200, buckets=(8, 16, 32, 64, 128, 256), attention=attention, linear=linear)
    ids = [int(t) for t in torch.arange(300, 330) % model.cfg.vocab_size]
    with torch.no_grad():
        static_speculative_generate(model, ids, drafter, tree, 4, step=st)  # builds the rounds (and any memo)
        rounds = DeviceRounds.for_step(st, drafter, tree)
        if rounds is None:
            raise ValueError(f"{type(drafter).__name__} does not draft on the device")
        run, counts = rounds.runner, []

        def counting(*args):
            k = Kernels()
            with phases(k, st, rounds):
                out, ops, norms = counted(model, run, *args, k=k)
            counts.append((sum(ops.values()), norms, k.phases))
            return out

        rounds.runner = counting
        try:
            static_speculative_generate(model, ids, drafter, tree, 8, step=st)
        finally:
            rounds.runner = run
    return counts[len(counts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default=DRAFTS, help="comma-separated LABEL=DIR of drafts ('' = none)")
    ap.add_argument("--rounds", choices=tuple(MODES), default="torch",
                    help="the device rounds through PyTorch's ops, through the Triton kernels (attention='triton'; "
                         "counted as launches), or through those and the row-linear kernel too (both)")
    ap.add_argument("--interpret", action="store_true",
                    help="run the Triton kernels in Triton's interpreter while they are counted, not their PyTorch "
                         "formulas (the same counts; a cross-check, minutes a draft)")
    args = ap.parse_args()
    entries = [x.strip() for x in args.drafts.split(",") if x.strip()]
    bad = [x for x in entries if "=" not in x or not x.split("=", 1)[0] or not os.path.isdir(x.split("=", 1)[1])]
    if bad:
        ap.error(f"--drafts: LABEL=DIR of a train-draft output each, got {', '.join(bad)}")
    if args.rounds != "torch" and not row_attention.available(torch.device("cpu")):
        ap.error(f"--rounds triton: {NEEDS}")
    with contextlib.nullcontext() if args.interpret else standing_in():
        count(args, entries)


def count(args: argparse.Namespace, entries: list[str]) -> None:
    """`main`'s tables."""
    base, _ = load_pretrained("smollm2-135m")
    base.eval()
    L = base.cfg.n_layers
    print(f"SmolLM2-135M ({L} blocks), one plain decode step of the static step, fp32, kernels launched\n")
    print("| model | kernels | per block | if each RMSNorm is one kernel (CUDA) | top ops |")
    print("|---|---|---|---|---|")
    fused = fuse_projections(copy.deepcopy(base))
    rows = [("as loaded", base, "torch"), ("fused (fuse_projections)", fused, "torch")]
    if row_attention.available(torch.device("cpu")):  # (with --interpret, Triton's interpreter: minutes)
        rows.append(("fused, the Triton kernels (attention='triton')", fused, "triton"))
        rows.append(("fused, and the row-linear kernel too (linear='triton')", fused, "both"))
    plain = {}  # mode -> the fused plain step's (kernels, kernels if each RMSNorm is one)
    for label, model, mode in rows:
        ops, norms = step_kernels(model, mode)
        n = sum(ops.values())
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
        # (each RMSNorm one kernel already where the row-wise kernels run: ops/fused_rows.py)
        fused_norms = 0 if mode != "torch" else 5 * norms
        print(f"| {label} | {n} | {n / L:.1f} | {n - fused_norms} ({norms} norms) | {top} |", flush=True)
        if model is fused:
            plain[mode] = (n, n - fused_norms)
    drafts = dict(x.split("=", 1) for x in entries)
    if not drafts:
        return
    print(f"\nOne device round of each draft (fused model, kernels '{args.rounds}'), against the plain step of the "
          "same\n")
    print("| draft | tree | kernels | x plain | draft | forward | acceptance, compaction, the round's own | "
          "if each RMSNorm is one kernel | x plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    ref = plain[args.rounds]
    for label, (drafter, tree) in static_methods(fused, drafts, 24).items():
        k, norms, by = round_kernels(fused, drafter, tree, args.rounds)
        one = k - (0 if args.rounds != "torch" else 5 * norms)
        shape = f"{len(tree)} nodes" + (f", EAGLE-2 k={drafter.dynamic_k}" if drafter.dynamic_k else "")
        print(f"| {label} | {shape} | {k} | {k / ref[0]:.2f} | {by['draft']} | {by['forward']} | {by['rest']} | "
              f"{one} | {one / ref[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()

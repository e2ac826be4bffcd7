"""How many kernels one static decode step launches (issue 42): on a GPU a CUDA-graph replay pays per kernel,
so the count bounds how close the captured step can come to transformers' compiled recipe. Counts every
aten op that launches a kernel (views excluded) in one plain decode step of SmolLM2 (bucket 8, 100 tokens of
context), through PyTorch's own ops (the C kernels of the CPU are switched off, as they are on a GPU):
the model as loaded, and as the static benchmarks and `generate` run it (q|k|v and w1|w3 fused:
quantization.fuse_projections). On CUDA each RMSNorm at inference is aten's rms_norm, one fused kernel where
that build has one (layers.RMSNorm.FUSED_DEVICES); on a CPU it decomposes, so its column is a projection:
five fewer kernels per norm.

    python benchmarks/step_kernels.py
"""

from __future__ import annotations

import collections
import copy
import os

os.environ.setdefault("MIDLAYER_NO_KERNELS", "1")  # (before midlayer loads its C library)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from midlayer.engine.decode_step import DecodeStep  # noqa: E402
from midlayer.engine.pretrained import load_pretrained  # noqa: E402
from midlayer.engine.quantization import fuse_projections  # noqa: E402
from midlayer.model.layers import RMSNorm  # noqa: E402

VIEWS = {"view", "unsqueeze", "_unsafe_view", "expand", "transpose", "t", "select", "slice", "lift_fresh", "alias",
         "detach", "as_strided", "squeeze", "permute", "split", "unbind"}


class Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def step_kernels(model) -> tuple[collections.Counter, int]:
    """(kernel ops of one plain decode step, RMSNorm calls in it)."""
    st = DecodeStep(model, max_len=200, buckets=(8, 16, 32, 64))
    st.prefill(torch.arange(100)[None] % model.cfg.vocab_size)
    norms = []
    hooks = [m.register_forward_hook(lambda *a: norms.append(1)) for m in model.modules() if isinstance(m, RMSNorm)]
    with torch.no_grad():
        st.decode(torch.tensor([5]), 100)  # (first call: any lazy set-up)
        norms.clear()
        with Kernels() as k:
            st.decode(torch.tensor([5]), 101)
    for h in hooks:
        h.remove()
    return k.ops, len(norms)


def main() -> None:
    base, _ = load_pretrained("smollm2-135m")
    base.eval()
    L = base.cfg.n_layers
    print(f"SmolLM2-135M ({L} blocks), one plain decode step of the static step, fp32, kernels launched\n")
    print("| model | kernels | per block | if each RMSNorm is one kernel (CUDA) | top ops |")
    print("|---|---|---|---|---|")
    for label, model in (("as loaded", base), ("fused (fuse_projections)", fuse_projections(copy.deepcopy(base)))):
        ops, norms = step_kernels(model)
        n = sum(ops.values())
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
        print(f"| {label} | {n} | {n / L:.1f} | {n - 5 * norms} ({norms} norms) | {top} |")


if __name__ == "__main__":
    main()

"""What `--weights q4` adds to a GGUF of each tensor type (issue 46, item 1; docs/results/gguf-types.md): SmolLM2-135M's
weights (dequantised from its Q4_1 / Q8_0 file) are stored in type X and read back with the `gguf` package's
own routines -- bit for bit what loading a file of type X gives (tests/test_gguf_types.py) -- which is "the
file's model"; the q4 format then requantises its block linears to Q4_1 and its head to Q8_0. Reported: mean
and max KL(file's model || q4 model) per token, and top-1 agreement, over held-out chat prompts.

The k-quants (Q2_K ... Q6_K) cannot be written by the gguf package (no quantiser); `--model gemma3-270m`
measures a real k-quant file instead (Gemma 3's Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 tensors), the file's model
against its q4 version, in one row.

    python benchmarks/requant_error.py [--prompts 16] [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import copy

import gguf
import numpy as np
import torch

from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights
from midlayer.experiments.bench import heldout_texts, machine_line
from midlayer.train.evaluate import kl_rows

T = gguf.GGMLQuantizationType
SOURCES = [T.F16, T.BF16, T.Q8_0, T.Q5_1, T.Q5_0, T.Q4_1, T.Q4_0]


def as_type(model: torch.nn.Module, qtype: T) -> torch.nn.Module:
    """A copy of `model` whose 2-D block weights (and head, if untied) went through qtype and back via gguf."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() != 2 or "tok_embeddings" in name:
                continue
            w = p.detach().float().numpy()
            back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
            p.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(w.shape)))
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m: every type gguf writes; another "
                                                             "model: its own file's types, one row")
    args = ap.parse_args()
    model, tok = load_pretrained(args.model, max_seq_len=2048)
    texts = heldout_texts(args.prompts, "scaled")
    batches = [torch.tensor([tok.encode_chat([{"role": "user", "content": t}])]) for t in texts]
    print(machine_line(), "\n")
    print("| file type | mean KL (nats/token) | max KL | top-1 agreement | tokens |\n|---|---|---|---|---|")
    for qtype in SOURCES if args.model == "smollm2-135m" else [None]:
        file_model = (as_type(model, qtype) if qtype is not None else model).eval()
        q4 = compress_weights(copy.deepcopy(file_model), "q4").eval()
        kls, agree, n = [], 0, 0
        for x in batches:
            a, b = file_model(x).logits[0], q4(x).logits[0]
            kls.append(kl_rows(a, b))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            n += a.shape[0]
        kl = torch.cat(kls)
        name = qtype.name if qtype is not None else f"{args.model}'s own file"
        print(f"| {name} | {kl.mean():.5f} | {kl.max():.4f} | {agree / n:.4f} | {n} |")


if __name__ == "__main__":
    main()

"""Inference benchmarks (`midlayer bench generate`): each prints a Markdown table of ratios measured in one
run on one machine, interleaving the things compared so that drift on a shared machine hits both.

1. `decode`: batch-1 greedy decode speed on a pretrained model (default SmolLM2-135M-Instruct from the
   GGUF), ours vs Hugging Face `transformers` `generate` on the same dequantised weights, with the
   memory-bandwidth bound (weight bytes read per token / measured GEMV bandwidth).
   With `llama-cpp-python` installed (`pip install -e .[bench]`, built from source), also the anchor of
   SPEC section 9: llama.cpp on the same GGUF, same thread count, same prompts, interleaved prompt by
   prompt: decode ms/token (prefill excluded) and prefill tokens/s, as ratios to llama.cpp.
   On an Intel host with AMX, a native build (pip's default) takes ggml's AMX backend, which crashed with a
   segmentation fault in its first decode on this project's Xeon (llama-cpp-python 0.3.36, a KVM guest,
   2026-11-26). Build it without: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
   -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install llama-cpp-python.
2. `skipping`: real skipping in a gated model (paper-12l shape, random weights) with a forced fraction z of
   tokens skipping the middle span [k, L-1-k]; prefill and decode time with skipping on vs off, against
   the speedup the FLOPs model (flops.py) predicts at the measured per-block sparsity.
3. `gates` (`bench_gates`): learned skip gates on a pretrained model (skip_gates.py, `midlayer train-gates`)
   vs the dense model and static layer skipping of equal compute: held-out KL, greedy-token agreement,
   sparsity, and real prefill / decode speedups against the FLOPs model.
"""

from __future__ import annotations

import copy
import functools
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from midlayer.config import get_preset
from midlayer.data.corpus import corpus_documents
from midlayer.data.prompt_recipe import load as load_scaled
from midlayer.data.prompts import prompt_set
from midlayer.engine.batch import ContinuousBatch
from midlayer.engine.generate import decode_one_token, forward_cached, generate, GenerationConfig, prefill
from midlayer.engine.pretrained import load_pretrained, resolve_pretrained
from midlayer.engine.quantization import compress_weights, weight_bytes
from midlayer.model.flops import decode_flops, forward_flops
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.model.transformer import Transformer
from midlayer.ops import kernels
from midlayer.speculative.distill import DistillSet
from midlayer.speculative.draft_training import DraftTrainConfig, heldout_metrics, response_batches
from midlayer.speculative.layer_skip import LayerSkipDrafter
from midlayer.speculative.lookup import PromptLookupDrafter
from midlayer.speculative.registry import batch_drafting, heldout_accuracies, load_draft, load_drafter
from midlayer.speculative.skip_gates import SkipGates
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.tree_cost import auto_tree, measure_overhead, row_costs
from midlayer.speculative.verify import draft_node_tokens, speculative_generate


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemv_bandwidth(n_bytes: int = 256 * 2**20, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Bytes/s of a one-row matmul over an n_bytes matrix: the ceiling of batch-1 decoding."""
    cols = 4096
    rows = n_bytes // (cols * torch.finfo(dtype).bits // 8)
    w = torch.randn(rows, cols, dtype=dtype)
    x = torch.randn(cols, dtype=dtype)
    w @ x
    return n_bytes / _median_time(lambda: w @ x, repeats)


# ------------------------------------------------------------------------------------------ skipping
def force_skip_fraction(model: Transformer, z: float, skip_from: int, seq_len: int, seed: int = 0
                        ) -> torch.Tensor:
    """Make a random fraction z of the tokens of a returned sequence skip blocks [skip_from, L-1-skip_from].

    Marked tokens carry a dominant feature 0 in their embedding (~sqrt(d) after the embedding RMSNorm);
    router `skip_from` reads that feature (weight e_0, bias -sqrt(d)/2), so a marked token reaches S >= 1
    exactly there and the others (feature 0 only block noise) stay at 0; every other router is 0. The
    benchmark measures the sparsity it gets rather than trusting this construction.
    Returns token ids [1, seq_len] (marked ids come from the first half of the vocabulary).
    """
    V = model.cfg.vocab_size
    with torch.no_grad():
        emb = model.tok_embeddings.weight
        emb[:, 0] = 0.0
        emb[: V // 2, 0] = 10.0
        for r in model.routers:
            r.weight.zero_()
            r.bias.zero_()
        model.routers[skip_from].weight[0, 0] = 1.0
        model.routers[skip_from].bias.fill_(-0.5 * model.cfg.dim ** 0.5)
    g = torch.Generator().manual_seed(seed)
    marked = torch.rand(seq_len, generator=g) < z
    ids = torch.where(marked, torch.randint(0, V // 2, (seq_len,), generator=g),
                      torch.randint(V // 2, V, (seq_len,), generator=g))
    return ids[None]


def bench_skipping(preset: str = "paper-12l", seq_len: int = 1024, fractions=(0.0, 0.25, 0.5, 0.75, 0.9),
                   skip_from: int = 2, decode_steps: int = 64, repeats: int = 3,
                   dtype: torch.dtype = torch.float32) -> list[dict]:
    cfg, _, _ = get_preset(preset)
    if seq_len < 1 or decode_steps < 1 or repeats < 1:
        raise ValueError(f"seq_len, decode_steps and repeats must be >= 1, got {seq_len}, {decode_steps}, {repeats}")
    if not all(0 <= z <= 1 for z in fractions):  # NaN fails too
        raise ValueError(f"forced skip fractions must be in [0, 1], got {list(fractions)}")
    if not 0 <= skip_from < cfg.n_layers // 2:
        raise ValueError(f"skip_from must be in [0, {cfg.n_layers // 2}) (the routed blocks), got {skip_from}")
    if seq_len + decode_steps > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} + decode_steps {decode_steps} exceeds max_seq_len {cfg.max_seq_len}")
    if not cfg.gating:
        raise ValueError(f"{preset} is not a gated model")
    torch.manual_seed(0)
    model = Transformer(cfg).eval().to(dtype)
    rows = []
    for z in fractions:
        ids = force_skip_fraction(model, z, skip_from, seq_len + decode_steps)
        prompt, cont = ids[:, :seq_len], ids[:, seq_len:]
        with torch.no_grad():
            sparsity = model(ids[:, :seq_len]).gate_stats.zero_frac[: cfg.n_layers // 2].tolist()
        pos = torch.arange(seq_len + decode_steps)[None]

        def run_prefill(skip: bool):
            cache = KVCache.for_model(cfg, 1, seq_len + decode_steps, dtype=dtype)
            forward_cached(model, prompt, cache, pos[:, :seq_len], skip=skip, last_only=True)
            return cache

        def run_decode(skip: bool):
            cache = run_prefill(skip)
            t = time.perf_counter()
            for i in range(decode_steps):
                forward_cached(model, cont[:, i:i + 1], cache, pos[:, seq_len + i:seq_len + i + 1], skip=skip,
                               last_only=True)
            return time.perf_counter() - t

        run_prefill(True), run_prefill(False)  # warm-up: allocator, kernels
        pre_on, pre_off, dec_on, dec_off = [], [], [], []
        for _ in range(repeats):  # interleaved: on, off, on, off ...
            pre_on.append(_median_time(lambda: run_prefill(True), 1))
            pre_off.append(_median_time(lambda: run_prefill(False), 1))
            dec_on.append(run_decode(True))
            dec_off.append(run_decode(False))
        f_dense = forward_flops(cfg, seq_len).total
        f_sparse = forward_flops(cfg, seq_len, sparsity).total
        ctx = seq_len + decode_steps // 2
        d_dense = decode_flops(cfg, ctx).total
        d_sparse = decode_flops(cfg, ctx, sparsity).total
        pred_pre, real_pre = f_dense / f_sparse, statistics.median(pre_off) / statistics.median(pre_on)
        pred_dec, real_dec = d_dense / d_sparse, statistics.median(dec_off) / statistics.median(dec_on)
        rows.append(dict(z=z, sparsity=[round(s, 3) for s in sparsity],
                         prefill_off_s=statistics.median(pre_off), prefill_on_s=statistics.median(pre_on),
                         prefill_pred=pred_pre, prefill_real=real_pre,
                         decode_off_ms=1e3 * statistics.median(dec_off) / decode_steps,
                         decode_on_ms=1e3 * statistics.median(dec_on) / decode_steps,
                         decode_pred=pred_dec, decode_real=real_dec))
    return rows


def skipping_table(rows: list[dict]) -> str:
    out = [machine_line(), "", "| forced z | per-block sparsity (first half) | prefill off / on (s) | prefill speedup real / predicted "
           "| decode off / on (ms/token) | decode speedup real / predicted |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['z']:.2f} | {r['sparsity']} | {r['prefill_off_s']:.3f} / {r['prefill_on_s']:.3f} | "
                   f"{r['prefill_real']:.2f}x / {r['prefill_pred']:.2f}x ({r['prefill_real'] / r['prefill_pred']:.0%}) | "
                   f"{r['decode_off_ms']:.1f} / {r['decode_on_ms']:.1f} | "
                   f"{r['decode_real']:.2f}x / {r['decode_pred']:.2f}x ({r['decode_real'] / r['decode_pred']:.0%}) |")
    return "\n".join(out)


# -------------------------------------------------------------------------------------------- decode
CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share (the index of the first divergence)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def first_divergence(model: Transformer, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy continuations first differ, and the fp32 top-2 logit margin of `model` there.

    A small margin (a near-tie) means the two runs broke a tie differently through summation order; a
    large one would mean a real disagreement between the two implementations."""
    n = common_prefix(a, b)
    if n == min(len(a), len(b)):  # one is a prefix of the other: no divergence
        return None
    with torch.no_grad():
        logits = model(torch.tensor([prompt + a[:n]])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return dict(index=n, margin=float(top[0] - top[1]))


def machine_line() -> str:
    """What every benchmark table is measured on: CPU model and flags, threads, library versions."""
    return f"machine: {kernels.cpu_info().summary()}; q4 kernels: {'built' if kernels.available() else 'not built'}"


_PROBE = """
import sys
from llama_cpp import Llama
Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False).eval([1, 2])
"""


@functools.lru_cache(maxsize=None)
def probe_llama_cpp(gguf_path: str, threads: int) -> None:
    """Load the GGUF and decode two tokens with llama.cpp in a child process first: a llama.cpp build that
    crashes (its AMX backend did, with a segmentation fault, on this project's Xeon; module docstring) then
    costs the benchmark its llama.cpp column, with the reason on stderr, instead of the whole run.
    Raises ImportError (what the callers already treat as "no llama.cpp") when the child fails."""
    try:
        res = subprocess.run([sys.executable, "-c", _PROBE, gguf_path, str(threads)], capture_output=True,
                             text=True, timeout=300)
    except subprocess.TimeoutExpired:
        res = None
    if res is not None and res.returncode == 0:
        return
    if res is None:
        what = "did not decode two tokens within 300 s"
    else:
        what = f"crashed (signal {-res.returncode})" if res.returncode < 0 else f"failed (exit {res.returncode})"
        tail = res.stderr.strip().splitlines()[-1:]
        what += f" in a probe decode{': ' + tail[0] if tail else ''}"
    msg = (f"llama.cpp {what}; no llama.cpp column. On an AMX host, rebuild llama-cpp-python without AMX "
           "(midlayer/experiments/bench.py's docstring says how)")
    print(msg, file=sys.stderr)
    raise ImportError(msg)


class LlamaCppAnchor:
    """llama.cpp through llama-cpp-python on a GGUF file: greedy decode, batch 1, `threads` threads."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int = 2048) -> None:
        import llama_cpp
        import numpy as np

        probe_llama_cpp(gguf_path, threads)  # a crashing build costs the column, not the run

        self._lc, self._np = llama_cpp, np
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, verbose=False)
        self.version = getattr(llama_cpp, "__version__", "?")

    def _argmax(self) -> int:
        ptr = self._lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)  # the last evaluated row's logits
        return int(self._np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).argmax())

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        """(prefill seconds, decode seconds per token, greedy tokens)."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        t1 = time.perf_counter()
        out = [self._argmax()]
        for _ in range(new_tokens - 1):
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return t1 - t0, (time.perf_counter() - t1) / max(new_tokens - 1, 1), out


def ours_run(model: Transformer, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """Our engine, timed like `LlamaCppAnchor.run`: (prefill seconds, decode seconds per token, tokens)."""
    cache = KVCache.for_model(model.cfg, 1, len(ids) + new_tokens, dtype=kv_dtype(model))
    t0 = time.perf_counter()
    logits, pos = prefill(model, [ids], cache)
    t1 = time.perf_counter()
    tok = logits.argmax(-1)
    out = [int(tok)]
    for _ in range(new_tokens - 1):
        logits = decode_one_token(model, cache, tok, pos)
        tok, pos = logits.argmax(-1), pos + 1
        out.append(int(tok))
    return t1 - t0, (time.perf_counter() - t1) / max(new_tokens - 1, 1), out


def bench_anchor(models: dict[str, Transformer], gguf_path: str, encoded: list[list[int]], new_tokens: int,
                 repeats: int) -> dict | None:
    """Ours per weight format vs llama.cpp, interleaved per prompt; None if llama-cpp-python is missing."""
    try:
        anchor = LlamaCppAnchor(gguf_path, torch.get_num_threads())
    except ImportError:
        return None
    names = [*models, "llama.cpp"]
    pre = {n: [0.0, 0] for n in names}  # seconds, tokens
    dec: dict[str, list[float]] = {n: [] for n in names}
    toks: dict[str, list[list[int]]] = {n: [] for n in names}
    for ids in encoded:
        for name in names:  # warm-up, and the tokens
            toks[name].append(anchor.run(ids, new_tokens)[2] if name == "llama.cpp" else ours_run(models[name], ids, new_tokens)[2])
        for _ in range(repeats):
            for name in names:
                p, d, _ = anchor.run(ids, new_tokens) if name == "llama.cpp" else ours_run(models[name], ids, new_tokens)
                pre[name][0] += p
                pre[name][1] += len(ids)
                dec[name].append(d)
    ref = names[-1]
    rows = []
    for name in names:
        d_ms = 1e3 * statistics.median(dec[name])
        tps = pre[name][1] / pre[name][0]
        rows.append(dict(engine=name, decode_ms=d_ms, prefill_tok_s=tps,
                         decode_ratio=d_ms / (1e3 * statistics.median(dec[ref])),
                         prefill_ratio=tps / (pre[ref][1] / pre[ref][0]),
                         equal_llama=sum(a == b for a, b in zip(toks[name], toks[ref]))))
    return dict(llama_cpp_version=anchor.version, rows=rows, prompts=len(encoded),
                prompt_tokens=[len(x) for x in encoded])


def anchor_table(a: dict) -> str:
    out = [f"llama.cpp anchor (llama-cpp-python {a['llama_cpp_version']}, same GGUF, same threads), {a['prompts']} "
           f"prompts of {min(a['prompt_tokens'])}-{max(a['prompt_tokens'])} tokens, interleaved",
           "", "| engine | decode ms/token | x llama.cpp | prefill tok/s | x llama.cpp | greedy tokens = llama.cpp |",
           "|---|---|---|---|---|---|"]
    for r in a["rows"]:
        out.append(f"| {r['engine']} | {r['decode_ms']:.1f} | {r['decode_ratio']:.2f}x | {r['prefill_tok_s']:.0f} | "
                   f"{r['prefill_ratio']:.2f}x | {r['equal_llama']}/{a['prompts']} |")
    return "\n".join(out)


def bench_decode(model_name: str = "smollm2-135m", new_tokens: int = 64, repeats: int = 3,
                 prompts: list[str] | None = None, formats: tuple[str, ...] = ("fp32", "bf16", "int4", "q4")
                 ) -> dict:
    """Ours (in each weight format) vs transformers `generate` (fp32, the same dequantised weights),
    greedy, batch 1; tokens compared with transformers' and with our fp32 run; plus the bandwidth bound."""

    prompts = prompts or CHAT_PROMPTS
    ref_model, tok = load_pretrained(model_name)  # fp32, kept as loaded: the near-tie margins
    ref_model.eval()
    models = {fmt: compress_weights(copy.deepcopy(ref_model), fmt).eval() for fmt in formats}
    encoded = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    ctx = ref_model.cfg.max_seq_len
    if max(map(len, encoded)) + new_tokens > ctx:  # (the decode would stop at the context: fewer tokens timed)
        raise ValueError(f"--new-tokens {new_tokens}: a prompt of {max(map(len, encoded))} tokens and the new ones "
                         f"exceed {model_name}'s context of {ctx} tokens")
    hf = load_hf_same_weights(resolve_pretrained(model_name).path)
    cfg = GenerationConfig(max_new_tokens=new_tokens)

    # Both sides generate exactly new_tokens tokens, through end-of-turn tokens: no stop token (ours:
    # stop_tokens empty; transformers: no eos). `min_new_tokens` would instead *suppress* the eos logit
    # and make the two token streams differ for a reason unrelated to the forward pass.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def hf_generate(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)

    times: dict[str, list[float]] = {f: [] for f in (*formats, "transformers")}
    tokens: dict[str, list[list[int]]] = {f: [] for f in (*formats, "transformers")}
    for ids in encoded:
        x = torch.tensor([ids])
        tokens["transformers"].append(hf_generate(x)[0, len(ids):].tolist())  # also the warm-up
        for fmt in formats:
            tokens[fmt].append(generate(models[fmt], [ids], cfg)[0])
        for _ in range(repeats):  # interleaved, so drift on a shared machine hits every side
            times["transformers"].append(_median_time(lambda: hf_generate(x), 1))
            for fmt in formats:
                times[fmt].append(_median_time(lambda: generate(models[fmt], [ids], cfg), 1))
    bw = gemv_bandwidth()
    src = resolve_pretrained(model_name).path
    anchor = bench_anchor(models, str(src), encoded, new_tokens, repeats) if str(src).endswith(".gguf") else None
    rows = []
    for fmt in formats:
        model = models[fmt]
        # Per-step decode time alone (prefill excluded), for the bandwidth comparison.
        step_s = ours_run(model, encoded[0], new_tokens + 1)[1]
        # Bytes read per step: every linear weight once (a tied head reads the embedding matrix).
        wb = weight_bytes(model)
        divergences = [first_divergence(ref_model, p, a, b)
                       for p, a, b in zip(encoded, tokens[fmt], tokens["transformers"])]
        rows.append(dict(weights=fmt, tok_s=new_tokens / statistics.median(times[fmt]),
                         step_ms=1e3 * step_s, weight_mb=wb / 1e6, bound_step_ms=1e3 * wb / bw,
                         equal_hf=[a == b for a, b in zip(tokens[fmt], tokens["transformers"])],
                         equal_fp32=[a == b for a, b in zip(tokens[fmt], tokens[formats[0]])],
                         divergences=divergences))
    return dict(model=model_name, prompts=len(prompts), new_tokens=new_tokens, bandwidth_gb_s=bw / 1e9,
                hf_tok_s=new_tokens / statistics.median(times["transformers"]), rows=rows, formats=formats,
                anchor=anchor)


def load_hf_same_weights(path):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError("the decode benchmark compares with transformers: pip install transformers") from e
    path = str(path)
    if path.endswith(".gguf"):
        import os
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def decode_table(r: dict) -> str:
    first = r["formats"][0]
    out = [machine_line(), "", f"transformers `generate` (fp32): {r['hf_tok_s']:.1f} tok/s; GEMV bandwidth {r['bandwidth_gb_s']:.1f} GB/s; "
           f"{r['prompts']} chat prompts x {r['new_tokens']} new tokens",
           "",
           "| weights | ours tok/s | vs transformers | ms/step | bound ms/step (weight MB / bandwidth) | of bound "
           f"| tokens = transformers | tokens = ours {first} | first divergence from transformers (index: fp32 top-2 margin) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        div = ", ".join(f"{d['index']}: {d['margin']:.4f}" for d in row["divergences"] if d) or "-"
        out.append(f"| {row['weights']} | {row['tok_s']:.1f} | {row['tok_s'] / r['hf_tok_s']:.2f}x | {row['step_ms']:.1f} | "
                   f"{row['bound_step_ms']:.1f} ({row['weight_mb']:.0f} MB) | {row['bound_step_ms'] / row['step_ms']:.0%} | "
                   f"{sum(row['equal_hf'])}/{len(row['equal_hf'])} | {sum(row['equal_fp32'])}/{len(row['equal_fp32'])} | {div} |")
    if r.get("anchor"):
        out += ["", anchor_table(r["anchor"])]
    else:
        out += ["", "(no llama.cpp column: pip install -e .[bench] builds llama-cpp-python from source)"]
    return "\n".join(out)


# --------------------------------------------------------------------------------- speculative decode
class DraftRecorder:
    """Wraps a drafter; records, per round, the position of the pending token and the rank-0 candidate of
    every depth (the node with path (0,)*d), so the per-depth draft accuracy can be scored afterwards
    against the (lossless, hence plain-greedy) output."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rounds: list[tuple[int, list[int]]] = []

    def __getattr__(self, name: str):
        """Every other member of the Drafter protocol is the wrapped drafter's (`fused`, `fused_rows`, ...)."""
        return getattr(self.inner, name)

    def propose(self, ctx):
        draft = self.inner.propose(ctx)
        tree = getattr(draft, "tree", None) or ctx.tree  # a dynamic draft carries its own tree
        nodes, _ = draft_node_tokens(draft, tree)
        index = {p: i for i, p in enumerate(tree.paths)}
        top = [int(nodes[index[(0,) * d]]) for d in range(1, tree.max_depth + 1) if (0,) * d in index]
        self.rounds.append((len(ctx.tokens) - 1, top))
        return draft

    def accuracy(self, full: list[int], depth: int) -> tuple[list[int], list[int]]:
        """(hits, counts) per depth: rank-0 candidate at depth d == the output token at pending + d."""
        hits, counts = [0] * depth, [0] * depth
        for pos, top in self.rounds:
            for d, tok in enumerate(top[:depth], start=1):
                if pos + d < len(full):
                    counts[d - 1] += 1
                    hits[d - 1] += int(tok == full[pos + d])
        return hits, counts


def heldout_chats(tok, max_prompts: int, prompts: str = "scaled") -> list[list[int]]:
    """Chat-encoded held-out prompts of the prompt set, spread over its categories (`heldout_texts`)."""
    return [tok.encode_chat([{"role": "user", "content": text}]) for text in heldout_texts(max_prompts, prompts)]


def heldout_texts(max_prompts: int, prompts: str = "scaled") -> list[str]:
    """Held-out prompts of the prompt set, spread over its categories (round-robin in prompt-set order):
    "scaled" (the held-out split of `prompt_recipe`, 12 categories) or "base" (`prompts.prompt_set`)."""
    if prompts not in ("scaled", "base"):
        raise ValueError(f"prompts must be 'scaled' or 'base', got {prompts!r}")
    if prompts == "scaled":
        held = [p for p in load_scaled() if p.split == "heldout"]
    else:
        held = [p for p in prompt_set() if p.split == "heldout"]
    by_cat: dict[str, list] = {}
    for p in held:
        by_cat.setdefault(p.category, []).append(p)
    chosen = []
    while len(chosen) < min(max_prompts, len(held)):
        for cat in list(by_cat):
            if by_cat[cat] and len(chosen) < max_prompts:
                chosen.append(by_cat[cat].pop(0))
    return [p.text for p in chosen]


def bench_speculative(model_name: str = "smollm2-135m", drafts: dict[str, str] | None = None,
                      layer_skip: tuple[int, int] | None = None, tree: str = "chain", nodes: int = 10,
                      new_tokens: int = 64, max_prompts: int = 12, weights: str = "fp32",
                      compare_transformers: bool = True, progress: bool = True, prompts: str = "scaled") -> dict:
    """Speculative decoding per method on held-out prompts of the prompt set (batch 1, greedy, stop at
    end of turn): tau, per-depth draft top-1 accuracy, tokens/s, speedup over our plain decoding and over
    transformers `generate` and over llama.cpp's plain greedy decoding (same GGUF and threads, the same
    number of new tokens per prompt as our plain output; when llama-cpp-python is installed), and whether
    every output equals plain greedy decoding. prompts: "scaled" (the held-out split of
    `prompt_recipe`, 12 categories) or "base" (that of `prompts.prompt_set`).

    drafts: label -> draft directory (train-draft output); "<label>-separate" rows are added for hidden
    transfer (drafting with a separate forward instead of the fused one), "<label>-dynamic" rows for EAGLE
    (EAGLE-2's dynamic tree within the same node budget), with tree "auto" a "<label>-steps" row for every
    drafter a continuous batch runs (every kind of ours: `registry.batch_drafting`): a one-row continuous batch
    drafting a chain each step as deep as pays, what `generate` runs for lookup with tree auto; no per-depth top-1
    there. layer_skip (a, b): a layer-skip drafter skipping blocks a..b-1. tree: "chain" (the top-1 chain of depth
    k) or "sparse" (the `nodes` nodes of highest estimated acceptance, `DraftTree.greedy_from_accuracies` on the
    draft's held-out per-rank accuracies; drafters without them -- early exit, layer skip -- use hidden
    transfer's tree, or Medusa's, so every method runs the same tree size) or "auto" (per drafter, `tree_cost.auto_tree`: the
    tree of highest expected tokens/s from those accuracies and this machine's measured row costs).
    Phases: the methods (`speculative_methods`), their trees (`method_tree`), the anchors (transformers,
    llama.cpp), each prompt through every side (`_bench_prompt`), the table (`_speculative_rows`).
    """
    if new_tokens < 1 or max_prompts < 1 or nodes < 1:
        raise ValueError(f"new_tokens, max_prompts and nodes must be >= 1, got {new_tokens}, {max_prompts}, {nodes}")
    if prompts not in ("scaled", "base"):
        raise ValueError(f"prompts must be 'scaled' or 'base', got {prompts!r}")
    model, tok = load_pretrained(model_name)
    model = compress_weights(model, weights).eval()
    stop = tuple(sorted(tok.eos_ids))
    encoded = heldout_chats(tok, max_prompts, prompts)
    methods, own_acc, depth = speculative_methods(model, drafts, layer_skip, encoded)
    stepwise: dict[str, dict] = {}  # "-steps" rows: label -> ContinuousBatch arguments
    if tree == "auto":  # a one-row continuous batch drafting each step as deep as pays, after its drafter's row
        # (what `generate --draft lookup` runs with tree auto)
        for label, (d, _) in list(methods.items()):
            if label.endswith(("-separate", "-dynamic")):
                continue
            acc = own_acc.get(label)
            drafting = batch_drafting(d, 1, acc[0][0] if acc and not isinstance(d, PromptLookupDrafter) else None)
            if drafting:
                stepwise[f"{label}-steps"] = drafting
        methods = {name: m for label, m in methods.items()
                   for name in ([label, f"{label}-steps"] if f"{label}-steps" in stepwise else [label])}
    costs = row_costs(model, model_name, weights, progress=progress) if tree == "auto" else None
    hf = load_hf_same_weights(resolve_pretrained(model_name).path) if compare_transformers else None
    anchor = None
    src = str(resolve_pretrained(model_name).path)
    if src.endswith(".gguf"):
        try:
            anchor = LlamaCppAnchor(src, torch.get_num_threads(), n_ctx=max(map(len, encoded)) + new_tokens + 8)
        except ImportError:
            pass
    if hf is not None:
        hf.generation_config.pad_token_id = stop[0]
    warm = encoded[0][:8]
    generate(model, [warm], GenerationConfig(max_new_tokens=4))
    rows: dict[str, dict] = {name: dict(time=0.0, tokens=0, forwards=0, equal=0, hits=[0] * depth,
                                        counts=[0] * depth, tree=None) for name in ["plain", *methods]}
    if hf is not None:
        rows["transformers"] = dict(time=0.0, tokens=0, equal=0)
    if anchor is not None:
        rows["llama.cpp"] = dict(time=0.0, tokens=0, equal=0)
        anchor.run(warm, 4)  # warm-up, as ours above
    # once per method (auto measures)
    trees = {label: method_tree(tree, label, k, depth, nodes, own_acc, model, methods[label][0], costs, encoded[0])
             for label, (_, k) in methods.items() if label not in stepwise}
    for ids in (tqdm(encoded, desc="bench decode", unit="prompt") if progress else encoded):
        _bench_prompt(model, ids, rows, methods, trees, GenerationConfig(max_new_tokens=new_tokens, stop_tokens=stop),
                      hf, anchor, depth, stepwise)
    return dict(model=model_name, weights=weights, prompts=len(encoded), prompt_set=prompts, new_tokens=new_tokens,
                tree=tree, nodes=nodes, rows=_speculative_rows(rows, len(encoded)),
                llama_cpp_version=getattr(anchor, "version", None))


def speculative_methods(model, drafts: dict[str, str] | None, layer_skip: tuple[int, int] | None,
                        prompts: Sequence[Sequence[int]] = ()) -> tuple[dict[str, tuple], dict[str, list], int]:
    """label -> (drafter, draft depth k) for every draft directory and its variants (a fused drafter's separate
    pass, "-separate"; a drafter with an unused expansion width, EAGLE-2's dynamic tree, "-dynamic"), prompt
    lookup (path "lookup"; its accuracies the mean of `self_accuracies` over `prompts`), and the layer-skip
    drafter; each draft's held-out per-rank accuracies; the deepest depth (at least 3)."""
    methods: dict[str, tuple] = {}  # drafters keep no per-run state
    own_acc: dict[str, list] = {}  # label -> its held-out per-rank accuracies (depth 1 only for early exit)
    for label, path in (drafts or {}).items():
        if path == "lookup":
            d = PromptLookupDrafter(model.cfg.vocab_size)
            accs = [d.self_accuracies(p) for p in prompts] or [d.self_accuracies([])]
            own_acc[label] = [[sum(a[i][r] for a in accs) / len(accs) for r in range(len(accs[0][i]))]
                              for i in range(len(accs[0]))]
            methods[label] = (d, d.draft_steps())
            continue
        d, module, meta = load_drafter(path, model)
        acc = heldout_accuracies(meta, str(path))
        k = d.draft_steps() or len(acc or [])
        methods[label] = (d, k)
        if acc:
            own_acc[label] = acc
        if d.fused:
            methods[f"{label}-separate"] = (type(d)(model, module, fused=False), k)
        if d.dynamic_k == 0:  # EAGLE-2's dynamic tree within the same node budget
            methods[f"{label}-dynamic"] = (type(d)(model, module, dynamic_k=4), k)
    depth = max([k for _, k in methods.values()] + [3])
    if layer_skip is not None:
        a, b = layer_skip
        methods[f"layer-skip {a}-{b - 1}"] = (LayerSkipDrafter(model, range(a, b)), depth)
    return methods, own_acc, depth


def method_tree(tree: str, label: str, k: int, depth: int, nodes: int, own_acc: dict[str, list], model, drafter,
                costs, prompt: list[int]) -> DraftTree:
    """The tree `bench_speculative` runs a method with (its `tree` argument: chain, sparse or auto)."""
    if tree == "chain":
        return DraftTree.chain(k if k > 1 else depth)
    own = label.removesuffix("-separate").removesuffix("-dynamic")
    accs = {lab: a for lab, a in own_acc.items() if len(a) > 1}  # every depth measured (sparse trees)
    src = accs.get(own) or next(iter(accs.values()), None)
    if tree == "auto":
        src = own_acc.get(own) or src
    if src is None:
        raise ValueError(f"tree {tree!r} needs a draft with held-out per-rank accuracies (hidden transfer or Medusa)")
    if tree == "auto":  # priced with what this drafter's rounds really cost beyond their forwards
        over = measure_overhead(model, drafter, costs, prompt)
        return auto_tree(model, drafter, src, costs, max_depth=k if k > 1 else depth, overhead=over)[0]
    return DraftTree.greedy_from_accuracies(src, nodes)


def _bench_prompt(model, ids: list[int], rows: dict[str, dict], methods: dict[str, tuple],
                  trees: dict[str, DraftTree], gcfg: GenerationConfig, hf, anchor, depth: int,
                  stepwise: dict[str, dict] | None = None) -> None:
    """One prompt through plain decoding, the anchors and every method, added to `rows`; the `stepwise`
    methods (the "-steps" rows: label -> ContinuousBatch arguments) in a one-row continuous batch instead of the
    speculative loop."""
    stepwise = stepwise or {}
    t = time.perf_counter()
    plain = generate(model, [ids], gcfg)[0]
    rows["plain"]["time"] += time.perf_counter() - t
    rows["plain"]["tokens"] += len(plain)
    rows["plain"]["forwards"] += len(plain)
    rows["plain"]["equal"] += 1
    if hf is not None:
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gcfg.max_new_tokens,
                              do_sample=False, eos_token_id=list(gcfg.stop_tokens))[0, len(ids):].tolist()
        rows["transformers"]["time"] += time.perf_counter() - t
        rows["transformers"]["tokens"] += len(out)
        rows["transformers"]["equal"] += int(out == plain)
    if anchor is not None and plain:
        t = time.perf_counter()
        _, _, out = anchor.run(ids, len(plain))  # prefill + as many greedy tokens as ours, no stop
        rows["llama.cpp"]["time"] += time.perf_counter() - t
        rows["llama.cpp"]["tokens"] += len(plain)
        rows["llama.cpp"]["equal"] += int(out == plain)
    for label, (drafter, k) in methods.items():
        if label in stepwise:  # a one-row continuous batch (as `generate` runs prompt lookup with tree auto)
            batch = ContinuousBatch(model, 1, **stepwise[label])
            t = time.perf_counter()
            seq, steps = batch.alone(ids, gcfg)
            out = [tok for tokens in steps for tok in tokens]
            r = rows[label]
            r["time"] += time.perf_counter() - t
            r["tokens"] += len(out)
            r["forwards"] += seq.base_forwards
            r["equal"] += int(out == plain)
            continue
        rec = DraftRecorder(drafter)
        tr = trees[label]
        rows[label]["tree"] = len(tr)
        t = time.perf_counter()
        out, stats = speculative_generate(model, ids, rec, tr, gcfg.max_new_tokens, stop_tokens=gcfg.stop_tokens)
        r = rows[label]
        r["time"] += time.perf_counter() - t
        r["tokens"] += len(out)
        r["forwards"] += stats.base_forwards
        r["equal"] += int(out == plain)
        h, c = rec.accuracy(list(ids) + out, depth)
        r["hits"] = [x + y for x, y in zip(r["hits"], h)]
        r["counts"] = [x + y for x, y in zip(r["counts"], c)]


def _speculative_rows(rows: dict[str, dict], n_prompts: int) -> list[dict]:
    plain_tps = rows["plain"]["tokens"] / rows["plain"]["time"]
    hf_tps = rows["transformers"]["tokens"] / rows["transformers"]["time"] if "transformers" in rows else None
    lc_tps = rows["llama.cpp"]["tokens"] / rows["llama.cpp"]["time"] if "llama.cpp" in rows else None
    table = []
    for name, r in rows.items():
        tps = r["tokens"] / r["time"]
        table.append(dict(method=name, tree_nodes=r.get("tree"),
                          tau=r["tokens"] / r["forwards"] if r.get("forwards") else None,
                          top1=[round(h / c, 3) if c else None for h, c in zip(r.get("hits", []), r.get("counts", []))],
                          tok_s=tps, vs_plain=tps / plain_tps, vs_hf=tps / hf_tps if hf_tps else None,
                          vs_llama_cpp=tps / lc_tps if lc_tps else None, lossless=f"{r['equal']}/{n_prompts}"))
    return table


def speculative_table(r: dict) -> str:
    out = [machine_line(), "", f"{r['model']} ({r['weights']} weights), {r['prompts']} held-out chat prompts ({r.get('prompt_set', 'base')} set), up to {r['new_tokens']} "
           f"new tokens, batch 1, greedy; tree: {r['tree']}" + (f" ({r['nodes']} nodes)" if r['tree'] == 'sparse' else ""),
           "",
           "| method | tree nodes | tau | draft top-1 by depth | tok/s | vs our plain | vs transformers | vs llama.cpp "
           "| output = plain greedy |",
           "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        tau = f"{x['tau']:.2f}" if x["tau"] else "-"
        top1 = ", ".join("-" if a is None else f"{a:.2f}" for a in x["top1"]) or "-"
        vs_hf = f"{x['vs_hf']:.2f}x" if x["vs_hf"] else "-"
        vs_lc = f"{x['vs_llama_cpp']:.2f}x" if x.get("vs_llama_cpp") else "-"
        out.append(f"| {x['method']} | {x['tree_nodes'] or '-'} | {tau} | {top1} | {x['tok_s']:.1f} | "
                   f"{x['vs_plain']:.2f}x | {vs_hf} | {vs_lc} | {x['lossless']} |")
    return "\n".join(out)


ROWS, ROWS_CONTEXT = (1, 2, 4, 8, 16, 32), 128  # `bench_rows`' row counts and the context they follow


def bench_rows(model_name: str = "smollm2-135m", formats: tuple[str, ...] = ("q4", "fp32", "bf16", "int4"),
               rows: tuple[int, ...] = ROWS, context: int = ROWS_CONTEXT, repeats: int = 5) -> dict:
    """Time of one cached forward over T new rows (after a `context`-token prefill) per weight format: what
    a verification round costs relative to a one-token decode step. Speculative decoding's speedup is at
    most tau / (cost of its forward / cost of one step)."""

    out: dict = {"model": model_name, "context": context, "rows": list(rows), "ms": {}}
    base = load_pretrained(model_name)[0]
    for fmt in formats:
        model = compress_weights(copy.deepcopy(base), fmt).eval()
        ids = torch.randint(0, model.cfg.vocab_size, (1, context + max(rows)), generator=torch.Generator().manual_seed(0))
        cache = KVCache.for_model(model.cfg, 1, context + max(rows), dtype=kv_dtype(model))
        forward_cached(model, ids[:, :context], cache, torch.arange(context)[None], last_only=True)
        def step(T: int) -> float:
            cache.truncate(context)
            t0 = time.perf_counter()
            forward_cached(model, ids[:, context:context + T], cache, torch.arange(context, context + T)[None])
            return time.perf_counter() - t0

        for T in rows:
            step(T)  # warm-up
        samples: dict[int, list[float]] = {T: [] for T in rows}
        for _ in range(repeats):  # interleaved: drift on a shared machine hits every T alike
            for T in rows:
                samples[T].append(step(T))
        out["ms"][fmt] = [1e3 * statistics.median(samples[T]) for T in rows]
    return out


def long_prompts(tok, lengths: tuple[int, ...]) -> list[list[int]]:
    """Chat prompts of about `lengths` tokens: "Summarise this passage" over a stretch of the embedded corpus
    (the same text for every length, cut at a line boundary), chat template included."""

    lines = corpus_documents()[0][1].splitlines()
    out = []
    for n in lengths:
        words: list[str] = []
        for line in lines:
            words.append(line)
            if len(tok.encode("\n".join(words))) >= n - 30:  # room for the instruction and the template
                break
        out.append(tok.encode_chat([{"role": "user", "content": "Summarise this passage:\n\n" + "\n".join(words)}]))
    return out


def bench_prefill(model_name: str = "smollm2-135m", fmt: str = "q4", lengths: tuple[int, ...] = (64, 256, 700),
                  repeats: int = 3) -> dict:
    """Prefill only (the prompt's forward into an empty cache), ours in `fmt` vs llama.cpp on the same GGUF
    and threads, interleaved per repeat; seconds per prompt (median) and tokens/s. Without llama-cpp-python
    the llama.cpp columns are empty."""

    base, tok = load_pretrained(model_name)
    model = compress_weights(base, fmt).eval()
    encoded = long_prompts(tok, lengths)
    anchor = None
    src = str(resolve_pretrained(model_name).path)
    if src.endswith(".gguf"):
        try:
            anchor = LlamaCppAnchor(src, torch.get_num_threads(), n_ctx=max(map(len, encoded)) + 8)
        except ImportError:
            pass
    rows = []
    for ids in encoded:
        ours_run(model, ids, 1)  # warm-up
        if anchor is not None:
            anchor.run(ids, 1)
        t_ours, t_ref = [], []
        for _ in range(repeats):
            t_ours.append(ours_run(model, ids, 1)[0])
            if anchor is not None:
                t_ref.append(anchor.run(ids, 1)[0])
        row = dict(tokens=len(ids), ours_s=statistics.median(t_ours))
        if t_ref:
            row["llama_s"] = statistics.median(t_ref)
        rows.append(row)
    return dict(model=model_name, weights=fmt, rows=rows, llama_cpp_version=getattr(anchor, "version", None))


def prefill_table(r: dict) -> str:
    out = [machine_line(), "", f"{r['model']} prefill, ours ({r['weights']} weights) vs llama.cpp "
           f"(llama-cpp-python {r['llama_cpp_version']}, same GGUF, same threads), median of interleaved repeats", "",
           "| prompt tokens | ours s | ours tok/s | llama.cpp s | llama.cpp tok/s | ours tok/s / llama.cpp's |",
           "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        n, a = row["tokens"], row["ours_s"]
        b = row.get("llama_s")
        ref = f"{b:.3f} | {n / b:.0f} | {b / a:.2f}x" if b else "- | - | -"
        out.append(f"| {n} | {a:.3f} | {n / a:.0f} | {ref} |")
    return "\n".join(out)


def rows_table(r: dict) -> str:
    out = [machine_line(), "", f"{r['model']}: one cached forward over T new rows after a {r['context']}-token context, ms (and x the "
           "one-row step)", "", "| weights | " + " | ".join(f"T={t}" for t in r["rows"]) + " |",
           "|---|" + "---|" * len(r["rows"])]
    for fmt, ms in r["ms"].items():
        out.append(f"| {fmt} | " + " | ".join(f"{m:.1f} ({m / ms[0]:.2f}x)" for m in ms) + " |")
    return "\n".join(out)


__all__ = ["bench_skipping", "skipping_table", "bench_decode", "decode_table", "gemv_bandwidth",
           "force_skip_fraction", "first_divergence", "bench_speculative", "speculative_table", "DraftRecorder",
           "bench_rows", "rows_table", "bench_prefill", "prefill_table"]


# ================================================================================ skip gates (issue 15)
def static_skip_gates(model: Transformer, first: int | None, adapters: SkipGates | None = None) -> SkipGates:
    """Skip gates that make EVERY token skip the span [first, L-1-first]: router `first` has bias 1 (S = 1,
    gate 0 there, eq. 2), every other router is 0. The static layer-skip baseline then runs through the
    same engine, real skipping and all, as the learned gates it is compared with.

    `adapters`: trained `SkipGates` whose low-rank adapters (if any) the static skip shares, not copies -- the
    static skip of an adapted model; their routers are not used. `first=None` skips nothing (every gate 1):
    with adapters, the adapted model itself."""

    L = model.cfg.n_layers
    if first is not None and not 0 <= first < L // 2:
        raise ValueError(f"a static skip starts at a routed block, 0 <= first < {L // 2}, got {first}")
    rank = adapters.lora_rank if adapters is not None else 0
    gates = SkipGates.for_model(model, **({"lora_rank": rank, "lora_alpha": adapters.lora_alpha} if rank else {}))
    if rank:
        gates.lora = adapters.lora  # shared: the twin's LowRankLinear borrows these very parameters
    with torch.no_grad():
        if first is not None:
            gates.routers[first].bias.fill_(1.0)
    gates.calibrated.fill_(True)  # nothing to calibrate: the weights are 0
    return gates.eval()


def static_first_for(n_layers: int, skipped_frac: float) -> int:
    """The static span [a, L-1-a] closest in size to a mean skipped share of the L blocks: L - 2a ~ f L
    (equal compute in the blocks; ties to the smaller span). a <= L/2 - 1: at least the innermost pair."""
    want = skipped_frac * n_layers
    best = min(range(n_layers // 2), key=lambda a: (abs((n_layers - 2 * a) - want), -a))
    return best


def bench_gates(model_name: str, gates: dict[str, str], data, static: str = "auto", prompts: int = 8,
                new_tokens: int = 64, weights: str = "q4", seq_len: int = 384, records: int = 64,
                model: Transformer | None = None) -> dict:
    """Learned skip gates vs the dense model and static layer skipping (issue 15), on held-out records and
    prompts of a distillation file (never trained on):
      * quality, teacher-forced on `records` held-out records (response positions): KL to the dense model,
        greedy-token agreement (gated argmax = dense argmax), per-block share of gates exactly 0;
      * generation, greedy, `prompts` held-out prompts: tokens until the first divergence from the dense
        model's output, and prefill / decode wall time with real skipping, interleaved variant by variant
        per prompt, as speedups over dense, against the FLOPs model's prediction at the measured sparsity.
    static: "auto" (for each gates variant the static span of nearest compute), "none", or comma-separated
    first blocks a (span [a, L-1-a]). `data`: a distillation file or a DistillSet; `model`: the loaded base
    (tests), else `model_name` is loaded in the `weights` format."""

    if model is None:
        model = compress_weights(load_pretrained(model_name)[0].float(), weights)
    model.eval()
    L = model.cfg.n_layers
    ds = data if isinstance(data, DistillSet) else DistillSet.load(data)
    held = response_batches(ds, seq_len, records)
    plist = [r.prompt_ids for r in ds.split("heldout")][:prompts]
    if not held or not plist:
        raise ValueError(f"{data}: no held-out records")
    variants: dict[str, SkipGates | None] = {"dense": None}
    for label, path in gates.items():
        module, _ = load_draft(path, model)
        if not isinstance(module, SkipGates):
            raise ValueError(f"{label}={path}: a {type(module).__name__} draft, not a train-gates output")
        variants[label] = module.eval()
    cfg = DraftTrainConfig(method="gates", bf16=False)
    quality: dict[str, dict] = {}
    for label, g in list(variants.items()):
        if g is not None:
            quality[label] = heldout_metrics(cfg, model, g, held)
    if static == "auto":
        firsts = sorted({static_first_for(L, q["skipped_blocks_frac"]) for q in quality.values()})
    elif static in ("none", ""):
        firsts = []
    else:
        firsts = [int(x) for x in static.split(",")]
    for a in firsts:
        label = f"static-skip {a}-{L - 1 - a}"
        variants[label] = static_skip_gates(model, a)
        quality[label] = heldout_metrics(cfg, model, variants[label], held)
    # routers at 0 (every gate 1, nothing skipped): the gated engine's own cost per token, the overhead any
    # skipping must first pay back (its outputs are the dense model's, bit for bit)
    variants["open gates (overhead)"] = SkipGates.for_model(model).eval()
    quality["open gates (overhead)"] = heldout_metrics(cfg, model, variants["open gates (overhead)"], held)
    twins = {label: model if g is None else g.twin(model) for label, g in variants.items()}
    runs: dict[str, list[tuple[float, float, list[int]]]] = {label: [] for label in twins}
    for ids in plist:
        ours_run(model, ids, 2)  # warm-up
        for label, m in twins.items():  # interleaved per prompt: drift hits every variant alike
            runs[label].append(ours_run(m, ids, new_tokens))
    dense_runs = runs["dense"]
    pre_dense = sum(r[0] for r in dense_runs)
    dec_dense = statistics.mean(r[1] for r in dense_runs)
    mean_prompt = round(statistics.mean(len(p) for p in plist))
    rows = []
    for label, m in twins.items():
        q = quality.get(label, {})
        first_div = []
        for (_, _, out), (_, _, ref) in zip(runs[label], dense_runs):
            first_div.append(common_prefix(out, ref))
        sparsity = q.get("gate_zero", [0.0] * L)[: L // 2]
        pred_pre = pred_dec = 1.0
        if m.cfg.gating:  # against the dense model's FLOPs, as the measured speedups are (routers included)
            ctx = mean_prompt + new_tokens // 2
            pred_pre = forward_flops(model.cfg, mean_prompt).total / forward_flops(m.cfg, mean_prompt, sparsity).total
            pred_dec = decode_flops(model.cfg, ctx).total / decode_flops(m.cfg, ctx, sparsity).total
        rows.append(dict(
            variant=label, kl=q.get("kl", 0.0), agreement=q["top1"][0] if q else 1.0,
            skipped_blocks_frac=q.get("skipped_blocks_frac", 0.0), gate_zero=sparsity,
            tokens_to_divergence=statistics.mean(first_div),
            prefill_speedup=pre_dense / sum(r[0] for r in runs[label]), prefill_pred=pred_pre,
            decode_ms=1e3 * statistics.mean(r[1] for r in runs[label]),
            decode_speedup=dec_dense / statistics.mean(r[1] for r in runs[label]), decode_pred=pred_dec))
    return dict(model=model_name, weights=weights, data=str(data) if not isinstance(data, DistillSet) else "given",
                prompts=len(plist), records=len(held),
                new_tokens=new_tokens, mean_prompt_tokens=mean_prompt, rows=rows)


def gates_table(r: dict) -> str:
    out = [machine_line(), "", f"{r['model']} ({r['weights']} weights); quality on {r['records']} held-out records "
           f"(teacher-forced, response positions); speed on {r['prompts']} held-out prompts (mean "
           f"{r['mean_prompt_tokens']} tokens) + {r['new_tokens']} greedy tokens, batch 1, real skipping", "",
           "| variant | KL to dense | greedy-token agreement | blocks skipped | tokens to first divergence | "
           "prefill speedup real / FLOPs | decode ms/token | decode speedup real / FLOPs |",
           "|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        out.append(f"| {x['variant']} | {x['kl']:.4f} | {x['agreement']:.3f} | {x['skipped_blocks_frac']:.1%} | "
                   f"{x['tokens_to_divergence']:.1f} | {x['prefill_speedup']:.2f}x / {x['prefill_pred']:.2f}x | "
                   f"{x['decode_ms']:.1f} | {x['decode_speedup']:.2f}x / {x['decode_pred']:.2f}x |")
    return "\n".join(out)

"""The static decode step's benchmark (issue 42): our plain and speculative decoding through `decode_step`
(eager, captured in CUDA graphs, torch.compile) beside the dynamic engine and beside transformers with a
static cache and its one-token step compiled with CUDA graphs, the recipe of gpt-fast. All in one run, the
sides interleaved per prompt. Batch 1, greedy, a fixed number of new tokens (no stop token on any side, so
every side decodes as many tokens), decode time only (the prefill is timed apart and left out).

Reported per row: ms per new token, its ratio to the recipe's, tau (new tokens per base forward) and how
many outputs equal our plain greedy output of the same dtype token for token; plus the GPU, the CPU, the
library versions and whether the step's buckets were measured row-invariant.

    midlayer bench static --device cuda             # or: midlayer bench decode --device cuda
    midlayer bench static --device cpu --dtypes fp32 --new-tokens 32 --max-prompts 2   # the same on a CPU
"""

from __future__ import annotations

import copy
import platform
import time
from typing import Sequence

import torch
from tqdm import tqdm

from midlayer.common import device_sync
from midlayer.engine.decode_step import any_round_slots, BUCKET_CANDIDATES, DecodeStep, static_stream, triton_kernels
from midlayer.engine.generate import generate_stream, GenerationConfig
from midlayer.engine.pretrained import load_pretrained, resolve_pretrained
from midlayer.engine.quantization import fuse_projections
from .bench import heldout_chats, load_hf_same_weights
from midlayer.model.transformer import Transformer
from midlayer.ops.kernels import cpu_info
from midlayer.speculative.registry import heldout_accuracies, load_drafter
from midlayer.speculative.static import fused_per_step, fused_steps, round_kinds, static_speculative_generate
from midlayer.speculative.tree import DraftTree

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RECIPE = "transformers StaticCache + compiled step (CUDA graphs on CUDA)"
RECIPE_READ = "the recipe, reading each token to the host"
DEFAULT_DRAFTS = {"eagle": "drafts/smollm2-135m-scale/eagle", "medusa": "drafts/smollm2-135m-scale/medusa",
                  "hidden-transfer": "drafts/smollm2-135m-scale/hidden-transfer"}


class HFRecipe:
    """transformers' model with a `StaticCache` and its one-token forward compiled with fullgraph=True and, on
    CUDA, mode="reduce-overhead" (CUDA graphs): the gpt-fast recipe. One cache for every prompt (reset
    between them), so the step compiles once."""

    def __init__(self, hf, max_len: int) -> None:
        import inspect

        from transformers import StaticCache

        self.hf, self.dev = hf, hf.device
        try:
            self.cache = StaticCache(config=hf.config, max_cache_len=max_len, device=self.dev, dtype=hf.dtype)
        except TypeError:  # transformers 5.x: allocated lazily on the first update, where the keys are
            self.cache = StaticCache(config=hf.config, max_cache_len=max_len)
        params = inspect.signature(hf.forward).parameters
        # the cache's keyword: `past_key_values`, deprecated for `cache` in late 5.x; cache_position where taken
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.with_pos = "cache_position" in params
        self.positions = torch.arange(max_len, device=self.dev)  # slices of one tensor: no copy per token

        def one_token(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return hf(input_ids=tok, use_cache=True, **self._kw(pos)).logits[:, -1]

        mode = "reduce-overhead" if self.dev.type == "cuda" else None
        self.step = torch.compile(one_token, mode=mode, fullgraph=True)

    def _kw(self, pos: torch.Tensor) -> dict:
        return {self.cache_kw: self.cache, **({"cache_position": pos} if self.with_pos else {})}

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """A new sequence: `ids` through the eager model into the reset cache; the greedy next token [1, 1]."""
        self.cache.reset()
        x = torch.tensor([ids], device=self.dev)
        logits = self.hf(input_ids=x, use_cache=True, **self._kw(self.positions[:len(ids)])).logits[:, -1]
        return logits.argmax(-1, keepdim=True)

    def next(self, tok: torch.Tensor, pos: int) -> torch.Tensor:
        """One compiled step: token `tok` [1, 1] at position `pos`; the greedy next token [1, 1] (on the device).
        Call it under torch.no_grad(), as `run` does: a grad-mode switch per token would sit in the timed loop."""
        return self.step(tok, self.positions[pos:pos + 1]).argmax(-1, keepdim=True)

    @torch.no_grad()
    def run(self, ids: list[int], new_tokens: int, read_each: bool = False) -> tuple[list[int], float]:
        """(new tokens, decode seconds per token after the first). The recipe's loop reads no token until the
        end (gpt-fast's); `read_each`: it reads each token to the host as it comes, as a streaming or
        stop-token check must, and as our plain loop does (one step queued ahead: `DecodeStep.run_ahead`)."""
        P = len(ids)
        tok = self.prefill(ids)
        out = [tok]
        device_sync(self.dev)
        t = time.perf_counter()
        for i in range(new_tokens - 1):
            tok = self.next(tok, P + i)
            out.append(tok)
            if read_each:
                int(out[-2][0, 0])  # the token before: the step just queued keeps the GPU busy meanwhile
        device_sync(self.dev)
        dt = time.perf_counter() - t
        return torch.cat(out, 1)[0].tolist(), dt / max(new_tokens - 1, 1)


def _decode_timed(stream) -> tuple[list[int], float]:
    """Drain a token stream; (tokens, seconds per token after the first): the first token comes with the
    prefill, every later one from a decode step (the streams read each token to the host, so this is synced)."""
    out = [next(stream)]
    t = time.perf_counter()
    out += list(stream)
    return out, (time.perf_counter() - t) / max(len(out) - 1, 1)


def _prefill_s(step: DecodeStep, ids: list[int]) -> float:
    """Seconds the step's prefill of `ids` takes (the part a speculative call spends before its rounds)."""
    step.reset()
    device_sync(step.device)
    t = time.perf_counter()
    step.prefill(torch.tensor([ids], device=step.device))
    device_sync(step.device)
    dt = time.perf_counter() - t
    step.reset()
    return dt


def machine_lines(dev: torch.device) -> list[str]:
    import transformers

    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "no GPU"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = cpu_info().summary()
    except Exception:  # pragma: no cover - informational only
        pass
    return [f"device: {dev} ({gpu}); CPU: {cpu}",
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}"]


def bench_static(model_name: str = "smollm2-135m", device: str | None = None, dtypes: Sequence[str] = ("bf16", "fp32"),
                 drafts: dict[str, str] | None = None, nodes: int = 24, graphs: Sequence[str] | None = None,
                 new_tokens: int = 128, max_prompts: int = 7, compare_transformers: bool = True,
                 dynamic: bool = True, progress: bool = True, on_table=None, also_nodes: Sequence[int] = (),
                 eagle_k: int = 4, eagle_depth: int = 0, anchors: Sequence[int] = ()) -> dict:
    """The rows of the module docstring, per dtype. `graphs`: the step's modes to time (default: eager and
    cudagraph on CUDA, eager on a CPU); speculative rows run in the last of them. `drafts` (label -> a
    train-draft directory; default EAGLE, Medusa and hidden transfer of drafts/smollm2-135m-scale): EAGLE
    runs EAGLE-2's dynamic tree of `nodes` nodes, the others the `nodes` nodes their held-out accuracies rank
    first (hidden transfer fused: its pseudo rows ride every verification round); `also_nodes`: every
    drafter also at these tree sizes, in device rounds only (the issue asks for each drafter's best tree, and
    a smaller one may win where a round's cost grows with its rows: hidden transfer's 24-node tree with its
    3 pseudo blocks is a 128-row round); `anchors`: hidden transfer also with pseudo rows for this many rows of
    its tree only, at every tree size, in device rounds (`HiddenTransferDrafter`'s anchors: a 24-node tree with
    2 is a 32-row round); `eagle_k`, `eagle_depth`: EAGLE-2's tree (`static_methods`). `dynamic`:
    also time the dynamic engine (`generate`), the path this step replaces on a GPU. `on_table(result,
    dtype)`: called as each dtype's table is done (a run cut short keeps what it finished)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes: choose from {', '.join(DTYPES)}, got {list(dtypes)}")
    graphs = tuple(graphs or (("eager", "cudagraph") if dev.type == "cuda" else ("eager",)))
    if (new_tokens < 2 or max_prompts < 1 or min((nodes, *also_nodes)) < 1 or eagle_k < 1 or eagle_depth < 0
            or min(anchors, default=1) < 1):
        raise ValueError(f"new_tokens >= 2, max_prompts >= 1, nodes >= 1, eagle_k >= 1, eagle_depth >= 0, anchors "
                         f">= 1; got {new_tokens}, {max_prompts}, {nodes} {tuple(also_nodes)}, {eagle_k}, "
                         f"{eagle_depth}, {tuple(anchors)}")
    drafts = DEFAULT_DRAFTS if drafts is None else drafts
    base, tok = load_pretrained(model_name)
    encoded = heldout_chats(tok, max_prompts)
    hf_cpu = load_hf_same_weights(resolve_pretrained(model_name).path) if compare_transformers else None
    result = dict(model=model_name, device=str(dev), prompts=len(encoded), new_tokens=new_tokens,
                  prompt_tokens=[len(p) for p in encoded], machine=machine_lines(dev), tables={})
    errors = result.setdefault("errors", {})
    for dname in dtypes:
        # (the fp32 original stays on the CPU); fused as `generate` runs a model (quantization.fuse_projections)
        model: Transformer = fuse_projections(copy.deepcopy(base).to(dev, DTYPES[dname]).eval())
        result["tables"][dname] = _bench_dtype(model, dname, drafts, (nodes, *also_nodes), graphs, encoded,
                                               new_tokens, hf_cpu, dynamic, progress, errors, (eagle_k, eagle_depth),
                                               tuple(anchors))
        if on_table is not None:
            on_table(result, dname)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _cudagraph_skips() -> int:
    """How many compiled graphs Inductor has run without CUDA graphs so far (under mode="reduce-overhead" a
    graph it cannot capture, e.g. one mutating an input without a static address, runs kernel by kernel from
    the host: slow, and silent unless TORCH_LOGS=cudagraphs, which names the reason)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def static_methods(model: Transformer, drafts: dict[str, str], nodes: int, eagle_k: int = 4, eagle_depth: int = 0,
                   anchors: int = 0, loaded: dict | None = None) -> dict[str, tuple]:
    """label -> (drafter, tree): a drafter with an expansion width (EAGLE) runs EAGLE-2's dynamic tree of `nodes`
    nodes, expanding the `eagle_k` best at each of `eagle_depth` depths (0: as many as its held-out accuracies
    have, else 5); the others the `nodes` nodes their held-out accuracies rank first (else a 3-chain). With
    `anchors`, only the drafters with a fused pass (hidden transfer), their pseudo rows for that many rows.
    `loaded` (path -> (drafter, meta), kept between calls): a drafter with a fused pass is loaded once, and each
    call's is a copy of it, so all of a draft's rows share one transfer. A step keeps the captured rounds of two
    transfers only (`DecodeStep._use_transfer`): a bench whose rows of one draft each loaded their own
    transfer captured a round again inside its timed generations, prompt after prompt."""
    dtype = model.tok_embeddings.weight.dtype
    methods = {}
    for label, path in drafts.items():
        hit = None if loaded is None else loaded.get(path)
        if hit is None:
            drafter, _, meta = load_drafter(path, model, dtype=dtype)
            if loaded is not None and drafter.fused:
                loaded[path] = (drafter, meta)
        else:
            drafter, meta = copy.copy(hit[0]), hit[1]
        if anchors and not drafter.fused:
            continue
        drafter.anchors = anchors
        acc = heldout_accuracies(meta, str(path))
        if drafter.dynamic_k is not None:
            drafter.dynamic_k = k = min(eagle_k, nodes)
            depth = eagle_depth or (len(acc) if acc and len(acc) > 1 else 5)
            n = min(nodes, k + (depth - 1) * k * k)  # (no more nodes than candidates: the row's label says how many)
            tree = DraftTree.greedy_from_accuracies([[1.0 - 1e-3 * i for i in range(n)]] * depth, n)
        elif acc and len(acc) > 1:
            tree = DraftTree.greedy_from_accuracies(acc, nodes)
        else:
            tree = DraftTree.chain(3)
        methods[label] = (drafter, tree)
    return methods


def _bench_dtype(model: Transformer, dname: str, drafts: dict[str, str], sizes: tuple[int, ...],
                 graphs: tuple[str, ...],
                 encoded: list[list[int]], new_tokens: int, hf_cpu, dynamic: bool, progress: bool,
                 errors: dict[str, str], eagle: tuple[int, int] = (4, 0), anchors: tuple[int, ...] = ()) -> dict:
    """One dtype's table: the steps and the recipe built and warmed up, every prompt through every row."""
    dev, dtype = model.tok_embeddings.weight.device, DTYPES[dname]
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    methods = {}  # "label (n-node tree)" -> (drafter, tree, whether its host-drafted reference row runs too)
    loaded: dict = {}  # (a draft's rows share its transfer: `static_methods`)
    for n in dict.fromkeys(sizes):  # (a size that gives a tree already listed, e.g. a fallback chain, adds none)
        for label, (drafter, tree) in static_methods(model, drafts, n, *eagle, loaded=loaded).items():
            methods.setdefault(f"{label} ({len(tree)}-node tree)", (drafter, tree, n == sizes[0]))
        for a in anchors:  # (hidden transfer's pseudo rows for `a` of the tree's rows; device rounds only)
            for label, (drafter, tree) in static_methods(model, drafts, n, *eagle, anchors=a, loaded=loaded).items():
                if a <= len(tree):
                    methods.setdefault(f"{label} ({len(tree)}-node tree, {a} anchors)", (drafter, tree, False))
    # the committed text, then the largest round of any drafter under any bucket set the probe may choose
    rounds = [any_round_slots(len(t), fused_steps(d), per_step=fused_per_step(d, t)) for d, t, _ in methods.values()]
    max_len = max(len(p) for p in encoded) + new_tokens + max(rounds + [max(BUCKET_CANDIDATES[0])])
    steps = {g: DecodeStep(model, max_len=max_len, graphs=g) for g in graphs}
    spec_step = steps[graphs[-1]]
    alt = linear_kernel_step(model, spec_step, max_len)
    if alt is not None:
        steps[f"{graphs[-1]}, both kernels"] = alt
    hf = None
    skipped = _cudagraph_skips()
    if hf_cpu is not None:
        try:
            hf = HFRecipe(copy.deepcopy(hf_cpu).to(dev, dtype), max_len)
            hf.run(encoded[0], 4)  # compiles (and, on CUDA, records its graphs)
        except Exception as e:  # the anchor must not cost the rest of the run
            errors[f"{dname} {RECIPE}"] = f"{type(e).__name__}: {e}"
            hf = None
    skipped_recipe = _cudagraph_skips()  # (the recipe's graphs are all built by now: what follows is ours)
    _warm_up(model, steps, spec_step, methods, encoded, errors, dname)
    rows: dict[str, dict] = {}
    for ids in (tqdm(encoded, desc=f"bench static {dname}", unit="prompt") if progress else encoded):
        if hf is not None:
            _add_row(rows, RECIPE, *hf.run(ids, new_tokens))
            _add_row(rows, RECIPE_READ, *hf.run(ids, new_tokens, read_each=True))
        if dynamic:
            _add_row(rows, "midlayer dynamic (generate)", *_decode_timed(generate_stream_tokens(model, ids, cfg)))
        for g, st in steps.items():
            _add_row(rows, f"midlayer static, {g}", *_decode_timed(static_stream(model, ids, cfg, step=st)))
        for name, (drafter, tree, reference) in methods.items():
            for on_device in _kinds(spec_step, drafter, tree, reference):
                pre = _prefill_s(spec_step, ids[:-1]) if len(ids) > 1 else 0.0
                device_sync(dev)
                t = time.perf_counter()
                out, stats = static_speculative_generate(model, ids, drafter, tree, new_tokens, step=spec_step,
                                                         device_rounds=on_device)
                device_sync(dev)
                dt = time.perf_counter() - t - pre
                # its rounds make every new token (plain decoding's first comes with its prefill)
                kind = "device rounds" if on_device else "drafted on the host"
                _add_row(rows, f"{name}, {kind}, static {graphs[-1]}", out, dt / len(out),
                         len(out), stats.base_forwards)
    if not steps:  # every mode failed (`errors` says why): a table of what did run, without our rows' check
        return dict(rows=_static_rows(rows, None), invariant={}, buckets={})
    skips = {"recipe": skipped_recipe - skipped, "midlayer": _cudagraph_skips() - skipped_recipe}
    ref = graphs[-1] if graphs[-1] in steps else next(iter(steps))  # the speculative rows' mode, where it ran
    return dict(rows=_static_rows(rows, f"midlayer static, {ref}"), cudagraph_skips=skips,
                invariant={g: st.invariant for g, st in steps.items()},
                buckets={g: st.buckets for g, st in steps.items()},
                attn_rows={g: st.attn_rows for g, st in steps.items()},
                attention={g: st.attention for g, st in steps.items()},
                linear={g: st.linear for g, st in steps.items()})


def linear_kernel_step(model: Transformer, chosen: DecodeStep, max_len: int) -> DecodeStep | None:
    """Where the probe chose the row-attention kernel with PyTorch's (cuBLAS's) linears, the same step with the
    row-linear kernel too (the norms and SwiGLU's product its prologues, RoPE and the store q|k|v's epilogue:
    168 kernels a SmolLM2 step against 288), for a plain row beside the chosen one: the probe orders its
    candidates by an assumption (cuBLAS first where it keeps a row's bits), and this row measures it. None
    where the chosen step runs it already or the kernels do not."""
    if chosen.attention != "triton" or chosen.linear == "triton" or not triton_kernels(model):
        return None
    return DecodeStep(model, max_len=max_len, buckets=chosen.buckets, graphs=chosen.graphs, attn_rows=chosen.attn_rows,
                      attention="triton", linear="triton")


def _warm_up(model: Transformer, steps: dict[str, DecodeStep], spec_step: DecodeStep, methods: dict[str, tuple],
             encoded: list[list[int]], errors: dict[str, str], dname: str) -> None:
    """Compile / capture every bucket the run will use (each prompt's prefill chunks too, so that no capture
    lands inside a timed call); a mode or a drafter that fails here loses its rows only (the speculative rows
    run in the last mode, so they go with it)."""
    warm = encoded[0]
    for g, st in list(steps.items()):
        try:
            list(static_stream(model, warm, GenerationConfig(max_new_tokens=4), step=st))
            for ids in encoded if g != "compile" else ():  # (under compile the prefill runs eagerly: nothing to build)
                _prefill_s(st, ids)
                if len(ids) > 1:
                    _prefill_s(st, ids[:-1])
        except Exception as e:  # a mode that fails to capture or compile costs its row (and, last, the drafters')
            errors[f"{dname} midlayer static, {g}"] = f"{type(e).__name__}: {e}"
            del steps[g]
            if st is spec_step:
                for label in methods:
                    errors[f"{dname} {label}"] = f"not run: the step's {g} mode failed"
                methods.clear()
    for label, (drafter, tree, reference) in list(methods.items()):
        try:
            for on_device in _kinds(spec_step, drafter, tree, reference):
                static_speculative_generate(model, warm, drafter, tree, 8, step=spec_step, device_rounds=on_device)
        except Exception as e:  # one drafter's failure costs its row only
            errors[f"{dname} {label}"] = f"{type(e).__name__}: {e}"
            del methods[label]


def _kinds(step: DecodeStep, drafter, tree: DraftTree, reference: bool) -> tuple[bool, ...]:
    """The `device_rounds` values a drafter's rows run: `round_kinds`, less the host-drafted reference where
    `reference` is off (the extra tree sizes)."""
    kinds = round_kinds(step, drafter, tree)
    return kinds if reference or kinds == (False,) else (True,)


def _add_row(rows: dict[str, dict], name: str, toks: list[int], s_per_tok: float, counted: int | None = None,
             forwards: int | None = None) -> None:
    """A prompt's row: its tokens and decode time per token over `counted` tokens (default: all but the first,
    which a plain decoder's prefill makes)."""
    counted = len(toks) - 1 if counted is None else counted
    r = rows.setdefault(name, dict(s=0.0, n=0, tokens=[], forwards=0))
    r["s"] += s_per_tok * counted
    r["n"] += counted
    r["tokens"].append(toks)
    r["forwards"] += forwards if forwards is not None else len(toks)


def _static_rows(rows: dict[str, dict], plain_row: str | None) -> list[dict]:
    """The table's rows: each engine's ms/token, against the recipe's (vs_recipe: a ratio of ms, issue 42's
    "at most 1.2x") and as a speed-up over our plain row (over_plain: its ms / this row's, issue 42's "at least
    1.6x"), tau, and how many of its outputs equal our plain row's."""
    def ms_of(r: dict | None) -> float | None:
        return 1e3 * r["s"] / max(r["n"], 1) if r else None

    ref_ms, plain_ms = ms_of(rows.get(RECIPE)), ms_of(rows.get(plain_row))
    plain = rows[plain_row]["tokens"] if plain_ms is not None else []
    table = []
    for name, r in rows.items():
        ms = ms_of(r)
        table.append(dict(engine=name, ms_per_token=ms, vs_recipe=(ms / ref_ms) if ref_ms else None,
                          over_plain=(plain_ms / ms) if plain_ms is not None and ms else None,
                          tau=sum(len(t) for t in r["tokens"]) / max(r["forwards"], 1),
                          equal_plain=sum(a == b for a, b in zip(r["tokens"], plain)), n=len(plain)))
    return table


def generate_stream_tokens(model: Transformer, ids: list[int], cfg: GenerationConfig):
    """The dynamic engine's tokens for one prompt, as a stream of ints (for `_decode_timed`)."""
    for t, _ in generate_stream(model, [ids], cfg):
        yield int(t[0])


def static_table(r: dict, dtypes: Sequence[str] | None = None, header: bool = True) -> str:
    out = [*r["machine"], f"{r['model']}: {r['prompts']} held-out chat prompts ({min(r['prompt_tokens'])}-"
           f"{max(r['prompt_tokens'])} tokens) x {r['new_tokens']} new tokens, batch 1, greedy, decode only",
           ""] if header else []
    for dname, t in r["tables"].items():
        if dtypes is not None and dname not in dtypes:
            continue
        errors = {k: v for k, v in r.get("errors", {}).items() if k.startswith(dname + " ")}
        grouped, kernel, lin = t.get("attn_rows", {}), t.get("attention", {}), t.get("linear", {})
        inv = ", ".join(f"{g}: {t['buckets'][g]}{f' attention in groups of {grouped[g]}' if grouped.get(g) else ''}"
                        f"{' row-attention kernel' if kernel.get(g) == 'triton' else ''}"
                        f"{' C attention' if kernel.get(g) == 'c' else ''}"
                        f"{' row-linear kernel' if lin.get(g) == 'triton' else ''}"
                        f"{' C linear' if lin.get(g) == 'c' else ''} "
                        f"{'row-invariant' if ok else 'not probed' if ok is None else 'NOT row-invariant'}"
                        for g, ok in t["invariant"].items())
        out += [f"{dname} (buckets {inv})", "",
                "| engine | ms/token | vs recipe | speed-up over our plain | tau | = our plain greedy |",
                "|---|---|---|---|---|---|"]
        for row in t["rows"]:
            vs = f"{row['vs_recipe']:.2f}x" if row["vs_recipe"] is not None else "-"
            up = f"{row['over_plain']:.2f}x" if row.get("over_plain") is not None else "-"
            out.append(f"| {row['engine']} | {row['ms_per_token']:.2f} | {vs} | {up} | {row['tau']:.2f} | "
                       f"{row['equal_plain']}/{row['n']} |")
        skipped = {k: n for k, n in t.get("cudagraph_skips", {}).items() if n}
        if skipped:
            out.append("torch.compile ran graphs without CUDA graphs (TORCH_LOGS=cudagraphs names why): " +
                       ", ".join(f"{k} {n}" for k, n in skipped.items()))
        out += [f"failed: {k}: {v[:300]}" for k, v in errors.items()]
        out.append("")
    return "\n".join(out)

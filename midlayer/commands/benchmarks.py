"""`midlayer bench ...`: the benchmarks users run, each printing a table (experiments/bench.py,
experiments/static_bench.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .options import check_output, label_dirs, positive, write_output
from midlayer.config import get_preset, PRESETS
from midlayer.engine.decode_step import GRAPH_MODES
from midlayer.engine.pretrained import pretrained_config
from midlayer.engine.quantization import WEIGHT_FORMATS
from midlayer.experiments import bench, train_bench
from midlayer.experiments.static_bench import bench_static, DTYPES, static_table
from midlayer.train.distributed import resolve_device

# `bench decode`'s flags that only its CPU benchmark reads, and their defaults (its parser's): with --device cuda
# it runs `bench static`, which times the static step's drafters (its own default drafts unless --drafts is given)
DECODE_CPU_ONLY = {"drafts": "hidden-transfer=drafts/smollm2-135m/hidden-transfer,medusa=drafts/smollm2-135m/medusa,"
                             "early-exit=drafts/smollm2-135m/early-exit",
                   "layer_skip": "10:20", "tree": "auto", "weights": "q4", "prompts": "scaled"}


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print a table")
    bsub = p.add_subparsers(dest="bench", required=True)
    _add_bench_serve(bsub)
    b = bsub.add_parser("train", help="training throughput of the tiny preset against Hugging Face's Llama, as a "
                                      "ratio from one run (make bench)")
    train_bench.add_arguments(b)
    b = bsub.add_parser("generate", help="decode speed vs transformers, and real skipping vs the FLOPs model")
    b.add_argument("--what", choices=["decode", "prefill", "skipping", "rows", "all"], default="all",
                   help="rows: cost of a forward over T rows vs one row, per weight format (what verification "
                        "costs); prefill: long-prompt prefill vs llama.cpp (first --weights format)")
    b.add_argument("--prompt-lengths", default="64,256,700", help="prompt tokens for --what prefill")
    b.add_argument("--model", default="smollm2-135m", help="pretrained model for the decode benchmark")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--preset", default="paper-12l", help="gated preset for the skipping benchmark")
    b.add_argument("--seq-len", type=int, default=960, help="prefill length for the skipping benchmark (+64 decoded)")
    b.add_argument("--fractions", default="0,0.25,0.5,0.75,0.9", help="forced skip fractions")
    b.add_argument("--skip-from", type=int, default=2, help="first skipped block (span [k, L-1-k])")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--weights", default=",".join(WEIGHT_FORMATS),
                   help="comma-separated weight formats for the decode benchmark (first is the reference)")
    b.add_argument("--device", default=None,
                   help="a CUDA device runs `bench static` there instead (the static step vs transformers' CUDA-graph "
                        "recipe); default: these CPU benchmarks")
    b = bsub.add_parser("gates", help="learned skip gates (train-gates) vs dense and static layer skipping: held-out KL, "
                                      "agreement, sparsity, real prefill/decode speedups vs the FLOPs model")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--gates", required=True, metavar="LABEL=DIR,...", help="comma-separated train-gates outputs")
    b.add_argument("--data", default="data/distill/smollm2-135m-q4-greedy.jsonl",
                   help="distillation file whose held-out split gives the records and prompts")
    b.add_argument("--static", default="auto", help="static layer-skip baselines: auto (the span of nearest compute "
                                                    "per gates variant), none, or comma-separated first blocks A "
                                                    "(span [A, L-1-A])")
    b.add_argument("--prompts", type=int, default=8, help="held-out prompts timed")
    b.add_argument("--records", type=int, default=64, help="held-out records for KL / agreement / sparsity")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="q4")
    b.add_argument("--output", default=None, help="also write the results as JSON here")
    b = bsub.add_parser("decode", help="speculative decoding per drafter: tau, draft accuracy, speedup, losslessness")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--drafts", default=DECODE_CPU_ONLY["drafts"],
                   help="comma-separated LABEL=DIR of train-draft outputs, or LABEL=lookup for prompt lookup (no "
                        "training); default: the committed SmolLM2 drafts")
    b.add_argument("--layer-skip", default=DECODE_CPU_ONLY["layer_skip"], help="A:B = skip blocks A..B-1 ('' = none)")
    b.add_argument("--tree", choices=["auto", "chain", "sparse"], default=DECODE_CPU_ONLY["tree"],
                   help="auto: per drafter, the tree of highest expected tokens/s (held-out accuracies x measured "
                        "row costs); chain: top-1 chain; sparse: the --nodes nodes most likely accepted")
    b.add_argument("--nodes", type=int, default=10, help="nodes of the sparse tree")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--max-prompts", type=int, default=12, help="held-out prompts, spread over the categories")
    b.add_argument("--prompts", choices=["scaled", "base"], default=DECODE_CPU_ONLY["prompts"],
                   help="held-out prompts of the scaled set (12 categories, midlayer.data.prompt_recipe) or of the base set")
    b.add_argument("--weights", choices=list(WEIGHT_FORMATS), default=DECODE_CPU_ONLY["weights"], help="q4: lossless")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers generate comparison")
    b.add_argument("--output", default=None, help="also write the results as JSON here")
    b.add_argument("--device", default=None,
                   help="a CUDA device runs `bench static` there instead (EAGLE and Medusa through the static step, "
                        "beside transformers' CUDA-graph recipe; a --drafts given replaces its drafts); default: this "
                        "CPU benchmark")
    _add_bench_static(bsub)


def _add_bench_static(bsub: argparse._SubParsersAction) -> None:
    b = bsub.add_parser("static", help="the static decode step (eager / CUDA graphs / compile), plain and speculative, "
                                       "vs the dynamic engine and transformers' static cache + CUDA-graph recipe")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    b.add_argument("--dtypes", default="bf16,fp32", help="comma-separated model dtypes: bf16, fp32")
    b.add_argument("--graphs", default=None,
                   help="comma-separated step modes: eager, cudagraph, compile (default: eager,cudagraph on CUDA, eager "
                        "on a CPU); the speculative rows run in the last")
    b.add_argument("--drafts", default="eagle=drafts/smollm2-135m-scale/eagle,medusa=drafts/smollm2-135m-scale/medusa,"
                                       "hidden-transfer=drafts/smollm2-135m-scale/hidden-transfer",
                   help="comma-separated LABEL=DIR of drafts that draft for the static step ('' = none)")
    b.add_argument("--nodes", type=int, default=24, help="tree nodes (EAGLE: EAGLE-2's dynamic tree)")
    b.add_argument("--also-nodes", default="", help="comma-separated tree sizes each drafter also runs at, in device "
                                                  "rounds (a drafter's best tree need not be --nodes')")
    b.add_argument("--anchors", default="", help="comma-separated counts: hidden transfer also with pseudo rows for "
                                               "that many rows of its tree only, at each tree size, in device rounds")
    b.add_argument("--eagle-k", type=int, default=4, help="EAGLE-2's tree: the candidates expanded at each depth")
    b.add_argument("--eagle-depth", type=int, default=0, help="EAGLE-2's tree: its depth (0: the draft's own)")
    b.add_argument("--new-tokens", type=int, default=128)
    b.add_argument("--max-prompts", type=int, default=7, help="held-out prompts, spread over the categories")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers recipe")
    b.add_argument("--no-dynamic", action="store_true", help="skip the dynamic engine's row")
    b.add_argument("--output", default=None, help="also write the results as JSON here")


def check_bench_decode_args(args: argparse.Namespace) -> tuple[dict[str, str], tuple[int, int] | None]:
    """(drafts, layer skip) of `bench decode`, every flag checked before any model or draft is loaded; the
    layer indices against the model's metadata."""
    for flag, value in (("--new-tokens", args.new_tokens), ("--max-prompts", args.max_prompts),
                        ("--nodes", args.nodes)):
        positive(flag, value)
    check_output("--output", args.output)
    drafts = label_dirs("--drafts", args.drafts, "a train-draft output", names=("lookup",))
    skip = None
    if args.layer_skip:
        a, sep, b = args.layer_skip.partition(":")
        try:
            skip = (int(a), int(b))
        except ValueError:
            raise ValueError(f"--layer-skip: expected A:B (integers, skipping blocks A..B-1), "
                             f"got {args.layer_skip!r}") from None
        n = pretrained_config(args.model).n_layers
        if not 0 <= skip[0] < skip[1] <= n or skip[1] - skip[0] >= n:
            raise ValueError(f"--layer-skip {args.layer_skip}: need 0 <= A < B <= {n} and fewer than {n} blocks "
                             f"skipped ({args.model} has {n} blocks)")
    return drafts, skip


def check_bench_generate_args(args: argparse.Namespace) -> tuple[float, ...]:
    """The forced skip fractions of `bench generate`; every flag checked before any benchmark runs."""
    import math

    positive("--new-tokens", args.new_tokens)
    positive("--repeats", args.repeats)
    positive("--seq-len", args.seq_len)
    try:
        fractions = tuple(float(x) for x in args.fractions.split(","))
    except ValueError:
        fractions = ()
    if not fractions or not all(math.isfinite(z) and 0 <= z <= 1 for z in fractions):
        raise ValueError(f"--fractions: expected comma-separated numbers in [0, 1], got {args.fractions!r}")
    if args.preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {args.preset!r}; known presets: {', '.join(PRESETS)}")
    if args.skip_from < 0:
        raise ValueError(f"--skip-from must be >= 0, got {args.skip_from}")
    if args.what not in ("skipping", "all"):
        return fractions
    cfg = get_preset(args.preset)[0]  # the preset-dependent checks: only where the skipping benchmark runs
    if not cfg.gating:
        raise ValueError(f"--preset {args.preset}: not a gated model (the skipping benchmark needs routers)")
    if not 0 <= args.skip_from < cfg.n_layers // 2:
        raise ValueError(f"--skip-from must be in [0, {cfg.n_layers // 2}) for {args.preset} ({cfg.n_layers} "
                         f"blocks, routers on the first {cfg.n_layers // 2}), got {args.skip_from}")
    if args.seq_len + 64 > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len}: + 64 decoded tokens exceeds {args.preset}'s max_seq_len "
                         f"{cfg.max_seq_len}")
    return fractions


def check_bench_gates_args(args: argparse.Namespace) -> dict[str, str]:
    """The gates to compare ({label: train-gates output}) of `bench gates`, every flag checked before the model
    loads: a label is none of the rows the benchmark adds itself (it replaced the user's gates), --output is not
    --data (it overwrote the distillation data), --static's blocks are routed ones."""
    for flag, value in (("--prompts", args.prompts), ("--records", args.records), ("--new-tokens", args.new_tokens)):
        positive(flag, value)
    check_output("--output", args.output, {"--data": args.data})
    gates = label_dirs("--gates", args.gates, "a train-gates output", reserved=("dense", "open gates (overhead)"))
    if not gates:
        raise ValueError("--gates: give at least one LABEL=DIR (a train-gates output)")
    taken = next((label for label in gates if label.startswith("static-skip ")), None)
    if taken is not None:
        raise ValueError(f"--gates: label {taken!r} is taken by the rows of --static; choose another")
    if args.static not in ("auto", "none"):
        if not all(x.strip().isdigit() for x in args.static.split(",")):
            raise ValueError(f"--static: auto, none or comma-separated block indices, got {args.static!r}")
        routed = pretrained_config(args.model).n_layers // 2
        bad = [x.strip() for x in args.static.split(",") if int(x) >= routed]
        if bad:
            raise ValueError(f"--static {args.static}: a static skip starts at a routed block, 0 <= first < {routed} "
                             f"for {args.model}, got {bad[0]}")
    if not Path(args.data).is_file():
        raise ValueError(f"--data {args.data}: no such file (a midlayer.speculative.distill output)")
    return gates


def check_bench_static_args(args: argparse.Namespace) -> dict:
    """bench_static's keyword arguments from `bench static` (or `bench decode/generate --device cuda`), every
    flag checked before anything is loaded."""

    dev = resolve_device(args.device) if args.device else None
    kw: dict[str, Any] = dict(model_name=args.model, device=None if dev is None else str(dev),
                              new_tokens=args.new_tokens)
    positive("--new-tokens", args.new_tokens)
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (the first token comes with the prefill), got {args.new_tokens}")
    check_output("--output", getattr(args, "output", None))
    if args.bench == "generate":  # its --weights: the dtypes of the static bench (q4 and int4 are CPU formats)
        formats = tuple(f.strip() for f in args.weights.split(",") if f.strip())
        dtypes = tuple(f for f in formats if f in ("bf16", "fp32"))
        if not dtypes:
            raise ValueError(f"--weights {args.weights}: on CUDA `bench generate` times bf16 and fp32 (q4 and int4 "
                             "are CPU formats)")
        kw.update(dtypes=dtypes)
    if args.bench in ("decode", "static"):  # the flags the two share (decode's drafters are the static step's)
        for flag, value in (("--nodes", args.nodes), ("--max-prompts", args.max_prompts)):
            positive(flag, value)
        if args.nodes > 63:
            raise ValueError(f"--nodes {args.nodes}: at most 63 (a round with hidden transfer's 3 pseudo blocks fits "
                             "256 rows)")
        kw.update(nodes=args.nodes, max_prompts=args.max_prompts, compare_transformers=not args.no_transformers)
    if args.bench == "decode":  # (they were ignored without a word, --drafts unchecked)
        given = [k for k, v in DECODE_CPU_ONLY.items() if k != "drafts" and getattr(args, k) != v]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')}: `bench decode --device cuda` runs `bench static`, which "
                             "has no such setting (bf16 and fp32, the static step's trees); leave it out")
        if args.drafts != DECODE_CPU_ONLY["drafts"]:
            kw.update(drafts=label_dirs("--drafts", args.drafts, "a train-draft output"))
    if args.bench != "static":
        return kw
    dtypes = tuple(x.strip() for x in args.dtypes.split(",") if x.strip())
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"--dtypes: comma-separated, from {', '.join(DTYPES)}; got {args.dtypes!r}")
    graphs = None
    if args.graphs is not None:
        graphs = tuple(x.strip() for x in args.graphs.split(",") if x.strip())
        if not graphs or any(g not in GRAPH_MODES for g in graphs):
            raise ValueError(f"--graphs: comma-separated, from {', '.join(GRAPH_MODES)}; got {args.graphs!r}")
        if "cudagraph" in graphs and (dev is None and not _cuda() or dev is not None and dev.type != "cuda"):
            raise ValueError("--graphs cudagraph needs a CUDA device")
    also = _int_list("--also-nodes", args.also_nodes, "tree sizes", 63, "as --nodes")
    anchors = _int_list("--anchors", args.anchors, "counts", 64, "the root and the rows likeliest to end a round")
    if not 1 <= args.eagle_k <= 16 or not 0 <= args.eagle_depth <= 8:
        raise ValueError(f"--eagle-k {args.eagle_k} --eagle-depth {args.eagle_depth}: k from 1 to 16, the depth from "
                         "1 to 8 (0: the draft's own)")
    kw.update(dtypes=dtypes, graphs=graphs, drafts=label_dirs("--drafts", args.drafts, "a train-draft output"),
              dynamic=not args.no_dynamic, also_nodes=also, eagle_k=args.eagle_k, eagle_depth=args.eagle_depth,
              anchors=anchors)
    return kw


def _int_list(flag: str, text: str, what: str, top: int, why: str) -> tuple[int, ...]:
    """A flag's comma-separated integers, each from 1 to `top`, or the ValueError naming the flag."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: comma-separated {what}, got {text!r}") from None
    if any(not 1 <= n <= top for n in out):
        raise ValueError(f"{flag} {text}: each from 1 to {top} ({why})")
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bench_static(args: argparse.Namespace) -> int:
    shown: list[str] = []

    def show(r: dict, dtype: str) -> None:  # each dtype's table as soon as it is done
        print(static_table(r, [dtype], header=not shown), flush=True)
        shown.append(dtype)

    r = bench_static(**check_bench_static_args(args), on_table=show)
    write_output(getattr(args, "output", None), json.dumps(r, indent=2, default=str))
    return 0


def _add_bench_serve(bsub: argparse._SubParsersAction) -> None:
    b = bsub.add_parser("serve", help="midlayer serve under 1, 4 and 16 concurrent streaming clients: aggregate "
                                      "tokens/s, time to first token and per token, plain and speculative")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="q4")
    b.add_argument("--draft", default="lookup", metavar="DIR|lookup", help="the speculative rows' drafter ('' = none)")
    b.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels")
    b.add_argument("--requests-per-client", type=int, default=4,
                   help="requests each client sends one after another at the largest concurrency; every concurrency "
                        "serves the same max(clients) x this many requests (4: the batch runs full between its "
                        "ramp-up and drain)")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--prompts", choices=["scaled", "base"], default="scaled")
    b.add_argument("--no-llama-cpp", action="store_true",
                   help="skip llama.cpp's server rows (they run where llama-cpp-python[server] is installed)")
    b.add_argument("--output", default=None, help="also write the results as JSON here")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "train":
        return train_bench.run(args)
    if args.bench == "serve":
        return _bench_serve(args)
    if args.bench == "static":
        return _bench_static(args)
    if args.bench in ("decode", "generate") and args.device is not None:
        if resolve_device(args.device).type == "cuda":
            return _bench_static(args)  # the GPU's benchmark: the static step beside transformers' CUDA-graph recipe
    if args.bench == "gates":
        gates = check_bench_gates_args(args)
        r = bench.bench_gates(args.model, gates, args.data, args.static, args.prompts, args.new_tokens, args.weights,
                              records=args.records)
        print(bench.gates_table(r))
        write_output(args.output, json.dumps(r, indent=2))
        return 0
    if args.bench == "decode":
        drafts, skip = check_bench_decode_args(args)
        r = bench.bench_speculative(args.model, drafts, skip, args.tree, args.nodes, args.new_tokens,
                                    args.max_prompts, args.weights, not args.no_transformers, prompts=args.prompts)
        print(bench.speculative_table(r))
        write_output(args.output, json.dumps(r, indent=2))
        return 0

    fractions = check_bench_generate_args(args)
    formats = tuple(f.strip() for f in args.weights.split(",") if f.strip())
    bad = [f for f in formats if f not in WEIGHT_FORMATS]
    if bad or not formats:
        raise ValueError(f"--weights: unknown format(s) {bad}; choose from {', '.join(WEIGHT_FORMATS)}")
    try:  # checked before any benchmark runs
        lengths = tuple(int(x) for x in args.prompt_lengths.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 40:
        raise ValueError(f"--prompt-lengths: expected comma-separated integers >= 40, got {args.prompt_lengths!r}")
    ctx = pretrained_config(args.model).max_seq_len  # (lengths against the model's context, before it loads)
    if args.what in ("decode", "all") and args.new_tokens >= ctx:  # (its prompts' lengths: checked once loaded)
        raise ValueError(f"--new-tokens {args.new_tokens}: no room beside a prompt in {args.model}'s context of "
                         f"{ctx} tokens")
    if args.what in ("prefill", "rows", "all"):
        if args.what != "rows" and max(lengths) > ctx:
            raise ValueError(f"--prompt-lengths: {max(lengths)} tokens exceed {args.model}'s context of {ctx}")
        if args.what != "prefill" and bench.ROWS_CONTEXT + max(bench.ROWS) > ctx:
            raise ValueError(f"--what rows: its {bench.ROWS_CONTEXT}-token context and {max(bench.ROWS)} rows exceed "
                             f"{args.model}'s context of {ctx} tokens")
    if args.what in ("decode", "all"):
        r = bench.bench_decode(args.model, new_tokens=args.new_tokens, repeats=args.repeats, formats=formats)
        print(bench.decode_table(r))
        print()
    if args.what in ("prefill", "all"):
        print(bench.prefill_table(bench.bench_prefill(args.model, formats[0], lengths, args.repeats)))
        print()
    if args.what in ("rows", "all"):
        print(bench.rows_table(bench.bench_rows(args.model, formats, repeats=args.repeats + 2)))
        print()
    if args.what in ("skipping", "all"):
        rows = bench.bench_skipping(args.preset, seq_len=args.seq_len, fractions=fractions,
                                    skip_from=args.skip_from, repeats=args.repeats)
        print(bench.skipping_table(rows))
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from midlayer.experiments.serve_bench import bench_serve, serve_table  # needs the serve extra: loaded by this benchmark only, not at start-up
    from midlayer.server import require_serve_extra  # (as the line above: not at start-up)

    require_serve_extra()
    try:
        clients = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        clients = []
    if not clients or min(clients) < 1:
        raise ValueError(f"--clients: comma-separated positive integers, got {args.clients!r}")
    for flag, value in (("--requests-per-client", args.requests_per_client), ("--max-tokens", args.max_tokens)):
        positive(flag, value)
    check_output("--output", args.output)
    if args.draft and args.draft != "lookup" and not Path(args.draft).is_dir():
        raise ValueError(f"--draft {args.draft}: no such directory (a train-draft output, or lookup)")
    r = bench_serve(args.model, args.weights, args.draft or None, clients, args.requests_per_client, args.max_tokens,
                    args.prompts, llama_cpp=not args.no_llama_cpp)
    print(serve_table(r))
    write_output(args.output, json.dumps(r, indent=2))
    return 0

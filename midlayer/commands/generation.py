"""`midlayer generate`: text from a pretrained model or one of our runs, plain, gated or speculative, on the
dynamic engine or the static decode step.
"""

from __future__ import annotations

import argparse
import time
import sys
from pathlib import Path

from midlayer.api import LLM
from midlayer.commands.options import positive
from midlayer.engine.decode_step import unsupported
from midlayer.engine.quantization import KV_FORMATS, WEIGHT_FORMATS
from midlayer.ops import kernels
from midlayer.speculative.tree_cost import parse_tree_spec
from midlayer.train.distributed import resolve_device



LOOKUP = "lookup"  # --draft lookup: the training-free prompt-lookup drafter (speculative/lookup.py)


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a pretrained model or one of our checkpoints")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="pretrained: a short name (smollm2-135m), a Hugging Face directory or a .gguf file")
    src.add_argument("--checkpoint", help="one of our runs (directory or ckpt_*.pt); its corpus's tokenizer is used")
    p.add_argument("--prompt", default=None, help="the prompt (default: read standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template (its "
                   "text stays text: chat markup in it cannot forge a turn)")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-skip", action="store_true", help="gated models: compute skipped blocks (multiplied by 0)")
    p.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="fp32",
                   help="linear-weight format: fp32 (exact), bf16, int4 (group-32, Q4_1 layout, through PyTorch), or "
                        "q4 (CPU only: our C kernels, llama.cpp's arithmetic, row-invariant, the fastest on a CPU; "
                        "its LM head is Q8_0); activations and the residual stay fp32, and so does the LM head except "
                        "with q4")
    p.add_argument("--kv-cache", choices=list(KV_FORMATS), default=None,
                   help="what the KV cache holds (default: fp16 with --weights q4, as llama.cpp keeps it; else the "
                        "weights' dtype)")
    p.add_argument("--device", default=None)
    p.add_argument("--draft", default=None, metavar="DIR|lookup",
                   help="speculative decoding with a train-draft output, or `lookup`: prompt lookup, draft tokens "
                        "copied from the prompt and output (no training; a folder named lookup: ./lookup). Greedy: "
                        "the same tokens as without in the q4 format; sampling: the same distribution, plain softmax "
                        "only, no --top-k/--top-p")
    p.add_argument("--tree", default=None, metavar="auto|chain|sparse:N|dynamic:N",
                   help="draft tree with --draft (default auto): auto (the tree of highest expected tokens/s from the draft's "
                        "held-out accuracies and this machine's measured row costs), the top-1 chain, the N "
                        "nodes most likely accepted, or (EAGLE drafts) EAGLE-2's dynamic tree of N nodes")
    p.add_argument("--stats", action="store_true", help="with --draft: print tau and timing to stderr")
    p.add_argument("--refresh-costs", action="store_true",
                   help="with --tree auto: measure this machine's row costs and the drafter's overheads again "
                        "instead of reading them from the cache ($MIDLAYER_CACHE/row_costs.json)")
    p.add_argument("--engine", choices=["auto", "dynamic", "static"], default="auto",
                   help="static: the static-shape decode step (midlayer.engine.decode_step: bucketed rows, acceptance on the "
                        "device, capturable in CUDA graphs; dense models, and drafters that declare static_step: EAGLE, "
                        "Medusa, hidden transfer's fused pass, early exit, layer skip, prompt lookup); dynamic: the "
                        "cache engine with real skipping and every drafter; auto (default): "
                        "static on CUDA where it applies, else dynamic")
    p.add_argument("--graphs", choices=["auto", "eager", "cudagraph", "compile"], default="auto",
                   help="with the static engine: run its step eagerly, captured in a CUDA graph per bucket, or through "
                        "torch.compile; auto: cudagraph on CUDA, eager elsewhere")
    p.add_argument("--gates", default=None, metavar="DIR",
                   help="generate with the model gated by a train-gates output (per-token skipping of middle blocks, "
                        "real skipping; lossy). For lossless decoding give the same DIR as --draft instead: the gated "
                        "model then drafts and the dense model verifies")


def cmd_generate(args: argparse.Namespace) -> int:
    """`midlayer generate`: a thin layer over the Python API (midlayer/api.py), which does the work."""
    check_generate_args(args)  # before any file is read: a bad flag is never blamed on a model file
    if args.model:
        llm = LLM.load(args.model, weights=args.weights, device=args.device, kv_cache=args.kv_cache)
    else:
        llm = LLM.from_run(args.checkpoint, weights=args.weights, device=args.device, kv_cache=args.kv_cache)
    model = llm.model
    if args.weights == "q4" and not model.batch_invariant:
        # q4 is defined by its C kernels: without them it is another computation (issue 43)
        print(f"note: the q4 kernels are not available here ({kernels.unavailable_reason()}), so q4 runs through "
              "PyTorch: other bits than the kernels (tokens can differ from a machine that has them), not "
              "row-invariant, and speculative output can differ from plain greedy output at near-ties",
              file=sys.stderr)
    if args.gates:
        llm.use_gates(args.gates)
    prompt = _prompt_text(args.prompt)
    if args.chat:
        prompt = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
                 [{"role": "user", "content": prompt}]
    ids = llm.encode(prompt)
    llm.engine, llm.graphs = _engine(args, llm.model)
    llm.skip = not args.no_skip
    if args.draft:
        _attach_draft(args, llm, ids)
    t = time.perf_counter()
    for piece in llm.stream(prompt, max_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        sys.stdout.write(piece)
        sys.stdout.flush()
    # (less the choice of the tree: --tree auto's first run measures this machine's costs, a minute or more)
    dt = time.perf_counter() - t - llm.last_choice_s
    sys.stdout.write("\n")
    done = llm.last_completion
    _say_if_cut(llm.model, ids, done.completion_tokens, done.finish_reason == "stop", args.max_new_tokens)
    if args.draft and llm.last_stats is not None:
        stats = llm.last_stats
        if stats.row_invariant is False:
            print("note: the static step's buckets were not measured row-invariant on this device, so this "
                  "speculative output can differ from plain greedy output at near-ties", file=sys.stderr)
        if args.stats:
            if llm.last_report:
                print(llm.last_report, file=sys.stderr)
            n = done.completion_tokens
            drafts = (f"tree of {len(llm.last_tree)} nodes" if llm.last_tree is not None else
                      "chains as deep as pays, step by step (a one-row continuous batch)")
            chose = f" (choosing it took {llm.last_choice_s:.2f} s more)" if llm.last_choice_s >= 0.01 else ""
            print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), tau {stats.tau:.2f} over "
                  f"{stats.base_forwards} base forwards, {drafts}{chose}", file=sys.stderr)
    return 0


def _attach_draft(args: argparse.Namespace, llm: LLM, ids: list[int]) -> None:
    """--draft: the drafter attached to `llm`, the engine set back to dynamic where the static step cannot run
    it, and the notes on what is and is not bit-identical."""
    llm.attach(args.draft, tree=args.tree)  # first: a bad draft is refused before any note
    llm.refresh_costs, llm.progress = args.refresh_costs, True
    drafter, model = llm.drafter, llm.model
    if llm.engine == "static" and (not drafter.static_step or args.temperature > 0):
        what = ("decodes greedily only" if args.temperature > 0 else
                f"does not run a {type(drafter).__name__} draft yet (it reads the dynamic cache)")
        if args.engine == "static":
            raise ValueError(f"--engine static with --draft: the static step {what}; use --engine dynamic")
        llm.engine = "dynamic"  # auto: the dynamic engine runs every drafter
    if args.temperature == 0 and llm.engine == "dynamic" and args.weights == "q4" and not model.batch_invariant:
        pass  # said once, for every q4 call without its kernels (cmd_generate)
    elif args.temperature == 0 and llm.engine == "dynamic" and not getattr(model, "batch_invariant", False):
        print(f"note: {args.weights} weights are not row-invariant in the dynamic engine, so speculative output can "
              "differ from plain greedy output at near-ties; --weights q4, or --engine static where its probe finds "
              "row-invariant buckets, is bit-identical", file=sys.stderr)
    if args.tree == "auto" and args.draft != LOOKUP and not llm.accuracies(ids):
        print(f"note: {args.draft} has no held-out accuracies to size a tree by; using the top-1 chain",
              file=sys.stderr)


def _prompt_text(arg: str | None) -> str:
    """The prompt from --prompt or standard input, refused with one line unless it is UTF-8 text (a byte that is
    not reaches Python as a lone surrogate in argv, and as a decoding error on stdin)."""
    if arg is None:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the prompt on standard input is not UTF-8 text (byte {e.start}: "
                             f"{data[e.start:e.start + 1]!r}); convert it, e.g. with iconv") from None
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"--prompt is not UTF-8 text (character {e.start} is an undecodable byte); pass UTF-8, "
                         "or the prompt on standard input") from None
    return arg


def _say_if_cut(model, ids: list[int], n_new: int, ended: bool, asked: int) -> None:
    """Generation that stopped at the context's end, before an end-of-turn token and before --max-new-tokens,
    says so (finish reason "length" by the context, as OpenAI's finish_reason)."""
    if not ended and n_new < asked:
        print(f"note: stopped at the model's context of {model.cfg.max_seq_len} tokens: {n_new} of the "
              f"{asked} new tokens asked for (the prompt has {len(ids)})", file=sys.stderr)


def _engine(args: argparse.Namespace, model) -> tuple[str, str]:
    """(engine, graphs) for generate: --engine auto takes the static step on CUDA where it applies."""

    dev = model.tok_embeddings.weight.device
    why = unsupported(model)
    if args.engine == "static" and why:
        raise ValueError(f"--engine static: the static decode step does not run {why}; use --engine dynamic")
    engine = args.engine if args.engine != "auto" else ("static" if dev.type == "cuda" and not why else "dynamic")
    graphs = args.graphs if args.graphs != "auto" else ("cudagraph" if dev.type == "cuda" else "eager")
    if engine == "dynamic" and args.graphs != "auto":
        raise ValueError(f"--graphs {args.graphs}: only the static engine captures its step (--engine static)")
    if graphs == "cudagraph" and dev.type != "cuda":
        raise ValueError(f"--graphs cudagraph needs the model on CUDA (--device cuda), not on {dev.type}")
    return engine, graphs


def tree_nodes(spec: str) -> int:
    """N of --tree 'sparse:N' / 'dynamic:N' (0 for auto and chain), or a clear error naming the flag."""
    return parse_tree_spec(spec, "--tree")[1]


def check_generate_args(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, every generate value outside its meaning; nothing is loaded yet."""
    import math


    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:  # NaN fails too
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.seed is not None and not -2**63 <= args.seed < 2**64:
        raise ValueError(f"--seed must be an integer in [-2**63, 2**64), got {args.seed}")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        # sampling filters: greedy decoding takes the argmax whatever they keep, so taking them silently would
        # suggest they did something (--seed is let through: it is harmless, and scripts pass it always)
        raise ValueError(f"{'--top-k' if args.top_k else '--top-p'} filters sampling: it needs --temperature > 0 "
                         "(0, the default, decodes greedily)")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (the system message is part of the chat template)")
    dev = resolve_device(args.device) if args.device is not None else None
    on_cuda = dev is not None and dev.type == "cuda"
    static = args.engine == "static" or args.engine == "auto" and on_cuda
    if args.graphs != "auto" and not static:
        raise ValueError(f"--graphs {args.graphs}: only the static engine captures its step (--engine static, or "
                         "--device cuda where --engine auto takes it)")
    if args.graphs == "cudagraph" and not on_cuda:
        raise ValueError("--graphs cudagraph needs --device cuda (the model on a CUDA device)")
    if args.weights == "q4" and on_cuda:
        raise ValueError("--weights q4 runs on the CPU only (its kernels are C); on CUDA use --weights fp32 or bf16")
    if args.engine == "static" and args.gates is not None:
        raise ValueError("--engine static with --gates: the static step runs dense models (real skipping is "
                         "data-dependent); use --engine dynamic")
    if args.engine == "static" and args.draft is not None and args.temperature > 0:
        raise ValueError("--engine static with --draft decodes greedily only (--temperature 0); use --engine "
                         "dynamic for speculative sampling")
    if args.draft is None and (args.tree is not None or args.stats):
        # both only describe speculative decoding: taking them silently would suggest they did something
        raise ValueError(f"{'--tree' if args.tree is not None else '--stats'} needs --draft (it sets/reports the "
                         "speculative decoding of a trained drafter)")
    if args.tree is None:
        args.tree = "auto"
    if args.refresh_costs and (args.draft is None or args.tree != "auto"):
        raise ValueError("--refresh-costs needs --draft with --tree auto (it re-measures what sizes that tree)")
    tree_nodes(args.tree)  # a bad --tree is refused before any model is loaded
    if args.gates is not None:
        if args.draft is not None:
            raise ValueError("--gates and --draft together: give the gates DIR as --draft to self-draft losslessly, "
                             "or as --gates alone to generate with the gated model")
        if not Path(args.gates).is_dir():
            raise ValueError(f"--gates {args.gates}: no such directory (expected a train-gates output)")
    if args.draft is not None and args.draft != LOOKUP:
        if not Path(args.draft).is_dir():
            raise ValueError(f"--draft {args.draft}: no such directory (expected a train-draft output)")
        if args.temperature > 0 and (args.top_k or args.top_p < 1.0):
            raise ValueError("--draft samples from the plain softmax (exact speculative sampling); --top-k/--top-p "
                             "would change the distribution it must reproduce: drop them, or drop --draft")


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /health); needs the serve extra: pip install 'midlayer[serve]'")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="pretrained: a short name (smollm2-135m), a Hugging Face directory or a .gguf file")
    src.add_argument("--checkpoint", help="one of our runs (directory or ckpt_*.pt); its corpus's tokenizer is used")
    p.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="q4",
                   help="linear-weight format (default q4: the row-invariant CPU format, lossless with a drafter)")
    p.add_argument("--kv-cache", choices=list(KV_FORMATS), default=None,
                   help="what the KV cache holds (default: fp16 with --weights q4, as llama.cpp keeps it; else the "
                        "weights' dtype)")
    p.add_argument("--device", default=None)
    p.add_argument("--draft", default=None, metavar="DIR|lookup", help="decode every request speculatively with a "
                                                                      "train-draft output or prompt lookup")
    p.add_argument("--tree", default="auto", metavar="auto|chain|sparse:N|dynamic:N", help="draft tree with --draft")
    p.add_argument("--served-name", default=None, help="the model name clients send (default: --model's value)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests queued or running at once; more are refused with 503")
    p.add_argument("--max-batch", type=int, default=16,
                   help="requests decoded together in one continuous batch (1: one after another)")
    p.add_argument("--memory-rows", type=int, default=4, metavar="ROWS",
                   help="batch cache rows beyond --max-batch that keep finished requests' K/V, so that a follow-up "
                        "turn reuses its conversation's prefix when the batch is full (each costs one row of K/V)")
    p.add_argument("--prefix-reuse", type=int, default=16, metavar="TOKENS",
                   help="a request whose prompt starts as another's (a running one's, one a free batch row still "
                        "holds, or the last scored prompt's) for at least this many tokens reuses their K/V instead "
                        "of prefilling them (0: off)")


def cmd_serve(args: argparse.Namespace) -> int:
    # needs fastapi and uvicorn (the serve extra): loaded by this command only, not at start-up
    from midlayer.server import require_free_address, require_serve_extra, serve

    require_serve_extra()
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    positive("--max-queue", args.max_queue)
    positive("--max-batch", args.max_batch)
    if args.prefix_reuse < 0:
        raise ValueError(f"--prefix-reuse must be >= 0 (0: off), got {args.prefix_reuse}")
    if args.memory_rows < 0:
        raise ValueError(f"--memory-rows must be >= 0 (0: none), got {args.memory_rows}")
    if args.draft is not None and args.draft != LOOKUP and not Path(args.draft).is_dir():
        raise ValueError(f"--draft {args.draft}: no such directory (expected a train-draft output, or lookup)")
    tree_nodes(args.tree)  # a bad --tree is refused before any model is loaded
    require_free_address(args.host, args.port)
    llm = LLM.load(args.model, weights=args.weights, device=args.device, kv_cache=args.kv_cache) if args.model \
        else LLM.from_run(args.checkpoint, weights=args.weights, device=args.device, kv_cache=args.kv_cache)
    if args.draft:
        llm.attach(args.draft, tree=args.tree)
    llm.prefix_reuse = args.prefix_reuse
    serve(llm, args.served_name or args.model or args.checkpoint, host=args.host, port=args.port,
          max_queue=args.max_queue, max_batch=args.max_batch, memory_rows=args.memory_rows)
    return 0


"""`midlayer generate`: text from a pretrained model or one of our runs, plain, gated or speculative, on the
dynamic engine or the static decode step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .training import load_run
from midlayer.common import cache_dir
from midlayer.config import TrainConfig
from midlayer.data.pretrained_tokenizer import TextTokenizer
from midlayer.data.shards import resolve_data
from midlayer.engine.decode_step import static_stream, unsupported
from midlayer.engine.generate import generate_stream, GenerationConfig
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import compress_weights, WEIGHT_FORMATS
from midlayer.ops import kernels
from midlayer.speculative.lookup import PromptLookupDrafter
from midlayer.speculative.registry import heldout_accuracies, load_draft, load_drafter
from midlayer.speculative.skip_gates import gated_twin, SkipGates
from midlayer.speculative.static import static_speculative_generate
from midlayer.speculative.tree_cost import select_tree
from midlayer.speculative.verify import speculative_generate
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
                   help="linear-weight format: fp32 (exact), bf16, or int4 (group-32, Q4_1 layout; fastest on CPU); "
                        "activations, residual and LM head stay fp32")
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
                        "Medusa); dynamic: the cache engine with real skipping and every drafter; auto (default): "
                        "static on CUDA where it applies, else dynamic")
    p.add_argument("--graphs", choices=["auto", "eager", "cudagraph", "compile"], default="auto",
                   help="with the static engine: run its step eagerly, captured in a CUDA graph per bucket, or through "
                        "torch.compile; auto: cudagraph on CUDA, eager elsewhere")
    p.add_argument("--gates", default=None, metavar="DIR",
                   help="generate with the model gated by a train-gates output (per-token skipping of middle blocks, "
                        "real skipping; lossy). For lossless decoding give the same DIR as --draft instead: the gated "
                        "model then drafts and the dense model verifies")


def _run_tokenizer(train_cfg: TrainConfig):
    """The tokenizer a run of ours was trained with (the embedded corpus's BPE)."""
    from tokenizers import Tokenizer


    files = resolve_data(train_cfg.data, cache_dir(), train_cfg.tokenizer_vocab, train_cfg.val_data)
    if files.tokenizer_path is None:
        raise ValueError(f"this run was trained on {train_cfg.data!r}, whose tokenizer midlayer does not know "
                         "(GPT-2 shards); generation from it is not supported from the command line")
    return TextTokenizer(Tokenizer.from_file(str(files.tokenizer_path)), bos_id=None, eos_ids=[files.eot_id])


def cmd_generate(args: argparse.Namespace) -> int:
    check_generate_args(args)  # before any file is read: a bad flag is never blamed on a model file
    if args.model:
        model, tok = load_pretrained(args.model)
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer.json: midlayer cannot turn a prompt into tokens for it")
        if args.device:
            model = model.to(resolve_device(args.device))
    else:
        model, _, train_cfg = load_run(args.checkpoint, args.device)
        tok = _run_tokenizer(train_cfg)
    model = compress_weights(model.float(), args.weights)
    if args.weights == "q4" and not model.batch_invariant:
        # q4 is defined by its C kernels: without them it is another computation (issue 43)
        print(f"note: the q4 kernels are not available here ({kernels.unavailable_reason()}), so q4 runs through "
              "PyTorch: other bits than the kernels (tokens can differ from a machine that has them), not "
              "row-invariant, and speculative output can differ from plain greedy output at near-ties",
              file=sys.stderr)
    if args.gates:
        gates, _ = load_draft(args.gates, model)
        if not isinstance(gates, SkipGates):
            raise ValueError(f"--gates {args.gates}: a {type(gates).__name__} draft, not a train-gates output")
        model = gated_twin(model, gates.eval())
    prompt = _prompt_text(args.prompt)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        ids = tok.encode_chat(messages)
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, stop_tokens=tuple(sorted(tok.eos_ids)),
                           skip=not args.no_skip)
    engine, graphs = _engine(args, model)
    if args.draft:
        return _generate_with_draft(args, model, tok, ids, cfg, engine, graphs)
    if engine == "static":
        stream = static_stream(model, ids, cfg, graphs=graphs)
    else:
        stream = (int(t[0]) for t, _ in generate_stream(model, [ids], cfg))
    new: list[int] = []
    shown = ""
    ended = False
    for t in stream:
        if t in tok.eos_ids:
            ended = True
            break
        new.append(t)
        text = tok.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tok.decode(new)[len(shown):] + "\n")
    _say_if_cut(model, ids, len(new), ended, args.max_new_tokens)
    return 0


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


def _generate_with_draft(args: argparse.Namespace, model, tok, ids: list[int], cfg, engine: str = "dynamic",
                         graphs: str = "eager") -> int:
    import time


    if args.draft == LOOKUP:  # training-free: accuracies measured on this prompt, for --tree auto
        drafter = PromptLookupDrafter(model.cfg.vocab_size)
        acc = drafter.self_accuracies(ids)
    else:
        drafter, _, meta = load_drafter(args.draft, model)  # first: a bad draft is refused before any note
        acc = heldout_accuracies(meta, args.draft)
    if engine == "static" and (not drafter.static_step or cfg.temperature > 0):
        what = ("decodes greedily only" if cfg.temperature > 0 else
                f"does not run a {type(drafter).__name__} draft yet (it reads the dynamic cache)")
        if args.engine == "static":
            raise ValueError(f"--engine static with --draft: the static step {what}; use --engine dynamic")
        engine = "dynamic"  # auto: the dynamic engine runs every drafter
    if cfg.temperature == 0 and engine == "dynamic" and args.weights == "q4" and not model.batch_invariant:
        pass  # said once, for every q4 call without its kernels (cmd_generate)
    elif cfg.temperature == 0 and engine == "dynamic" and not getattr(model, "batch_invariant", False):
        print(f"note: {args.weights} weights are not row-invariant in the dynamic engine, so speculative output can "
              "differ from plain greedy output at near-ties; --weights q4, or --engine static where its probe finds "
              "row-invariant buckets, is bit-identical", file=sys.stderr)
    if args.tree == "auto" and not acc:
        print(f"note: {args.draft} has no held-out accuracies to size a tree by; using the top-1 chain",
              file=sys.stderr)
    tree, report = select_tree(model, drafter, acc, args.tree, model_name=args.model or args.checkpoint,
                               weights=args.weights, prompt_ids=ids, draft_key=args.draft, refresh=args.refresh_costs,
                               progress=True)
    if args.stats and report:
        print(report, file=sys.stderr)
    t = time.perf_counter()
    if engine == "static":
        out, stats = static_speculative_generate(model, ids, drafter, tree, cfg.max_new_tokens,
                                                 stop_tokens=cfg.stop_tokens, graphs=graphs)
    else:
        out, stats = speculative_generate(model, ids, drafter, tree, cfg.max_new_tokens, stop_tokens=cfg.stop_tokens,
                                          temperature=cfg.temperature, seed=cfg.seed, skip=cfg.skip)
    dt = time.perf_counter() - t
    if stats.row_invariant is False:
        print("note: the static step's buckets were not measured row-invariant on this device, so this speculative "
              "output can differ from plain greedy output at near-ties", file=sys.stderr)
    text = tok.decode([x for x in out if x not in tok.eos_ids])
    sys.stdout.write(text + "\n")
    _say_if_cut(model, ids, len(out), any(x in tok.eos_ids for x in out), cfg.max_new_tokens)
    if args.stats:
        print(f"{len(out)} tokens in {dt:.2f} s ({len(out) / dt:.1f} tok/s), tau {stats.tau:.2f} over "
              f"{stats.base_forwards} base forwards, tree of {len(tree)} nodes", file=sys.stderr)
    return 0


def tree_nodes(spec: str) -> int:
    """N of 'sparse:N' / 'dynamic:N' (a positive int), or a clear error."""
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--tree {spec!r}: N must be a positive integer")
    return n


def check_generate_args(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, every generate value outside its meaning; nothing is loaded yet."""
    import math


    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:  # NaN fails too
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.seed is not None and not -2**63 <= args.seed < 2**64:
        raise ValueError(f"--seed must be an integer in [-2**63, 2**64), got {args.seed}")
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
    if args.tree.startswith(("sparse:", "dynamic:")):
        tree_nodes(args.tree)
    elif args.tree not in ("auto", "chain"):
        raise ValueError(f"--tree: expected auto, chain, sparse:N or dynamic:N, got {args.tree!r}")
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

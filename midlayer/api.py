"""The Python API: the few names a notebook needs (issue 45, item 1), exported from `midlayer`.

    import midlayer
    llm = midlayer.LLM.load("smollm2-135m", weights="q4")          # a short name, a .gguf, or a HF folder
    llm.attach("lookup")                                             # or a train-draft / train-gates folder
    out = llm.generate([{"role": "user", "content": "Name three primes."}], max_tokens=64)
    print(out.text, out.finish_reason, out.stats.tau)

A prompt is text (`str`, encoded as is) or a chat (a list of {"role", "content"} messages, rendered with the
model's chat template; the contents stay text, so chat markup in them cannot forge a turn). `generate` takes
one prompt or a list of them and returns one `Completion` each; `stream` yields the text of one prompt as it
is decoded. Greedy speculative decoding returns the tokens plain decoding would (the q4 format is the one
called lossless on every drafter and tree; see docs/inference.md).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch
from tokenizers import Tokenizer

from midlayer.data.pretrained_tokenizer import TextTokenizer
from midlayer.common import as_integer, cache_dir
from midlayer.data.shards import resolve_data
from midlayer.engine.batch import BatchSequence, ContinuousBatch, shared_prefix, unsupported as batch_unsupported
from midlayer.engine.decode_step import static_stream
from midlayer.engine.generate import (GenerationConfig, forward_cached, generate_stream, token_logprobs,
                                      validate_prompts)
from midlayer.engine.pretrained import load_pretrained
from midlayer.engine.quantization import WEIGHT_FORMATS, compress_weights
from midlayer.model.kv_cache import KVCache, kv_dtype
from midlayer.ops import kernels
from midlayer.model.transformer import Transformer
from midlayer.speculative.lookup import PromptLookupDrafter
from midlayer.speculative.protocol import Drafter
from midlayer.speculative.registry import batch_drafting, heldout_accuracies, load_draft, load_drafter
from midlayer.speculative.skip_gates import SkipGates, gated_twin
from midlayer.speculative.static import static_speculative_generate
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.tree_cost import check_tree_spec, select_tree
from midlayer.speculative.verify import SpecStats, check_draftable, speculative_generate
from midlayer.train.checkpoint import load_model
from midlayer.train.distributed import resolve_device

Message = dict[str, Any]
Prompt = Union[str, Sequence[Message], Sequence[int]]


@dataclass
class Completion:
    """One prompt's result. finish_reason: "stop" (an end-of-turn token or a stop string) or "length"."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: SpecStats | None = None  # speculative decoding's statistics (tau, forwards), None for plain decoding
    cached_tokens: int = 0  # prompt tokens whose K/V a continuous batch reused from another row (engine/batch.py)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class LLM:
    """A loaded model with its tokenizer, and optionally a drafter for speculative decoding."""

    def __init__(self, model: Transformer, tokenizer: TextTokenizer, name: str = "model", weights: str = "fp32"
                 ) -> None:
        self.model, self.tokenizer, self.name, self.weights = model.eval(), tokenizer, name, weights
        tokenizer.cover(model.cfg.vocab_size)
        self.drafter: Drafter | None = None
        self.draft_name = ""
        self.tree_spec: str = "auto"
        self._acc: list[list[float]] | None = None
        # how it decodes: the dynamic engine (real skipping, every drafter) or the static step ("static", with
        # graphs eager / cudagraph / compile); skip: real skipping of a gated model's blocks
        self.engine, self.graphs, self.skip = "dynamic", "eager", True
        # a continuous batch's prefix reuse: the shortest shared prompt start whose K/V a joining row takes from
        # another row (0: off; engine/batch.py)
        self.prefix_reuse = 16
        # `logprobs`'s last call (ids, its KV cache, top, scores, (model, skip) it ran): a call whose ids start alike,
        # on the same model and skipping, reuses them (`use_gates` replaces the model; `skip` may change)
        self._scored: tuple[list[int], KVCache, int, list, tuple] | None = None
        self.last_stats: SpecStats | None = None  # the last speculative generation's statistics
        self.last_tree: DraftTree | None = None
        self.last_report: str | None = None  # how --tree auto chose the last tree
        self.last_choice_s = 0.0  # seconds the last generation spent choosing its tree (auto: measuring costs)
        # what the last `stream` produced (None while one runs, and after one its caller stopped early)
        self.last_completion: Completion | None = None
        self.refresh_costs = False  # tree "auto": measure the row costs and overheads again, not from the cache
        self.progress = False  # tree "auto": show the row-cost measurement's progress
    @classmethod
    def load(cls, model: str, *, weights: str = "fp32", device: str | None = None, kv_cache: str | None = None
             ) -> "LLM":
        """A pretrained model: a short name (smollm2-135m), a .gguf file or a Hugging Face folder, compressed to
        `weights` (fp32, bf16, int4, q4: the batch-invariant CPU format) on `device` (default cpu). `kv_cache`:
        fp16 or fp32 K/V (default: fp16 for q4, else the weights' dtype)."""
        _check_weights(weights)
        dev = resolve_device(device) if device is not None else None
        if weights == "q4" and dev is not None and dev.type != "cpu":
            raise ValueError("weights='q4' runs on the CPU only (its kernels are C)")
        net, tok = load_pretrained(model)
        if tok is None:
            raise ValueError(f"{model} has no tokenizer: midlayer cannot turn a prompt into tokens for it")
        if dev is not None:
            net = net.to(dev)
        return cls(compress_weights(net.float(), weights, kv=kv_cache), tok, str(model), weights)

    @classmethod
    def from_run(cls, checkpoint: str | Path, *, weights: str = "fp32", device: str | None = None,
                 kv_cache: str | None = None) -> "LLM":
        """One of our training runs (a run folder or a ckpt_*.pt file) with its corpus's tokenizer."""
        _check_weights(weights)
        net, _, tcfg = load_model(checkpoint, device)
        files = resolve_data(tcfg.data, cache_dir(), tcfg.tokenizer_vocab, tcfg.val_data)
        if files.tokenizer_path is None:
            raise ValueError(f"this run was trained on {tcfg.data!r}, whose tokenizer midlayer does not know "
                             "(GPT-2 shards); generation from it is not supported")
        tok = TextTokenizer(Tokenizer.from_file(str(files.tokenizer_path)), bos_id=None, eos_ids=[files.eot_id])
        return cls(compress_weights(net.float(), weights, kv=kv_cache), tok, str(checkpoint), weights)

    def use_gates(self, gates: str | Path) -> "LLM":
        """Generate with the model gated by a train-gates output: per-token skipping of middle blocks, real
        skipping, lossy. (For lossless decoding attach the same folder as a drafter instead.)"""
        module, _ = load_draft(gates, self.model)
        if not isinstance(module, SkipGates):
            raise ValueError(f"{gates}: a {type(module).__name__} draft, not a train-gates output")
        self.model = gated_twin(self.model, module.eval())
        return self

    # ------------------------------------------------------------------------------------ drafting
    def attach(self, draft: str | Path | Drafter | None, *, tree: str = "auto") -> "LLM":
        """Decode speculatively from now on: with a train-draft or train-gates folder, "lookup" (prompt lookup,
        no training), or a `Drafter`; None detaches. `tree`: auto (sized from the draft's accuracies and this
        machine's measured costs), chain, sparse:N or dynamic:N."""
        if draft is None:
            self.drafter, self.draft_name, self._acc = None, "", None
            return self
        check_draftable(self.model)  # (before a draft loads or a row cost is measured)
        if isinstance(draft, Drafter):
            new = (draft, type(draft).__name__, None)
        elif str(draft) == "lookup":
            new = (PromptLookupDrafter(self.model.cfg.vocab_size), "lookup", None)
        else:
            drafter, _, meta = load_drafter(draft, self.model)
            new = (drafter, str(draft), heldout_accuracies(meta, str(draft)))
        # a tree this drafter cannot draft is refused here, the drafter before it kept (not at every generate)
        check_tree_spec(new[0], tree, new[2], acc_later=hasattr(new[0], "self_accuracies"))
        self.drafter, self.draft_name, self._acc = new
        self.tree_spec = tree
        return self

    # ------------------------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text as is (with the model's own BOS rule), a chat through its template, token
        ids as they are."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif is_token_ids(prompt):
            ids = [int(t) for t in prompt]
        elif isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
            if not prompt:  # (all() of nothing: an empty list reads as a chat of no messages)
                raise ValueError("the chat is empty: give at least one message")
            ids = self.tokenizer.encode_chat(list(prompt))
        else:
            raise ValueError("a prompt is a str, a list of {'role': ..., 'content': ...} messages or a list of token "
                             f"ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        return validate_prompts(self.model, [ids])[0]  # the engine's own refusals (longer than the context, ...)

    def logprobs(self, ids: Sequence[int], top: int = 0) -> list[tuple[float | None, dict[int, float]]]:
        """Per token of `ids`: its log-probability given the tokens before it (None for the first) and the `top`
        most likely tokens at its place with theirs (empty for the first). ONE forward over the ids, the prefill
        path of generation (so in q4 the same bits as the logits generation samples from); log-softmax in fp32.
        What lm-eval's log-likelihood tasks read through the server's echo + logprobs.

        Prefix reuse (batch-invariant formats only, q4: there the result is the same bits). When the ids start
        as the last call's did for at least `prefix_reuse` tokens -- a multiple-choice task scores one context
        with each of its answers -- the forward runs only from the last shared token on, over that call's KV
        cache; the shared tokens' scores are that call's."""
        k = as_integer(top)
        if k is None or not 0 <= k <= self.model.cfg.vocab_size:
            raise ValueError(f"top must be an integer in [0, {self.model.cfg.vocab_size}], got {top!r}")
        top = k  # (a Python int from here: a 0-d tensor reached torch's topk)
        ids = validate_prompts(self.model, [list(ids)])[0]
        dev = self.model.tok_embeddings.weight.device
        tokens = torch.tensor([ids], device=dev)
        start, memo = 0, self._scored
        if (self.prefix_reuse and memo is not None and memo[2] == top and memo[4] == (self.model, self.skip)
                and getattr(self.model, "batch_invariant", False)):
            shared = shared_prefix(ids, memo[0])
            if shared >= self.prefix_reuse:
                start = shared - 1  # (row start - 1's logits score token start)
        out: list[tuple[float | None, dict[int, float]]]
        if start > 0:
            cache = memo[1] if memo[1].max_len >= len(ids) else memo[1].grown(len(ids), keep_length=True)
            cache.truncate(start)
            out = memo[3][:start + 1]
        else:
            out = [(None, {})]
            cache = KVCache.for_model(self.model.cfg, 1, max_len=len(ids), device=dev, dtype=kv_dtype(self.model))
        self._scored = None  # (the cache changes below: no half-updated memo survives an error)
        logits = forward_cached(self.model, tokens[:, start:], cache, torch.arange(start, len(ids), device=dev)[None],
                                skip=self.skip)
        # row t: the distribution of token t + 1
        out = out + token_logprobs(logits[0, :-1], tokens[0, start + 1:], top)  # type: ignore[operator]
        if not self.model.cfg.ssm_layers:  # (a state-space mixer's state cannot be rolled back to a prefix)
            self._scored = (ids, cache, top, out, (self.model, self.skip))
        return out

    def settings(self, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None
                 ) -> GenerationConfig:
        """The generation settings, checked (ValueError naming the setting): max_tokens here (at least 1), the
        rest by GenerationConfig's one rule, which keeps them as Python numbers."""
        n = as_integer(max_tokens)
        if n is None or n < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        cfg = GenerationConfig(max_new_tokens=n, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, stop_tokens=tuple(sorted(self.tokenizer.eos_ids)), skip=self.skip)
        if self.drafter is not None and cfg.temperature > 0 and (cfg.top_k or cfg.top_p < 1.0):
            raise ValueError("speculative sampling reproduces the plain softmax: top_k / top_p would change it; "
                             "drop them, or detach the drafter")
        if self.drafter is not None and cfg.temperature > 0 and self.engine == "static":
            # (its rounds accept the greedy path on the device: a temperature would be ignored, not honoured)
            raise ValueError("the static engine drafts greedily only (temperature 0); set engine = 'dynamic' for "
                             "speculative sampling, or detach the drafter")
        return cfg

    # ------------------------------------------------------------------------------------ generation
    def generate(self, prompt: Prompt | Sequence[Prompt], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] = ()
                 ) -> Completion | list[Completion]:
        """One `Completion` for one prompt, a list for a list of prompts (decoded together in one continuous batch,
        whose rows draft chains with a drafter, unless `batch_refusal` says why not, or a drafter samples: then one
        by one). Each prompt of a list gets what it would get alone: its own room in the context, its own seeded
        draws, this LLM's engine. `stop`: a string, or strings, that end a completion (cut before the string)."""
        stop = stop_strings(stop)
        if not isinstance(prompt, str) and isinstance(prompt, Sequence) and not prompt:
            raise ValueError("no prompt: give a str, a chat (a list of messages) or a list of prompts")
        many = not isinstance(prompt, str) and isinstance(prompt, Sequence) and \
            not all(isinstance(m, dict) for m in prompt) and not is_token_ids(prompt)
        prompts = list(prompt) if many else [prompt]
        cfg = self.settings(max_tokens, temperature, top_k, top_p, seed)
        ids = [self.encode(p) for p in prompts]
        # (not one padded `generate` call: it gave every row the room the longest prompt leaves, drew all rows
        # from one generator, and ran the dynamic engine whatever `engine` said)
        # (a sampled list with a drafter goes one by one: alone, a prompt's draws come from speculative sampling,
        # whose rounds draw otherwise than the batch's sampled rows, which decode plainly: the same seed gave two
        # samples)
        if len(ids) > 1 and self.batch_refusal() is None and (cfg.temperature == 0 or self.drafter is None):
            done = self._batched(ids, cfg, stop)
        else:
            done = [self._one(i, cfg, stop) for i in ids]
        return done if many else done[0]

    def _batched(self, ids: list[list[int]], cfg: GenerationConfig, stop: Sequence[str]) -> list[Completion]:
        """Many prompts through one continuous batch (stop strings end a row early; with a drafter that drafts in
        a batch, its rows draft chains)."""
        batch = self.batch(min(len(ids), 16))
        texts = {batch.add(i, cfg): (n, TextStream(self, i, stop)) for n, i in enumerate(ids)}
        done: list[Completion | None] = [None] * len(ids)
        while len(batch):
            for seq, tokens, finished in batch.step():
                n, text = texts[seq.handle]
                if stop:  # a stop string may end a row before the batch does: its text is read every step
                    done[n] = self.batch_feed(batch, seq, tokens, finished, text)[1] or done[n]
                    continue
                text.new += tokens  # else its text is decoded once, at the end (each step decoded all of it)
                if finished:
                    done[n] = self.batch_completion(seq, text)
        return [c for c in done if c is not None]

    def stream(self, prompt: Prompt, *, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] = ()) -> Iterator[str]:
        """The completion's text in pieces as it is decoded (plain decoding: token by token; with a drafter:
        round by round). A piece never ends inside a multi-byte character or a stop string."""
        stop = stop_strings(stop)
        cfg = self.settings(max_tokens, temperature, top_k, top_p, seed)
        ids = self.encode(prompt)
        self.last_stats, self.last_choice_s, self.last_completion = None, 0.0, None
        text = TextStream(self, ids, stop)
        for tokens in self._token_groups(ids, cfg):
            piece, ended = text.feed(tokens)
            if piece:
                yield piece
            if ended:
                break
        piece = text.rest()
        self.last_completion = text.completion(self.last_stats)
        if piece:
            yield piece

    # ------------------------------------------------------------------------------------ batching
    def batch_refusal(self) -> str | None:
        """Why this LLM cannot decode in a continuous batch (engine/batch.py), or None when it can."""
        if self.engine != "dynamic":
            return "the static engine decodes one sequence at a time"
        why = batch_unsupported(self.model)
        if why is not None:
            return why
        if batch_drafting(self.drafter, 1) is None:
            return (f"{type(self.drafter).__name__} is no drafter a batch runs (prompt lookup, Medusa heads, EAGLE, "
                    "hidden transfer, early exit, layer skip, skip gates): it decodes one request at a time")
        return None

    def batch(self, max_rows: int = 16, bound_windows: bool = True, memory_rows: int = 0) -> ContinuousBatch:
        """A continuous batch over this model: many sequences decoded together, joining and leaving between
        steps (the server's engine). With a drafter attached (any of ours), its greedy rows draft chains in the batch
        (`registry.batch_drafting`). `bound_windows=False`: windowed blocks (Gemma 3) keep every slot.
        `memory_rows`: cache rows that keep left sequences' K/V for follow-up turns when the batch is full."""
        why = self.batch_refusal()
        if why is not None:
            raise ValueError(f"continuous batching: {why}")
        q = self._acc[0][0] if self._acc else None  # a trained draft's held-out depth-1 top-1: the prior acceptance
        return ContinuousBatch(self.model, max_rows, skip=self.skip, prefix_reuse=self.prefix_reuse,
                               bound_windows=bound_windows, memory_rows=memory_rows,
                               **batch_drafting(self.drafter, max_rows + memory_rows, q))

    def batch_feed(self, batch: ContinuousBatch, seq: BatchSequence, tokens: list[int], finished: bool,
                   text: "TextStream") -> tuple[str, Completion | None]:
        """Hand one step's tokens of `seq` to its text: (the new text, its Completion once it has ended). A stop
        string ends it before the batch does: it leaves the batch here. The API's and the server's batch loops
        both retire sequences through this."""
        piece, ended = text.feed(tokens)
        if not (ended or finished):
            return piece, None
        if not finished:
            batch.cancel(seq.handle)
        return piece + text.rest(), self.batch_completion(seq, text)

    def batch_completion(self, seq: BatchSequence, text: "TextStream") -> Completion:
        """The Completion of a sequence that left a continuous batch, with its speculative statistics when it
        drafted and the prompt tokens it reused (`cached_tokens`)."""
        done = text.completion(self._batch_stats(seq))
        done.cached_tokens = seq.reused
        return done

    def _batch_stats(self, seq: BatchSequence) -> SpecStats | None:
        """The speculative statistics of a sequence decoded in a continuous batch (None without a drafter). The
        prompt's forward chose the first new token: counted as a round that accepted nothing, as the decode loop
        counts the round that verifies the prompt's last token (tau is then 1.0 for plain decoding here too)."""
        if self.drafter is None:
            return None
        hist = list(seq.accept_hist)
        hist[0] += bool(seq.new)
        return SpecStats(new_tokens=len(seq.new), base_forwards=seq.base_forwards, prefill_forwards=1,
                         accept_hist=hist)

    def _adaptive(self) -> bool:
        """Whether one prompt decodes in a one-row continuous batch: prompt lookup with `tree` auto. There each
        step drafts to the depth that pays from the acceptance seen so far (engine/batch.py, "When a draft
        pays"), where the up-front tree of auto can only price lookup from the prompt, which says little about
        an answer that starts repeating itself later (docs/results/gemma3-cpu.md, Gemma 3: no draft chosen,
        0.99-1.01x; the batch's rule 2.03-2.12x on the same prompts)."""
        return (isinstance(self.drafter, PromptLookupDrafter) and self.tree_spec == "auto"
                and self.batch_refusal() is None)

    def _batch_groups(self, ids: list[int], cfg: GenerationConfig) -> Iterator[list[int]]:
        """One prompt's new tokens, step by step, from a one-row continuous batch (`_adaptive`); its statistics
        in `last_stats` once the loop ends or the consumer stops it."""
        seq, steps = self.batch(1).alone(ids, cfg)
        self.last_tree = self.last_report = None  # no tree is chosen up front
        try:
            yield from steps
        finally:
            steps.close()
            self.last_stats = self._batch_stats(seq)

    # ------------------------------------------------------------------------------------ internals
    def _token_groups(self, ids: list[int], cfg: GenerationConfig) -> Iterator[list[int]]:
        """New tokens in the groups they are decoded in, up to and including an end-of-turn token."""
        if self.drafter is None:
            steps = (static_stream(self.model, ids, cfg, graphs=self.graphs) if self.engine == "static" else
                     (int(step[0]) for step, _ in generate_stream(self.model, [ids], cfg)))
            for tok in steps:
                yield [tok]
                if tok in cfg.stop_tokens:
                    return
            return
        if self._adaptive():
            yield from self._batch_groups(ids, cfg)
            return
        if self.engine == "static":  # the static loop has no per-round callback: its tokens come at once
            out, _ = self._speculate(ids, cfg)
            yield out
            return
        yield from self._rounds(ids, cfg)

    def _rounds(self, ids: list[int], cfg: GenerationConfig) -> Iterator[list[int]]:
        """The dynamic speculative loop's new tokens, round by round. The loop reports each round by callback, so
        it runs in a thread that hands the committed tokens over a queue; a round may commit past an end-of-turn
        token or the budget, so what is yielded is cut where the loop's own output ends. Closing the iterator
        early (a stop string, a client gone) stops the loop at its next round."""
        rounds: queue.Queue = queue.Queue()
        stop = threading.Event()

        def on_round(cache: Any, tokens: list[int]) -> None:
            if stop.is_set():
                raise _Stopped
            rounds.put(("round", list(tokens[len(ids):])))

        def run() -> None:
            try:
                rounds.put(("done", self._speculate(ids, cfg, on_round)[0]))
            except _Stopped:
                rounds.put(("done", None))
            except BaseException as e:  # raised again in the caller's thread
                rounds.put(("error", e))

        kernels.release_threads()  # the worker runs the kernels now (kernels.release_threads: why)
        worker = threading.Thread(target=run, name="midlayer-speculate", daemon=True)
        worker.start()
        shown = 0
        try:
            while True:
                kind, value = rounds.get()
                if kind == "error":
                    raise value
                if value is None:
                    return
                new = value if kind == "done" else _cut_tokens(value, cfg)
                if len(new) > shown:
                    yield new[shown:]
                    shown = len(new)
                if kind == "done":
                    return
        finally:
            stop.set()
            worker.join()

    def accuracies(self, ids: list[int]) -> list[list[float]] | None:
        """The attached drafter's per-rank accuracies that size its tree: a draft's held-out ones, or prompt
        lookup's measured on this prompt."""
        if isinstance(self.drafter, PromptLookupDrafter):
            return self.drafter.self_accuracies(ids)
        return self._acc

    def _speculate(self, ids: list[int], cfg: GenerationConfig, on_round: Any = None) -> tuple[list[int], SpecStats]:
        t = time.perf_counter()
        acc = self.accuracies(ids)
        tree, self.last_report = self._tree(acc, ids)
        self.last_tree, self.last_choice_s = tree, time.perf_counter() - t
        if self.engine == "static":  # greedy, for drafters that declare static_step (the caller checked)
            out, stats = static_speculative_generate(self.model, ids, self.drafter, tree, cfg.max_new_tokens,
                                                     stop_tokens=cfg.stop_tokens, graphs=self.graphs)
        else:  # (counted into last_stats as it goes: a reader that stops the loop keeps the rounds' counts)
            self.last_stats = SpecStats()
            out, stats = speculative_generate(self.model, ids, self.drafter, tree, cfg.max_new_tokens,
                                              stop_tokens=cfg.stop_tokens, temperature=cfg.temperature,
                                              seed=cfg.seed, skip=cfg.skip, on_round=on_round,
                                              stats=self.last_stats)
        self.last_stats = stats
        return out, stats

    def _tree(self, acc: list[list[float]] | None, ids: list[int]) -> tuple[DraftTree, str | None]:
        spec = self.tree_spec if (acc or self.tree_spec != "auto") else "chain"
        return select_tree(self.model, self.drafter, acc, spec, model_name=self.name, weights=self.weights,
                           prompt_ids=ids, draft_key=self.draft_name, refresh=self.refresh_costs,
                           progress=self.progress)

    def _one(self, ids: list[int], cfg: GenerationConfig, stop: Sequence[str]) -> Completion:
        """One prompt, decoded until an end-of-turn token, the budget or a stop string (with a drafter on the
        dynamic engine the loop stops at the round after the stop string appears, not at the budget)."""
        if self.drafter is not None and not stop and not self._adaptive():
            out, stats = self._speculate(ids, cfg)
            return self._completion(ids, out, stats, stop)
        self.last_stats = None
        new: list[int] = []
        groups = self._token_groups(ids, cfg)
        for tokens in groups:
            new += tokens
            if stop and self._cut(new, stop)[1]:
                break
        groups.close()  # a speculative loop still running stops at its next round
        return self._completion(ids, new, self.last_stats, stop)

    def _cut(self, tokens: list[int], stop: Sequence[str]) -> tuple[str, bool]:
        """The text of `tokens` (end-of-turn tokens dropped), cut before the first stop string; and whether a stop
        string or an end-of-turn token ended it."""
        eos = self.tokenizer.eos_ids
        ended = any(t in eos for t in tokens)
        text = self.tokenizer.decode([t for t in tokens if t not in eos])
        cuts = [text.find(s) for s in stop if s and s in text]
        if cuts:
            return text[:min(cuts)], True
        return text, ended

    def _completion(self, ids: list[int], out: list[int], stats: SpecStats | None, stop: Sequence[str]
                    ) -> Completion:
        """The Completion of `out`. Its tokens end where plain decoding, a token at a time, would have stopped: at
        the first end-of-turn token or the token that completes a stop string (a drafted round commits past it;
        the usage counted those tokens too)."""
        text, ended = self._cut(out, stop)
        if ended:  # the shortest prefix that ends as `out` ends (by bisection: ending is kept by more tokens)
            lo, hi = 1, len(out)
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._cut(out[:mid], stop)[1] else (mid + 1, hi)
            out = out[:hi]
        return Completion(text=text, token_ids=list(out), prompt_tokens=len(ids),
                          finish_reason="stop" if ended else "length", stats=stats)


class TextStream:
    """A completion's text as its tokens arrive, in pieces that never end inside a multi-byte character or a
    stop string that may still be completing: `LLM.stream` and the server's batch engine both read it."""

    SETTLE = 16  # tokens decoded again each feed at most, before they join the settled text
    CONTEXT = 4  # settled tokens decoded before them, so a decoder's rule at a text's start (a leading space) fits

    def __init__(self, llm: LLM, ids: list[int], stop: Sequence[str]) -> None:
        self.llm, self.ids, self.stop = llm, ids, list(stop)
        self.new: list[int] = []
        self.shown = ""
        self.held = max((len(s) - 1 for s in self.stop), default=0)  # a stop string may still be completing
        self.kept: list[int] = []  # the new tokens without end-of-turn tokens: what the text decodes
        self.settled, self.settled_n = "", 0  # the text of kept[:settled_n], which later tokens do not change
        self.ended = False

    def feed(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """(the new piece of text, whether a stop string or an end-of-turn token ended the completion)."""
        self.new += tokens
        text, ended = self._text(tokens)
        if not ended:
            text = text[:len(text) - self.held] if self.held else text
            if text.endswith("\ufffd") or len(text) <= len(self.shown):
                return "", False
        piece, self.shown = text[len(self.shown):], text
        return piece, ended

    def _text(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """`LLM._cut(self.new, self.stop)` without decoding all of `new` again at each feed (that made a stream
        quadratic in its length): only the tokens since the settled text are decoded, after a few settled ones
        for context, and text is settled once it ends on a whole character. Where the decoder's text of those
        context tokens is not a prefix of the longer decode, everything is decoded again."""
        if self.ended:
            return self.llm._cut(self.new, self.stop)
        eos = self.llm.tokenizer.eos_ids
        self.kept += [t for t in tokens if t not in eos]
        start = max(0, self.settled_n - self.CONTEXT)
        context = self.llm.tokenizer.decode(self.kept[start:self.settled_n])
        tail = self.llm.tokenizer.decode(self.kept[start:])
        if tail.startswith(context):
            text = self.settled + tail[len(context):]
        else:
            text = self.llm.tokenizer.decode(self.kept)
        if len(self.kept) - self.settled_n >= self.SETTLE and not text.endswith("\ufffd"):
            self.settled, self.settled_n = text, len(self.kept)
        start = max(0, len(self.shown) - self.held - max((len(s) for s in self.stop), default=0))
        cuts = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        self.ended = bool(cuts) or any(t in eos for t in tokens)
        return (text[:min(cuts)] if cuts else text), self.ended

    def rest(self) -> str:
        """What is left to show once no more tokens come."""
        text, _ = self.llm._cut(self.new, self.stop)
        piece = text[len(self.shown):] if len(text) > len(self.shown) else ""
        self.shown = max(text, self.shown, key=len)
        return piece

    def completion(self, stats: SpecStats | None) -> Completion:
        return self.llm._completion(self.ids, self.new, stats, self.stop)


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """`stop` as a list of strings: one string is one stop string (not its characters, which iterating it would
    give); ValueError for an empty string or a non-string."""
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise ValueError(f"stop: give a non-empty string or a list of them, got {stop!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop: give a non-empty string or a list of them, got {stop!r}")
    return stops


def is_token_ids(prompt: Any) -> bool:
    """True for a non-empty list of token ids (ints, not bools): a prompt given as ids (API and server)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def _check_weights(weights: str) -> None:
    """Refuse an unknown weight format before any file is read."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights: choose from {', '.join(WEIGHT_FORMATS)}, got {weights!r}")


class _Stopped(Exception):
    """Raised inside the speculative loop's round callback when the reader of `_rounds` has gone."""


def _cut_tokens(tokens: list[int], cfg: GenerationConfig) -> list[int]:
    """New tokens as the decode loops return them: up to the budget, and ending at the first stop token."""
    tokens = tokens[:cfg.max_new_tokens]
    for i, tok in enumerate(tokens):
        if tok in cfg.stop_tokens:
            return tokens[:i + 1]
    return tokens


__all__ = ["LLM", "Completion", "Prompt", "Message", "TextStream", "is_token_ids", "stop_strings"]

"""`midlayer serve`: an OpenAI-compatible HTTP server over the Python API (issue 45, item 2).

    midlayer serve --model smollm2-135m --weights q4 --draft lookup --port 8000
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Endpoints: /v1/completions and /v1/chat/completions (JSON or server-sent events with "stream": true),
/v1/models, /health, and vLLM's tokenizer endpoints /tokenize, /detokenize, /tokenizer_info (lm-eval's remote
tokenizer). /v1/completions also takes token-id prompts, several prompts per request, and `echo` + `logprobs`
(the prompt's and the completion's log-probabilities: lm-eval's log-likelihood tasks), answered whole, not
streamed. /v1/chat/completions takes `logprobs` + `top_logprobs` (OpenAI's logprobs.content over the answer),
streamed or not: the batch scores each token from the logits that chose it, each chunk carrying its own
tokens' scores (the engine that decodes one request at a time scores the answer once it is done). Requests are
checked before they are queued, and a bad one gets an OpenAI-style error ({"error": {"message", "type",
"param", "code"}}) with a 4xx status: malformed JSON, a body over the limit, an unknown model, an unknown field,
a prompt over the context, max_tokens out of range or beyond the room the prompt leaves in the context, a
non-finite or negative temperature. A field sent as null is one not sent; max_tokens not sent is 16 for a
completion (OpenAI's legacy default) and the whole room for a chat (vLLM's).

One engine thread owns the model. Every request joins one continuous batch (engine/batch.py) at its next step and
leaves it when done; with a drafter attached (prompt lookup or any trained draft), each greedy row drafts in the
batch. In q4 every output equals the request's single-request greedy output token for token. A request that would
make more than `max_queue` waiting or running is refused with 503 at once. A client that disconnects (streaming or
not), or a stop string, frees the row at the next step. On SIGTERM the server stops accepting connections, lets
running requests finish, and answers queued ones with an error: never a hang. `--max-batch 1` and the static engine
decode requests one after another instead. Chat contents are encoded as text (api.LLM.encode): markup in a message
cannot forge a turn. A failure in one request (its prompt, its text) is answered to that request alone; a failure
of a batch's forward to the requests in it. An error the engine thread does not expect stops it: running and
queued requests get it, new ones a 503, and /health answers 503 with the error, so that no client waits forever.
"""

# (no `from __future__ import annotations`: FastAPI reads the endpoints' annotations, whose types are imported
# inside create_app so that fastapi stays an optional extra)

import asyncio
import codecs
import collections
import contextlib
import importlib.util
import json
import math
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from midlayer.api import LLM, Completion, TextStream, is_token_ids
from midlayer.engine.batch import BatchSequence, ContinuousBatch
from midlayer.ops import kernels

# what an OpenAI client may send that we accept; anything else is refused by name (400)
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n", "user",
                     "logprobs", "echo", "presence_penalty", "frequency_penalty", "stream_options"}
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool", "function")  # OpenAI's ("function": deprecated)
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "echo", "logprobs"}) | {"messages", "max_completion_tokens",
                                                                     "logprobs", "top_logprobs"}
DISCONNECT_POLL_S = 0.25  # how often a whole (not streamed) request looks whether its client is still there


class RequestError(ValueError):
    """A request the server refuses: an HTTP status, a message naming the problem, and the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request_error"
                 ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.code, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One request in the engine's queue: what to decode, and where its pieces go: ("piece", text) ... then
    ("done", Completion) or ("error", message), onto `events`, an asyncio queue of the event loop `loop`. A
    request that asked for logprobs (kwargs["logprobs"], batched engine) also gets ("scores", [(token id,
    log-probability, {alternative: log-probability})]) for each step's tokens, before that step's piece."""

    prompt: Any
    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    call: Callable[[], Any] | None = None  # a whole request run at once in the engine thread: ("result", value)

    def put(self, event: tuple[str, Any]) -> None:
        """From the engine thread: hand one event over to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _deliver(outbox: list[tuple[Job, tuple[str, Any]]]) -> None:
    """Hand a step's events over with one wake-up per event loop, not one per event (with 16 streams, 16 writes to
    the loop's wake-up pipe per step, each of which may preempt a kernel thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, tuple[str, Any]]]] = {}
    for job, event in outbox:
        by_loop.setdefault(job.loop, []).append((job, event))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[Job, tuple[str, Any]]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)


class Engine:
    """The worker thread that owns the model. Batched (the default where `LLM.batch_refusal` allows it): every
    request joins one continuous batch (engine/batch.py) at the next step and leaves it when done, its slot
    freed at once when it is cancelled or its client goes away. Otherwise (`max_batch` 1, the static engine):
    requests are decoded one after another."""

    def __init__(self, llm: LLM, max_queue: int, max_batch: int = 16, memory_rows: int = 0) -> None:
        self.llm, self.max_queue = llm, max_queue
        self.batched = max_batch > 1 and llm.batch_refusal() is None
        self.max_batch = max_batch
        self.memory_rows = memory_rows  # batch cache rows that only keep left requests' K/V (follow-up turns)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.active = 0  # queued + running
        self.lock = threading.Lock()
        self.stopping = False
        self.failure: str | None = None  # why the engine thread stopped, if an error it did not expect stopped it
        self.live: dict[int, tuple[Job, TextStream]] = {}  # the batched engine's running jobs, by handle
        # the engine thread runs the kernels from now on: this thread's OpenMP pool would slow every parallel
        # region there (kernels.release_threads says how much)
        kernels.release_threads()
        self.thread = threading.Thread(target=self._main, name="midlayer-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.failure is not None:
                raise RequestError(503, f"the engine stopped after an internal error ({self.failure}); restart the "
                                        "server", code="engine_failed")
            if self.stopping:
                raise RequestError(503, "the server is shutting down", code="server_shutting_down")
            if self.active >= self.max_queue:
                raise RequestError(503, f"the server is busy: {self.active} requests are queued or running "
                                        f"(--max-queue {self.max_queue}); retry later", code="server_busy")
            self.active += 1
        self.jobs.put(job)

    def stop(self) -> None:
        """No new jobs; queued ones are answered with an error; running ones finish."""
        with self.lock:
            self.stopping = True
        self.jobs.put(None)

    def _release(self, n: int = 1) -> None:
        with self.lock:
            self.active -= n

    def _refuse_queued(self, message: str = "the server is shutting down") -> None:
        """After stop: whatever is still queued gets an answer."""
        while not self.jobs.empty():
            job = self.jobs.get_nowait()
            if job is not None:
                job.put(("error", message))
                self._release()

    def _main(self) -> None:
        """The engine thread. An error that escapes the engine's own handling (a request's failure is answered
        where it happens) must not leave clients waiting for a thread that is gone: every running and queued
        request gets the error, new ones are refused with 503, and /health reports it."""
        try:
            self._run_batched() if self.batched else self._run()
        except Exception as e:
            with self.lock:
                self.failure, self.stopping = f"{type(e).__name__}: {e}", True
            message = f"the engine stopped after an internal error ({self.failure})"
            self._fail_running(message)
            self._refuse_queued(message)

    def _fail_running(self, message: str) -> None:
        """Every running request of the batch (`live`) gets `message` as its error, and leaves the count."""
        for job, _ in self.live.values():
            job.put(("error", message))
        self._release(len(self.live))
        self.live.clear()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                break
            if self.stopping:
                job.put(("error", "the server is shutting down"))
            elif job.cancelled.is_set():  # its client went away while it waited: nothing to run
                pass
            elif job.call is not None:
                self._call(job)
            else:
                self._decode(job)
            self._release()
        self._refuse_queued()

    def _call(self, job: Job) -> None:
        """A whole request (scoring, several prompts) in the engine thread, which owns the model."""
        try:
            job.put(("result", job.call()))
        except Exception as e:
            job.put(("error", f"{type(e).__name__}: {e}"))

    def _decode(self, job: Job) -> None:
        try:
            for piece in self.llm.stream(job.prompt, **job.kwargs):
                if job.cancelled.is_set():  # the client went away: free the slot
                    return
                job.put(("piece", piece))
            job.put(("done", self.llm.last_completion))
        except Exception as e:  # a request that fails in the engine gets its error; the server goes on
            job.put(("error", f"{type(e).__name__}: {e}"))

    def _run_batched(self) -> None:
        """Long: one loop owns the batch: take new jobs (waiting for one only when nothing runs), drop cancelled
        ones, step once, hand each sequence's tokens to its job as text, and retire finished ones. After stop,
        running and already admitted requests finish; queued ones get an error."""
        batch = self.llm.batch(self.max_batch, memory_rows=self.memory_rows)
        live = self.live
        draining = False
        while True:
            while not draining:
                try:
                    job = self.jobs.get(block=not live)
                except queue.Empty:
                    break
                if job is None:
                    draining = True
                    self._refuse_unseated(batch, live)
                    break
                self._admit(batch, job, live)
            for handle, (job, _) in list(live.items()):
                if job.cancelled.is_set():  # the client went away: its row is free at once
                    batch.cancel(handle)
                    del live[handle]
                    self._release()
            if not live:
                if draining:
                    break
                continue
            try:
                events = batch.step()
            except Exception as e:  # an engine failure fails the running requests, not the server
                for handle in live:
                    batch.cancel(handle)
                self._fail_running(f"{type(e).__name__}: {e}")
                continue
            outbox: list[tuple[Job, tuple[str, Any]]] = []
            for seq, tokens, finished in events:
                self._hand_over(batch, seq, tokens, finished, outbox)
            _deliver(outbox)
        self._refuse_queued()

    def _hand_over(self, batch: ContinuousBatch, seq: BatchSequence, tokens: list[int], finished: bool,
                   outbox: list[tuple[Job, tuple[str, Any]]]) -> None:
        """One sequence's step: its scores, its new text, and its end, as events for its job. A failure here is
        this request's alone (its text, its stop strings): it gets the error and leaves the batch; the others go
        on."""
        job, text = self.live[seq.handle]
        try:
            if seq.logprobs is not None and tokens:  # this step's tokens are the last of seq.scores
                outbox.append((job, ("scores", [(t, lp, alts) for t, (lp, alts)
                                                in zip(tokens, seq.scores[len(seq.scores) - len(tokens):])])))
            piece, done = self.llm.batch_feed(batch, seq, tokens, finished, text)
        except Exception as e:
            batch.cancel(seq.handle)
            outbox.append((job, ("error", f"{type(e).__name__}: {e}")))
        else:
            if piece:
                outbox.append((job, ("piece", piece)))
            if done is None:
                return
            outbox.append((job, ("done", done)))
        del self.live[seq.handle]
        self._release()

    def _refuse_unseated(self, batch: ContinuousBatch, live: dict[int, tuple[Job, TextStream]]) -> None:
        """After stop: the admitted requests that hold no row yet are queued ones, answered with an error (they ran
        on through the grace period, and were cut by it)."""
        for handle, (job, _) in list(live.items()):
            seq = batch.by_handle.get(handle)
            if seq is not None and seq.row < 0:
                batch.cancel(handle)
                del live[handle]
                job.put(("error", "the server is shutting down"))
                self._release()

    def _admit(self, batch: ContinuousBatch, job: Job, live: dict[int, tuple[Job, TextStream]]) -> None:
        if job.cancelled.is_set() or job.call is not None:  # a whole request runs now, between two steps
            if job.call is not None and not job.cancelled.is_set():
                self._call(job)
            self._release()
            return
        k = job.kwargs
        try:
            ids = self.llm.encode(job.prompt)
            cfg = self.llm.settings(k["max_tokens"], k["temperature"], k.get("top_k", 0), k["top_p"], k["seed"])
            handle = batch.add(ids, cfg, logprobs=k.get("logprobs"))
        except Exception as e:  # checked before queueing; a failure here is the engine's, answered as such
            job.put(("error", f"{type(e).__name__}: {e}"))
            self._release()
            return
        live[handle] = (job, TextStream(self.llm, ids, k.get("stop", ())))


def _check_fields(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RequestError(400, f"{name} must be a finite number in [{lo}, {hi}], got {v!r}", param=name)
    return float(v)


def _sampling(body: dict, llm: LLM, max_name: str = "max_tokens", scoring: bool = False) -> dict[str, Any]:
    """The generation settings of a request, each checked (400 naming the field). `scoring`: a completion that
    may ask for log-probabilities (`logprobs` 0-5) and an `echo` of the prompt, and then for 0 new tokens. A
    field sent as null is one not sent (OpenAI's API). max_tokens not given is None here: `_budget` sets it
    from the prompts' length."""
    ctx = llm.model.cfg.max_seq_len
    max_tokens = body.get(max_name)
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    echo = body.get("echo") or False
    lo = 0 if scoring and echo else 1
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or not lo <= max_tokens <= ctx):
        raise RequestError(400, f"{max_name} must be an integer in [{lo}, {ctx}] (the model's context), got "
                                f"{max_tokens!r}", param=max_name)
    if body.get("stream") not in (None, True, False):
        raise RequestError(400, f"stream must be true or false, got {body.get('stream')!r}", param="stream")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
        raise RequestError(400, f"seed must be an integer, got {seed!r}", param="seed")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
    if body.get("n") not in (None, 1):
        raise RequestError(400, "n must be 1 (one completion per request)", param="n")
    logprobs = body.get("logprobs")
    if not scoring and (logprobs not in (None, False) or body.get("top_logprobs") is not None):
        raise RequestError(400, "logprobs are served by /v1/completions only", param="logprobs")
    if scoring and logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                             or not 0 <= logprobs <= 5):
        raise RequestError(400, f"logprobs must be an integer in [0, 5], got {logprobs!r}", param="logprobs")
    if not isinstance(echo, bool):
        raise RequestError(400, f"echo must be true or false, got {echo!r}", param="echo")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(400, f"{name} is not supported (only 0)", param=name)
    temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError(400, "top_p must be > 0", param="top_p")
    out = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop)
    if scoring:
        out.update(logprobs=logprobs, echo=echo)
    return out


def _budget(kwargs: dict[str, Any], prompt_tokens: int, ctx: int, default: int | None, name: str) -> None:
    """kwargs["max_tokens"] against the room the longest prompt (`prompt_tokens`) leaves in the context `ctx`:
    when given, at most that room (400 naming the field: a completion cut short by the context, or a prompt
    that cannot be scored with it, would not be what was asked); when not, `default` (None: the whole room, as
    vLLM's chat does), within the room. The room is vLLM's, prompt + max_tokens <= ctx (the engine itself could
    give one token more: its last token is never fed)."""
    room, least = ctx - prompt_tokens, 0 if kwargs.get("echo") else 1
    asked = kwargs["max_tokens"]
    if room < least:  # (not "ask for at most 0", which the field's own check refuses)
        raise RequestError(400, f"the prompt's {prompt_tokens} tokens fill the model's context of {ctx}: no "
                                "room for a completion", param=name)
    if asked is None:
        asked = room if default is None else min(default, room)
    elif asked > room:
        raise RequestError(400, f"the prompt's {prompt_tokens} tokens and {name} {asked} exceed the model's context of "
                                f"{ctx} tokens: ask for at most {room}", param=name)
    kwargs["max_tokens"] = asked


def _chat_logprobs(body: dict) -> int | None:
    """A chat request's ask for log-probabilities: None (not asked), else how many most likely alternatives
    (`top_logprobs`, 0-5) to give beside each token's own (400 naming the field otherwise)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp not in (None, False, True):
        raise RequestError(400, f"logprobs must be true or false, got {lp!r}", param="logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5):
        raise RequestError(400, f"top_logprobs must be an integer in [0, 5], got {top!r}", param="top_logprobs")
    if top is not None and not lp:
        raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if lp else None


def _chat_scored(llm: LLM, messages: list[dict], kw: dict[str, Any], top: int) -> tuple[list[dict], int, int]:
    """A chat completion with OpenAI's `logprobs.content`: per token of the answer's content (the end-of-turn
    token is not content), its text, log-probability, UTF-8 bytes and the `top` most likely tokens at its place,
    from one forward over the prompt and the answer (`LLM.logprobs`). Returns (choices, prompt and completion
    tokens)."""
    ids = llm.encode(messages)
    done = llm.generate(ids, max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_p=kw["top_p"],
                        seed=kw["seed"], stop=kw["stop"])
    new = done.token_ids
    scored = llm.logprobs(ids + new, top)[len(ids):]
    content = ContentScores(llm).take([(t, lp, alts) for t, (lp, alts) in zip(new, scored)], done.text)
    choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
              "logprobs": {"content": content}, "finish_reason": done.finish_reason}
    return [choice], len(ids), len(new)


class ContentScores:
    """OpenAI's chat logprobs.content, chunk by chunk, for the tokens whose text the answer shows: a token is
    given once the text shown so far reaches its first byte, so the tokens of a stop string (cut from the
    answer) and the end-of-turn token are never given, and the tokens given spell the answer. Each entry: the
    token's text, its log-probability, its bytes (`TextTokenizer.token_bytes`: a character split over tokens
    has its bytes in each, where the token's text is U+FFFD) and its alternatives, most likely first.

    Long: the answer's text is the tokens' bytes decoded as UTF-8 with U+FFFD for what is not (a model may make
    invalid bytes), so the i-th character shown ends at the byte where an incremental decoder gives it out
    (`ends`); a decoder that drops the first token's leading space (sentencepiece) shows `lead` characters
    fewer."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.pending, self.raw, self.shown = llm, collections.deque(), 0, 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.ends: list[int] = []  # the byte just after each character of the tokens' text
        self.lead: int | None = None

    def take(self, scores: list[tuple[int, float, dict[int, float]]], text: str) -> list[dict[str, Any]]:
        """The entries for `scores` (token id, log-probability, alternatives), the tokens scored since the last
        call, now that `text` is shown after what was shown before."""
        tok = self.llm.tokenizer
        for t, lp, alts in scores:
            if t in tok.eos_ids:
                continue
            b = tok.token_bytes(t)
            if self.lead is None:
                self.lead = max(0, len(b.decode("utf-8", "replace")) - len(tok.decode([t])))
            self.pending.append((self.raw, t, lp, alts))
            for i in range(len(b)):
                self.ends += [self.raw + i + 1] * len(self.utf8.decode(b[i:i + 1]))
            self.raw += len(b)
        self.shown += len(text)
        k = self.shown + (self.lead or 0)  # characters of the tokens' text shown
        upto = self.raw if k > len(self.ends) else self.ends[k - 1] if k else 0
        out = []
        while self.pending and self.pending[0][0] < upto:
            _, t, lp, alts = self.pending.popleft()
            out.append(dict(self._entry(t, lp), top_logprobs=[self._entry(a, v) for a, v in
                                                              sorted(alts.items(), key=lambda x: -x[1])]))
        return out

    def _entry(self, t: int, lp: float) -> dict[str, Any]:
        tok = self.llm.tokenizer
        return {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.token_bytes(t))}


def _include_usage(body: dict, stream: bool) -> bool:
    """OpenAI's stream_options.include_usage (400 naming the field when it is not {"include_usage": bool} or comes
    without a stream)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise RequestError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"} or \
            opts.get("include_usage") not in (None, True, False):
        raise RequestError(400, f"stream_options must be {{\"include_usage\": true or false}}, got {opts!r}",
                           param="stream_options")
    return bool(opts.get("include_usage"))


def _last_chunks(last: dict, include_usage: bool) -> list[dict]:
    """A stream's last chunk (the finish reason; the usage where it was not asked apart), and with include_usage
    OpenAI's own last one: no choices, the usage."""
    if not include_usage:
        return [last]
    usage = last.pop("usage", None)
    return [last, {**{k: last[k] for k in ("id", "object", "created", "model")}, "choices": [], "usage": usage}]


async def _as_chunks(response: Any, include_usage: bool = False) -> AsyncIterator[str]:
    """A whole chat completion (or its error response) as server-sent events: one chunk with the answer and its
    logprobs, then one with the finish reason and usage (`_last_chunks`). How a server that decodes one request at
    a time streams a request with logprobs: the tokens are scored after the answer is done (`_chat_scored`)."""
    if not isinstance(response, dict):  # an error: its body as the one event
        yield f"data: {response.body.decode()}\n\n"
        return
    choice = response["choices"][0]
    base = {k: response[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    first = {"index": 0, "delta": {"role": "assistant", "content": choice["message"]["content"]},
             "logprobs": choice["logprobs"], "finish_reason": None}
    last = {"index": 0, "delta": {}, "logprobs": {"content": []}, "finish_reason": choice["finish_reason"]}
    for chunk in [dict(base, choices=[first]), *_last_chunks(dict(base, choices=[last], usage=response["usage"]),
                                                             include_usage)]:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def _prompts(prompt: Any) -> list[Any]:
    """A completion request's prompts: a string, a list of token ids, or a list of either (400 otherwise)."""
    if isinstance(prompt, str) or is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_token_ids(p) for p in prompt):
        return prompt
    raise RequestError(400, "prompt must be a string, a list of token ids, or a non-empty list of either",
                       param="prompt")


def _scored_choices(llm: LLM, prompts: list[Any], kw: dict[str, Any]) -> tuple[list[dict], int, int]:
    """Long: the choices of a completion request run whole (several prompts, echo, logprobs), in OpenAI's legacy
    shape: per prompt its completion (unless max_tokens is 0), with the prompt's text in front when `echo`,
    and with `logprobs` the tokens, their log-probabilities (None for the very first) and the top ones at each
    place, over the echoed prompt and the completion. Returns (choices, prompt tokens, completion tokens)."""
    tok = llm.tokenizer
    choices, n_prompt, n_new = [], 0, 0
    for i, prompt in enumerate(prompts):
        ids = llm.encode(prompt)
        new, finish = [], "length"
        if kw["max_tokens"] > 0:
            done = llm.generate(ids, max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_p=kw["top_p"],
                                seed=kw["seed"], stop=kw["stop"])
            new, finish, text = done.token_ids, done.finish_reason, done.text
        else:
            text = ""
        n_prompt, n_new = n_prompt + len(ids), n_new + len(new)
        shown = ids + new if kw["echo"] else new
        logprobs = None
        if kw["logprobs"] is not None:
            scored = llm.logprobs(ids + new, kw["logprobs"])[0 if kw["echo"] else len(ids):]
            pieces = [tok.decode([t]) for t in shown]
            offsets, at = [], 0
            for piece in pieces:
                offsets.append(at)
                at += len(piece)
            logprobs = {"tokens": pieces, "token_logprobs": [lp for lp, _ in scored],
                        "top_logprobs": [None if lp is None else {tok.decode([t]): v for t, v in top.items()}
                                         for lp, top in scored],
                        "text_offset": offsets}
        prefix = tok.decode(ids) if kw["echo"] and not isinstance(prompt, str) else (prompt if kw["echo"] else "")
        choices.append({"text": prefix + text, "index": i, "logprobs": logprobs, "finish_reason": finish})
    return choices, n_prompt, n_new


def create_app(llm: LLM, model_name: str, *, max_queue: int = 16, max_body: int = 1 << 20, max_batch: int = 16,
               memory_rows: int = 0):
    """The ASGI app (FastAPI) serving `llm` as `model_name`. The engine thread starts with the app.

    Long: the endpoints are closures over one engine, one model and its name (FastAPI's usual shape); each
    endpoint is a few lines, and the checks they share are the module's functions."""
    from fastapi import FastAPI, Request  # an optional extra (pip install 'midlayer[serve]'): imported here,
    from fastapi.responses import JSONResponse, StreamingResponse  # so that midlayer runs without it

    engine = Engine(llm, max_queue, max_batch, memory_rows)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.stop()  # on shutdown (SIGTERM): queued requests get an error, running ones finish
        await asyncio.to_thread(engine.thread.join, 30)  # the engine thread ends before the process does

    app = FastAPI(title="midlayer", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def read_json(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body:
            raise RequestError(413, f"the request body is {size} bytes; the limit is {max_body}")
        raw = await request.body()
        if len(raw) > max_body:
            raise RequestError(413, f"the request body is {len(raw)} bytes; the limit is {max_body}")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON ({e})") from None

    def check_model(body: dict) -> None:
        if body.get("model") not in (None, model_name):
            raise RequestError(404, f"model {body.get('model')!r} is not served here; this server serves "
                                    f"{model_name!r}", param="model", code="model_not_found")

    def check(prompt: Any, kwargs: dict[str, Any]) -> int:
        """The API's own refusals (an empty prompt, one over the context, a bad message, settings a drafter
        cannot reproduce) before the request is queued. Returns the prompt's length in tokens."""
        try:
            n = len(llm.encode(prompt))
        except ValueError as e:
            raise RequestError(400, str(e), param="messages" if isinstance(prompt, list) and prompt and
                               isinstance(prompt[0], dict) else "prompt") from None
        try:
            llm.settings(max(kwargs["max_tokens"] or 1, 1), kwargs["temperature"], 0, kwargs["top_p"], kwargs["seed"])
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        return n

    @contextlib.asynccontextmanager
    async def watched(request: Request, job: Job) -> AsyncIterator[None]:
        """While a whole (not streamed) answer is awaited: a client that goes away cancels its job, which frees
        its place in the queue (and its batch row at the next step), and wakes the waiting coroutine with
        ("gone", None). (A stream learns it from its response: `run`'s sse.)"""
        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            job.cancelled.set()
            job.events.put_nowait(("gone", None))

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            job.cancelled.set()

    def queue_job(prompt: Any, kwargs: dict, call: Callable[[], Any] | None = None) -> Job:
        """A job for the engine whose events come back on this event loop; refused (503) when the queue is full."""
        job = Job(prompt, kwargs, asyncio.get_running_loop(), asyncio.Queue(), call=call)
        engine.submit(job)
        return job

    def failed(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                       "code": "server_error"}}, status_code=500)

    async def run_whole(request: Request, call: Callable[[], tuple[list[dict], int, int]], rid: str, name: str,
                        kind: str = "text_completion") -> Any:
        """A request the engine thread answers at once (no stream): its choices and usage."""
        job = queue_job(None, {}, call)
        async with watched(request, job):
            event, value = await job.events.get()
        if event != "result":
            return failed(value or "the client went away")
        choices, n_prompt, n_new = value
        return {"id": rid, "object": kind, "created": int(time.time()), "model": name,
                "choices": choices, "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_new,
                                              "total_tokens": n_prompt + n_new}}

    async def run(request: Request, prompt: Any, kwargs: dict, stream: bool,
                  shape: Callable[[str, str | None, Completion | None, list], dict], include_usage: bool = False
                  ) -> Any:
        """A request decoded by the engine, streamed or whole. `shape(text, finish reason, completion, scores)`
        makes a response (or a chunk) of a piece of text and the scores of the tokens it came with."""
        job = queue_job(prompt, kwargs)
        events = job.events
        scores: list = []  # ("scores" events) the tokens scored since the last piece

        async def sse() -> AsyncIterator[str]:
            try:
                while True:
                    kind, value = await events.get()
                    if kind == "scores":
                        scores.extend(value)
                    elif kind == "piece":
                        yield f"data: {json.dumps(shape(value, None, None, scores))}\n\n"
                        scores.clear()
                    elif kind == "done":
                        for chunk in _last_chunks(shape('', value.finish_reason, value, scores), include_usage):
                            yield f"data: {json.dumps(chunk)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                        return
            finally:
                job.cancelled.set()  # finished, or the client went away: either way the engine may stop

        if stream:
            return StreamingResponse(sse(), media_type="text/event-stream")
        text = []
        async with watched(request, job):
            while True:
                kind, value = await events.get()
                if kind == "scores":
                    scores.extend(value)
                elif kind == "piece":
                    text.append(value)
                elif kind == "done":
                    return shape("".join(text), value.finish_reason, value, scores)
                else:
                    return failed(value or "the client went away")

    def usage(done: Completion | None) -> dict[str, int] | None:
        if done is None:
            return None
        # OpenAI's prompt_tokens_details.cached_tokens: the prompt's start whose K/V were reused (engine/batch.py)
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    @app.get("/health")
    async def health() -> Any:
        state = {"status": "ok", "model": model_name, "queued_or_running": engine.active,
                 "batching": engine.max_batch if engine.batched else 1}
        if engine.failure is not None:  # (503: a load balancer's health check takes this server out)
            return JSONResponse({**state, "status": "error", "error": engine.failure}, status_code=503)
        return state

    # the tokenizer, as vLLM's server exposes it: lm-eval's remote tokenizer reads these (no hub download)
    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = llm.tokenizer
        eos = min(tok.eos_ids) if tok.eos_ids else None
        return {"eos_token": None if eos is None else tok.decode([eos]),
                "bos_token": None if tok.bos_id is None else tok.decode([tok.bos_id]), "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": llm.model.cfg.max_seq_len}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = _check_fields(await read_json(request), {"model", "prompt", "add_special_tokens"})
        check_model(body)
        if not isinstance(body.get("prompt"), str):
            raise RequestError(400, "prompt must be a string", param="prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):  # ("no" was true)
            raise RequestError(400, "add_special_tokens must be true or false", param="add_special_tokens")
        ids = llm.tokenizer.encode(body["prompt"], add_bos=None if special else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.model.cfg.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = _check_fields(await read_json(request), {"model", "tokens"})
        check_model(body)
        ids = body.get("tokens")
        V = llm.model.cfg.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V
                                                for t in ids):
            raise RequestError(400, f"tokens must be a list of token ids in [0, {V})", param="tokens")
        return {"prompt": llm.tokenizer.decode(ids)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "midlayer"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = _check_fields(await read_json(request), COMPLETION_FIELDS)
        check_model(body)
        prompts = _prompts(body.get("prompt"))
        kwargs = _sampling(body, llm, scoring=True)
        # (OpenAI's legacy default: 16 new tokens)
        _budget(kwargs, max(check(p, kwargs) for p in prompts), llm.model.cfg.max_seq_len, 16, "max_tokens")
        rid, stream = f"cmpl-{uuid.uuid4().hex}", bool(body.get("stream"))
        include_usage = _include_usage(body, stream)
        echo, logprobs = kwargs.pop("echo"), kwargs.pop("logprobs")
        if len(prompts) > 1 or echo or logprobs is not None:  # answered whole, by the engine thread
            if stream:
                raise RequestError(400, "stream is not supported with several prompts, echo or logprobs",
                                   param="stream")
            scored = dict(kwargs, echo=echo, logprobs=logprobs)
            return await run_whole(request, lambda: _scored_choices(llm, prompts, scored), rid, model_name)
        prompt = prompts[0]

        def shape(text: str, finish: str | None, done: Completion | None, scores: list) -> dict:
            out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                   "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if done is not None:
                out["usage"] = usage(done)
            return out

        return await run(request, prompt, kwargs, stream, shape, include_usage)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = _check_fields(await read_json(request), CHAT_FIELDS)
        check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestError(400, "messages must be a non-empty list of {'role': str, 'content': str}",
                               param="messages")
        for i, m in enumerate(messages):  # OpenAI's roles; another was rendered into the template as given
            if m["role"] not in CHAT_ROLES:
                raise RequestError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                                   f"{m['role'][:40]!r}", param=f"messages[{i}].role")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        top = _chat_logprobs(body)
        name = "max_tokens" if body.get("max_tokens") is not None or body.get("max_completion_tokens") is None \
            else "max_completion_tokens"
        kwargs = _sampling({k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}, llm, name)
        _budget(kwargs, check(messages, kwargs), llm.model.cfg.max_seq_len, None, name)
        rid, stream = f"chatcmpl-{uuid.uuid4().hex}", bool(body.get("stream"))
        include_usage = _include_usage(body, stream)
        if top is not None and not engine.batched:  # scored by a second forward, answered whole (`_chat_scored`)
            whole = run_whole(request, lambda: _chat_scored(llm, messages, kwargs, top), rid, model_name,
                              "chat.completion")
            if not stream:
                return await whole
            return StreamingResponse(_as_chunks(await whole, include_usage), media_type="text/event-stream")
        if top is not None:  # the batch scores each token from the logits that chose it
            kwargs["logprobs"] = top
        first, content = [True], ContentScores(llm)

        def shape(text: str, finish: str | None, done: Completion | None, scores: list) -> dict:
            choice: dict[str, Any] = {"index": 0}
            if stream:
                delta: dict[str, str] = {"content": text} if text or finish is None else {}
                if first[0]:
                    delta["role"] = "assistant"
                    first[0] = False
                out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": model_name, "choices": [choice]}
                choice["delta"] = delta
            else:
                out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                       "choices": [choice]}
                choice["message"] = {"role": "assistant", "content": text}
            if top is not None:
                choice["logprobs"] = {"content": content.take(scores, text)}
            choice["finish_reason"] = finish
            if done is not None:
                out["usage"] = usage(done)
            return out

        return await run(request, messages, kwargs, stream, shape, include_usage)

    return app


def require_serve_extra() -> None:
    """Refuse, before any model is loaded, where the serve extra (fastapi, uvicorn) is missing: the command
    loaded the model for seconds and then stopped on a bare "No module named 'uvicorn'"."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"serving needs the serve extra ({', '.join(missing)} missing): pip install 'midlayer[serve]'")


def require_free_address(host: str, port: int) -> None:
    """Refuse, before any model is loaded, an address the server could not listen on (a port another server
    holds, a host that is not this machine's): the command loaded the model, printed uvicorn's start-up lines
    and then stopped on "[Errno 98] ... address already in use", exit 3. Bound as uvicorn binds (SO_REUSEADDR)
    and let go at once; a server that takes the port in between still fails in uvicorn."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}): is another server using it? "
                         "Choose another --port or --host") from None


def serve(llm: LLM, model_name: str, *, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16,
          max_batch: int = 16, memory_rows: int = 0) -> None:
    """Run the server until SIGINT / SIGTERM: queued requests are answered with an error at once, running ones
    finish (within uvicorn's 30 s grace), then it stops."""
    import uvicorn  # the optional extra: imported here, so that midlayer runs without it

    app = create_app(llm, model_name, max_queue=max_queue, max_batch=max_batch, memory_rows=memory_rows)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # the engine stops with the signal: its queue was refused only after the grace period (the app's
            # lifespan ends there), and so ran on through it and was cut, with a plain-text 500 or a broken stream
            app.state.engine.stop()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)).run()

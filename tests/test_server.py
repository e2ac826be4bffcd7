"""`midlayer serve` (issue 45, item 2, first part): a real server on a free localhost port, spoken to by the
`openai` client and by raw HTTP. Outputs equal the API's single-request greedy output token for token, also
under 8 concurrent clients; bad and hostile requests get clear 4xx errors while the server keeps serving; a
full queue answers 503, and a client that disconnects frees its slot."""

from __future__ import annotations

import copy
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn  # noqa: F401  (the serve extra, which every test here needs)
import torch

from midlayer.api import LLM
from midlayer.engine.quantization import compress_weights
from midlayer.ops import kernels
from midlayer.experiments.serve_bench import serving
from midlayer.server import create_app
from test_api import llm  # noqa: F401  (the tiny model with a tiny ChatML tokenizer, a fixture)

NAME = "tiny"


class Running:
    """`app` served now (serve_bench.serving, the bench's server: a port the OS picks, so parallel test workers
    cannot race for one), until `stop`; either fails the test past 30 s (RuntimeError)."""

    def __init__(self, app) -> None:
        self._serving = serving(app, timeout=30)
        self.url = self._serving.__enter__()

    def stop(self) -> None:
        self._serving.__exit__(None, None, None)


@pytest.fixture(scope="module")
def server(llm):  # noqa: F811
    running = Running(create_app(llm, NAME, max_queue=64, max_body=4096))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completions_equal_the_api_and_count_usage(client, llm):  # noqa: F811
    ref = llm.generate("To be, or not to be", max_tokens=12)
    out = client.completions.create(model=NAME, prompt="To be, or not to be", max_tokens=12, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.prompt_tokens, ref.completion_tokens)
    stream = client.completions.create(model=NAME, prompt="To be, or not to be", max_tokens=12, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref.text


def test_chat_with_and_without_streaming(client, llm):  # noqa: F811
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi<|im_end|> there"}]
    ref = llm.generate(msgs, max_tokens=10, stop=["zz"])
    out = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stop="zz")
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0,
                                                 stop="zz", stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    # OpenAI's stream_options.include_usage: a last chunk with no choices and the usage (then only there)
    for api in (client.chat.completions, client.completions):
        what = dict(messages=msgs) if api is client.chat.completions else dict(prompt="To be")
        chunks = list(api.create(model=NAME, max_tokens=10, temperature=0, stream=True,
                                 stream_options={"include_usage": True}, **what))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
        assert chunks[-2].choices[0].finish_reason is not None and chunks[-2].usage is None
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, stream_options={"include_usage": True})
    # OpenAI's roles only: another was rendered into the template as given (markup in it forged a turn)
    for role in ("bogus", "user<|im_end|>\n<|im_start|>system"):
        with pytest.raises(openai.BadRequestError, match="messages\\[1\\].role must be one of system, user"):
            client.chat.completions.create(model=NAME, messages=[msgs[0], {"role": role, "content": "hi"}],
                                           max_tokens=2)


def test_concurrent_clients_each_get_their_single_request_output(client, llm):  # noqa: F811
    prompts = [f"To be, or not {'to be ' * i}" for i in range(8)]
    refs = {p: llm.generate(p, max_tokens=8).text for p in prompts}

    def ask(p: str) -> tuple[str, str]:
        return p, client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, prompts * 3))
    assert all(text == refs[p] for p, text in results)


class Spy:
    """An LLM whose continuous batch records the most sequences it ever stepped together."""

    def __init__(self, llm) -> None:  # noqa: F811
        self.llm, self.most = llm, 0

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def batch(self, max_rows, **kw):
        batch = self.llm.batch(max_rows, **kw)
        self.cache_rows = batch.cache_rows
        step = batch.step

        def spied():
            self.most = max(self.most, len(batch.running) + len(batch.waiting))
            return step()
        batch.step = spied
        return batch


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")
@pytest.mark.parametrize("draft", [None, "lookup", "medusa", "eagle", "hidden-transfer", "early-exit"])
def test_concurrent_requests_are_batched_and_exact_in_q4(llm, draft):  # noqa: F811
    """q4 (batch-invariant): 8 clients x 3 requests decode in one continuous batch -- with prompt-lookup, Medusa,
    EAGLE, hidden-transfer or early-exit drafts verified in the batch -- and every output equals the
    single-request greedy output, token for token."""
    from midlayer.speculative.eagle import EagleDrafter, EagleHead
    from midlayer.speculative.early_exit import EarlyExitDrafter, EarlyExitHead
    from midlayer.speculative.hidden_transfer import HiddenTransfer, HiddenTransferDrafter
    from midlayer.speculative.medusa import MedusaDrafter, MedusaHeads

    q4 = LLM(compress_weights(copy.deepcopy(llm.model), "q4"), llm.tokenizer, "tiny", "q4")
    prompts = [f"To be, or not {'to be ' * i}" for i in range(8)]
    refs = {p: q4.generate(p, max_tokens=12).token_ids for p in prompts}
    kind = draft
    if draft == "medusa":
        heads = MedusaHeads(q4.model.cfg.dim, 3)
        torch.manual_seed(0)
        for lin in heads.heads:
            lin.weight.data.normal_(0, 0.05)
        draft = MedusaDrafter(q4.model, heads)
    elif draft == "eagle":  # the identity start: it drafts the token the base chose last
        draft = EagleDrafter(q4.model, EagleHead.for_model(q4.model))
    elif draft == "hidden-transfer":  # identity maps after the last block: it drafts the pending token again
        L = q4.model.cfg.n_layers
        draft = HiddenTransferDrafter(q4.model, HiddenTransfer(q4.model.cfg.dim, [L // 2, L, L]))
    elif draft == "early-exit":  # an identity exit at block L // 2
        draft = EarlyExitDrafter(q4.model, EarlyExitHead(q4.model.cfg.dim, q4.model.cfg.n_layers // 2))
    q4.attach(draft)
    assert q4.batch_refusal() is None
    spy = Spy(q4)
    running = Running(create_app(spy, NAME, max_queue=64, memory_rows=2))  # (EAGLE's draft rows: 16 + 2)
    try:
        c = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask(p: str) -> tuple[str, str, int]:
            out = c.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0)
            return p, out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, prompts * 3))
        # one request after another: the second finds the first's K/V still in the row (engine/batch.py, prefix
        # reuse; EAGLE only as far as its draft rows were fed, which depends on when it drafted)
        again = [ask(prompts[-1]) for _ in range(2)]
    finally:
        running.stop()
    assert all(text == q4.tokenizer.decode([t for t in refs[p] if t not in q4.tokenizer.eos_ids])
               for p, text, _ in results + again)
    assert spy.most > 1 and spy.cache_rows == 16 + 2  # requests really shared steps; the memory rows came through
    if kind != "eagle":
        assert again[1][2] == len(q4.encode(prompts[-1])) - 1


def _check_chat_logprobs(url: str, llm: LLM, exact: bool) -> None:  # noqa: F811
    """Chat logprobs, whole and streamed: per token of the answer's content its text, log-probability, bytes and
    most likely alternatives (OpenAI's logprobs.content), the values one forward over prompt and answer gives
    (LLM.logprobs): bit for bit where `exact`. The stream's chunks carry the scores of their own tokens. With a
    stop string, the tokens given are those whose text the answer shows: they spell it (the last may run into
    the cut stop string), and the stop string's own tokens are not given."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "To be, or not"}]
    ids = llm.encode(messages)
    plain = llm.generate(messages, max_tokens=6)
    content = [t for t in plain.token_ids if t not in llm.tokenizer.eos_ids]
    ref = llm.logprobs(ids + plain.token_ids, 2)[len(ids):]
    same = (lambda a, b: a == b) if exact else (lambda a, b: a == pytest.approx(b, abs=1e-4))
    out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=2)
    chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain.text
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason
    assert chunks[-1].usage.completion_tokens == len(plain.token_ids)
    apart = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                           stream=True, stream_options={"include_usage": True}))
    assert apart[-1].choices == [] and apart[-1].usage.completion_tokens == len(plain.token_ids)
    for got in (out.choices[0].logprobs.content, streamed):
        assert len(got) == len(content)
        for entry, t, (lp, alts) in zip(got, content, ref):
            assert entry.token == llm.tokenizer.decode([t]) and same(entry.logprob, lp)
            assert entry.bytes == list(llm.tokenizer.token_bytes(t))
            assert same([a.logprob for a in entry.top_logprobs], sorted(alts.values(), reverse=True))
    assert out.choices[0].message.content == plain.text and out.object == "chat.completion"
    assert out.usage.completion_tokens == len(plain.token_ids)
    long = llm.generate(messages, max_tokens=12)
    assert len(long.text) >= 6, long.text  # (the test's premise: an answer with a middle to stop in)
    at = max(3, long.text.find("\ufffd") + 1)  # (after a character the tiny model made of invalid bytes, if any)
    stop = long.text[at:at + 2]
    cut = long.text[:long.text.find(stop)]
    ref = llm.logprobs(ids + long.token_ids, 2)[len(ids):]
    out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                    top_logprobs=2, stop=stop)
    chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=2, stop=stop, stream=True))
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop"
    for got in (out.choices[0].logprobs.content, streamed):
        spelt = [b"".join(bytes(e.bytes) for e in got[:n]).decode("utf-8", "replace") for n in (len(got), -1)]
        assert spelt[0].startswith(cut) and len(spelt[1]) < len(cut), (spelt, cut)
        assert all(same(e.logprob, lp) for e, (lp, _) in zip(got, ref))


def test_chat_logprobs(server, client, llm):  # noqa: F811
    """Chat logprobs from the batched fp32 engine (whose decode rows may differ from a prefill's in the last
    bits); refused with top_logprobs beyond 5 or without logprobs."""
    _check_chat_logprobs(server.url, llm, exact=False)
    messages = [{"role": "user", "content": "To be, or not"}]
    for bad, param in [(dict(top_logprobs=1), "top_logprobs"), (dict(logprobs=True, top_logprobs=6), "top_logprobs"),
                       (dict(logprobs="yes"), "logprobs")]:
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": NAME, "messages": messages, "max_tokens": 2, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, bad


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")
@pytest.mark.parametrize("max_batch", [16, 1])
def test_chat_logprobs_in_q4_equal_one_forward_bit_for_bit(llm, max_batch):  # noqa: F811
    """q4: the continuous batch scores each token from the logits that chose it (max_batch 16), and the engine
    that decodes one request at a time scores the answer with a second forward (max_batch 1); both give the
    bits of one forward over prompt and answer, whole and streamed."""
    q4 = LLM(compress_weights(copy.deepcopy(llm.model), "q4"), llm.tokenizer, "tiny", "q4")
    app = create_app(q4, NAME, max_queue=64, max_batch=max_batch)
    assert app.state.engine.batched == (max_batch > 1)
    running = Running(app)
    try:
        _check_chat_logprobs(running.url, q4, exact=True)
    finally:
        running.stop()


def test_echo_logprobs_several_prompts_and_the_tokenizer_endpoints(server, client, llm):  # noqa: F811
    """The legacy completion fields lm-eval's log-likelihood tasks use: echo + logprobs over the prompt (and
    the completion), token-id prompts, several prompts per request; and vLLM's tokenizer endpoints."""
    ids = llm.encode("To be, or not")
    out = client.completions.create(model=NAME, prompt="To be, or not", max_tokens=0, echo=True, logprobs=2)
    ch = out.choices[0]
    ref = llm.logprobs(ids, 2)
    assert ch.text == "To be, or not" and ch.logprobs.token_logprobs[0] is None
    assert ch.logprobs.token_logprobs[1:] == [lp for lp, _ in ref[1:]]
    assert [sorted(t.values()) for t in ch.logprobs.top_logprobs[1:]] == [sorted(t.values()) for _, t in ref[1:]]
    assert ch.logprobs.tokens == [llm.tokenizer.decode([t]) for t in ids]
    # token ids and a string in one request, each with 3 new tokens: the completion's own log-probabilities
    out = client.completions.create(model=NAME, prompt=[ids, "whether"], max_tokens=3, temperature=0, logprobs=0)
    new = llm.generate(ids, max_tokens=3).token_ids
    assert out.choices[0].text == llm.generate(ids, max_tokens=3).text
    assert out.choices[0].logprobs.token_logprobs == [lp for lp, _ in llm.logprobs(ids + new)[len(ids):]]
    assert out.choices[1].text == llm.generate("whether", max_tokens=3).text
    assert out.usage.prompt_tokens == len(ids) + len(llm.encode("whether"))
    for bad, param in [(dict(logprobs=6), "logprobs"), (dict(echo=True, stream=True), "stream"),
                       (dict(echo="yes"), "echo"), (dict(prompt=[[]]), "prompt"), (dict(prompt=[1.5]), "prompt")]:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, bad
    toks = httpx.post(f"{server.url}/tokenize", json={"prompt": "To be<|im_end|>", "add_special_tokens": False})
    assert toks.json()["tokens"] == llm.tokenizer.encode("To be<|im_end|>", add_bos=False)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": toks.json()["tokens"]})
    assert back.json()["prompt"] == "To be<|im_end|>"
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]}).status_code == 400
    bad = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "add_special_tokens": "no"})  # ("no" was true)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == llm.model.cfg.max_seq_len


@pytest.mark.parametrize("kw,status,words", [
    (dict(model="other"), 404, "not served here"), (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=10**9), 400, "max_tokens"), (dict(temperature=-1), 400, "temperature"),
    (dict(prompt="x" * 2000), 400, "context"), (dict(prompt=""), 400, "empty"),
    (dict(extra_body={"best_of": 3}), 400, "unknown field"), (dict(n=2), 400, "n must be 1"),
])
def test_bad_requests_get_clear_errors(client, kw, status, words):
    args = {**dict(model=NAME, prompt="hello", max_tokens=4, temperature=0), **kw}
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status and words in str(e.value)


def test_the_context_bounds_max_tokens_and_null_is_not_given(server, llm):  # noqa: F811
    """max_tokens is checked against the room the prompt leaves in the context (a prompt of 120 tokens in 128
    takes at most 8 new ones; asked for 20, the answer is a 400 naming max_tokens, with logprobs too, which
    once failed in the scoring forward), and a field sent as null is one not sent: a completion then takes
    OpenAI's 16 new tokens (within the room) and a chat the whole room. The whole answers' object is theirs."""
    ctx = llm.model.cfg.max_seq_len
    url = f"{server.url}/v1"
    long = [5] * 120
    for extra in ({}, {"logprobs": 1}):
        r = httpx.post(f"{url}/completions", json={"prompt": long, "max_tokens": 20, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "at most 8" in r.json()["error"]["message"]
    for extra in ({}, {"max_tokens": 1}):  # (given 1, it said "ask for at most 0", which the field refuses)
        r = httpx.post(f"{url}/completions", json={"prompt": [5] * ctx, **extra})
        assert r.status_code == 400 and "no room" in r.json()["error"]["message"], extra
    r = httpx.post(f"{url}/completions", json={"prompt": long, "max_tokens": None, "n": None, "temperature": 0,
                                               "logprobs": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert r.json()["usage"]["completion_tokens"] == len(llm.generate(long, max_tokens=8).token_ids)
    r = httpx.post(f"{url}/completions", json={"prompt": "To be", "temperature": 0})
    assert r.json()["choices"][0]["text"] == llm.generate("To be", max_tokens=16).text
    msgs = [{"role": "user", "content": "To be, or not"}]
    room = ctx - len(llm.encode(msgs))
    ref = llm.generate(msgs, max_tokens=room)
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        r = httpx.post(f"{url}/chat/completions", json={"messages": msgs, "temperature": 0, **extra})
        assert r.json()["choices"][0]["message"]["content"] == ref.text, extra
        assert r.json()["usage"]["completion_tokens"] == len(ref.token_ids)
    r = httpx.post(f"{url}/chat/completions", json={"messages": msgs, "max_tokens": room + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{url}/chat/completions", json={"messages": msgs, "stream": "false"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_hostile_bodies_and_the_server_keeps_serving(server, client):
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, content=b'{"prompt": "hi", "max_tokens": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, content=b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(url, json={"model": NAME, "prompt": "x" * 5000})
    assert r.status_code == 413
    r = httpx.post(url, json=[1, 2])
    assert r.status_code == 400
    assert client.completions.create(model=NAME, prompt="hello", max_tokens=2, temperature=0).choices[0].text is not None


class Held:
    """The tiny LLM, whose first request holds the engine after its first piece until `release` is set: a request
    that is surely running while the test sends the next ones (the tiny model would finish in milliseconds)."""

    def __init__(self, llm) -> None:  # noqa: F811
        self.llm, self.release, self.held = llm, threading.Event(), False
        self.after = 0  # pieces (serial engine) or steps (batched) made after the release

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def stream(self, prompt, **kw):  # the serial engine (max_batch 1)
        for i, piece in enumerate(self.llm.stream(prompt, **kw)):
            self.after += self.release.is_set()
            yield piece
            if i == 0 and not self.held:
                self.held = True
                self.release.wait(30)

    def batch(self, max_rows, **kw):  # the batched engine: the first step after which a sequence has text holds it
        batch = self.llm.batch(max_rows, **kw)
        step = batch.step

        def held_step():
            self.after += self.release.is_set()
            if self.held == "next":  # the engine has handed out the last step's text: hold here
                self.held = True
                self.release.wait(30)
            out = step()
            shown = [self.llm.tokenizer.decode(seq.new) for seq, _, _ in out]
            if any(t and not t.endswith("\ufffd") for t in shown) and not self.held:
                self.held = "next"
            return out
        batch.step = held_step
        return batch



class FailingText:
    """The tiny LLM, whose batch fails to hand over the text of one prompt's tokens (as a tokenizer that cannot
    decode a token would), every time."""

    def __init__(self, llm, bad: str) -> None:  # noqa: F811
        self.llm, self.bad = llm, llm.encode(bad)

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def batch_feed(self, batch, seq, tokens, finished, text):
        if text.ids == self.bad:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return self.llm.batch_feed(batch, seq, tokens, finished, text)


def test_a_request_whose_text_fails_gets_its_error_and_the_others_their_output(llm):  # noqa: F811
    """A failure in one row's text (its decoding, its stop strings) is that request's: it gets a 500 naming the
    error and leaves the batch, while the requests stepped beside it get their single-request output and the
    server goes on serving (before, the error escaped the engine thread, which died: every request hung)."""
    prompts = [f"To be, or not {'to be ' * i}" for i in range(4)]
    refs = {p: llm.generate(p, max_tokens=12).text for p in prompts}
    running = Running(create_app(FailingText(llm, prompts[2]), NAME, max_queue=16))
    url = f"{running.url}/v1/completions"
    try:
        def ask(p: str) -> httpx.Response:
            return httpx.post(url, json={"model": NAME, "prompt": p, "max_tokens": 12, "temperature": 0},
                              timeout=60)
        with ThreadPoolExecutor(4) as pool:
            answers = dict(zip(prompts * 2, pool.map(ask, prompts * 2)))
        for p, r in answers.items():
            if p == prompts[2]:
                assert r.status_code == 500 and "UnicodeDecodeError" in r.json()["error"]["message"], r.text
            else:
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == refs[p]
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 200 and health.json()["queued_or_running"] == 0
        assert ask(prompts[0]).json()["choices"][0]["text"] == refs[prompts[0]]
    finally:
        running.stop()


class FailingStep:
    """The tiny LLM, whose batch's first step fails (as a forward that runs out of memory would)."""

    def __init__(self, llm) -> None:  # noqa: F811
        self.llm = llm

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def batch(self, max_rows, **kw):
        batch = self.llm.batch(max_rows, **kw)
        step, calls = batch.step, [0]

        def failing():
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("out of memory")
            return step()
        batch.step = failing
        return batch


def test_a_failed_batch_step_fails_its_requests_and_the_server_goes_on(llm):  # noqa: F811
    """A step's forward is shared: its failure is answered to the requests in it (a 500 naming the error), their
    rows are freed, and the engine serves the next request as before."""
    running = Running(create_app(FailingStep(llm), NAME, max_queue=16))
    url = f"{running.url}/v1/completions"
    body = {"model": NAME, "prompt": "To be", "max_tokens": 8, "temperature": 0}
    try:
        first = httpx.post(url, json=body, timeout=30)
        assert first.status_code == 500 and "RuntimeError: out of memory" in first.json()["error"]["message"]
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 200 and health.json()["queued_or_running"] == 0
        again = httpx.post(url, json=body, timeout=30)
        want = llm.generate("To be", max_tokens=8).text
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == want
    finally:
        running.stop()


def test_an_engine_that_fails_answers_every_request_and_health_says_so(llm, monkeypatch):  # noqa: F811
    """An error the engine thread does not expect (here: handing a step's events to the event loop) stops it.
    The running request gets the error, the next ones a 503 at once, and /health a 503 naming the error:
    never a client left waiting for a thread that is gone."""
    import midlayer.server as server_module

    def broken(outbox):
        raise RuntimeError("the event loop is gone")
    monkeypatch.setattr(server_module, "_deliver", broken)
    running = Running(create_app(llm, NAME, max_queue=16))
    url = f"{running.url}/v1/completions"
    body = {"model": NAME, "prompt": "To be", "max_tokens": 8, "temperature": 0}
    try:
        first = httpx.post(url, json=body, timeout=30)
        assert first.status_code == 500 and "the event loop is gone" in first.json()["error"]["message"]
        again = httpx.post(url, json=body, timeout=30)
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_failed"
        assert "the event loop is gone" in again.json()["error"]["message"]
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert health.json()["queued_or_running"] == 0
    finally:
        running.stop()

@pytest.mark.parametrize("max_batch", [1, 16])
def test_a_full_queue_answers_503_and_a_disconnect_frees_the_slot(llm, max_batch):  # noqa: F811
    held = Held(llm)
    running = Running(create_app(held, NAME, max_queue=1, max_batch=max_batch))
    assert httpx.get(f"{running.url}/health").json()["batching"] == max_batch
    try:
        url = f"{running.url}/v1/completions"
        body = {"model": NAME, "prompt": "To be", "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", url, json=body) as first:
                next(first.iter_lines())  # the first request is running
                busy = httpx.post(url, json={**body, "stream": False, "max_tokens": 2})
                assert busy.status_code == 503 and "busy" in busy.json()["error"]["message"]
            held.release.set()
            # the client went away mid-stream: its slot is freed at the engine's next token
            t = time.time()
            while httpx.get(f"{running.url}/health").json()["queued_or_running"]:
                assert time.time() - t < 30
                time.sleep(0.05)
        ok = httpx.post(url, json={**body, "stream": False, "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        running.stop()


@pytest.mark.parametrize("max_batch", [1, 16])
def test_a_whole_request_whose_client_goes_away_frees_its_slot(llm, max_batch):  # noqa: F811
    """A client of a whole (not streamed) answer that gives up is noticed too: its job is cancelled, so the
    engine stops decoding it at its next step or piece (not after all of max_tokens) and its place in the
    queue is free for the next request."""
    from midlayer.server import DISCONNECT_POLL_S

    body = {"prompt": "To be", "max_tokens": 100, "temperature": 0}
    assert llm.generate("To be", max_tokens=100).completion_tokens > 50  # (the premise: a long answer to cut)
    held = Held(llm)
    running = Running(create_app(held, NAME, max_queue=1, max_batch=max_batch))
    url = f"{running.url}/v1/completions"
    try:
        with pytest.raises(httpx.ReadTimeout):  # the request is held running; the client gives up after 1 s
            httpx.post(url, json=body, timeout=httpx.Timeout(30, read=1.0))
        time.sleep(8 * DISCONNECT_POLL_S)
        held.release.set()
        t = time.time()
        while httpx.get(f"{running.url}/health").json()["queued_or_running"]:
            assert time.time() - t < 30
            time.sleep(0.05)
        assert held.after <= 2, held.after
        assert httpx.post(url, json={**body, "max_tokens": 2}).status_code == 200
    finally:
        running.stop()


SERVE_SCRIPT = """
import sys
from test_api import VOCAB, CHATML, train_tiny_bpe, make_tiny
from midlayer.api import LLM
from midlayer.data.pretrained_tokenizer import TextTokenizer
from midlayer.server import serve
import time
from midlayer.engine.batch import ContinuousBatch
step = ContinuousBatch.step
ContinuousBatch.step = lambda self: (time.sleep(0.02), step(self))[1]  # ~2 s a 100-token request
tok = train_tiny_bpe(VOCAB)
text = TextTokenizer(tok, bos_id=None, eos_ids=[tok.token_to_id("<|im_end|>")], chat_template=CHATML)
model = make_tiny(dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=128,
                       multiple_of=32), False)
serve(LLM(model, text, "tiny"), "tiny", port=int(sys.argv[1]), max_batch=2)
"""


def test_sigterm_stops_the_server_cleanly_with_requests_in_flight(tmp_path):
    """SIGTERM with streams open: the requests that hold a row of the batch end with their whole text, the queued
    ones at once with an error event (they ran on through uvicorn's grace period and were cut by it), never a
    hang, and the process exits."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "serve_tiny.py"
    script.write_text(SERVE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'tests'}"}
    # port 0: the child binds a port the OS picks and uvicorn logs it; a port picked here beforehand could be
    # taken by a parallel test worker's server before the child binds it
    proc = subprocess.Popen([sys.executable, str(script), "0"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read_log() -> None:
        for line in proc.stderr:
            lines.append(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        t, url = time.time(), None
        while url is None:
            assert reader.is_alive(), "the server exited: " + "".join(lines)[-2000:]
            assert time.time() - t < 60, "the server did not start: " + "".join(lines)[-2000:]
            time.sleep(0.1)
            found = [m.group(1) for m in map(re.compile(r"running on (http://\S+)").search, list(lines)) if m]
            url = found[0] if found else None
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        ends: list[str] = []
        started: list[int] = []

        def stream() -> None:
            body = {"model": NAME, "prompt": "To be", "max_tokens": 100, "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    started.append(1)  # (the server answered: the request is in its engine)
                    last = ""
                    for line in r.iter_lines():
                        last = line or last
                shut = '"message": "the server is shutting down"' in last
                ends.append("done" if last == "data: [DONE]" else "refused" if shut else f"cut: {last[:80]}")
            except httpx.HTTPError as e:
                ends.append(f"error: {type(e).__name__}")

        clients = [threading.Thread(target=stream) for _ in range(4)]
        for c in clients:
            c.start()
        t = time.time()
        while len(started) < 4 and time.time() - t < 30:
            time.sleep(0.05)
        time.sleep(0.3)  # (the two rows have decoded a few tokens: ~2 s of each request's 100 is left)
        proc.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(timeout=60)
        assert not any(c.is_alive() for c in clients), "a client hung"
        # uvicorn stops gracefully, then re-raises the signal so that the parent sees how its child ended
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        reader.join(timeout=60)
        log = "".join(lines)
        assert "Application shutdown complete" in log and "Finished server process" in log, log[-2000:]
        assert sorted(ends) == ["done", "done", "refused", "refused"], ends  # (2 rows: --max-batch 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")
def test_bench_serves_client_rows_count_tokens_and_reused_prompt_tokens(llm):  # noqa: F811
    """`midlayer bench serve`'s client side (experiments/serve_bench.py) against a real server: one streamed
    request gives the greedy text, its token count and the prompt tokens the server reused; a row of 2 clients
    over 4 requests (one prompt asked four times) finds every answer equal to its single-request text and part
    of the prompts reused (the server's prefix reuse). Each row has a fresh server: a second row of the same
    requests reuses what the first did, not the first row's prompts whole (59th session: the rows shared one
    server, and its warm-up asked the first measured prompt)."""
    from midlayer.experiments.serve_bench import _clients, _one_request, serve_table

    q4 = LLM(compress_weights(copy.deepcopy(llm.model), "q4"), llm.tokenizer, "tiny", "q4")
    q4.prefix_reuse = 4
    text = "To be, or not to be, that is the question"
    messages = [{"role": "user", "content": text}]
    ref = q4.generate(messages, max_tokens=6)
    running = Running(create_app(q4, NAME, max_queue=8))
    try:
        got, ttft, tpot, n, prompt, cached = _one_request(running.url, NAME, text, 6)
        assert (got, n, prompt) == (ref.text, len(ref.token_ids), len(q4.encode(messages))) and cached >= 0
    finally:
        running.stop()
    rows = _clients(lambda: serving(create_app(q4, NAME, max_queue=8)), NAME, [text] * 4, [2, 2], 6, "tiny",
                    {text: ref.text})
    row, again = rows
    assert row["equal"] == 4 and row["tokens"] == 4 * len(ref.token_ids) and 0 < row["reused"] < 1
    assert again["reused"] == row["reused"] and again["equal"] == 4
    table = serve_table(dict(model="tiny", weights="q4", max_tokens=6, rows=[dict(row, vs_one_client=None)]))
    assert f"{100 * row['reused']:.0f}%" in table.splitlines()[-1]


def test_bench_serve_quantiles_are_interpolated_and_a_short_prompt_set_is_refused():
    """p50 of two requests is their mean, not the slower one; p90 of ten values lies between the ninth and the
    tenth (it was the maximum). More requests than the prompt set holds is refused before the model loads (55
    base prompts served 55 of the 64 requests --help promised)."""
    from midlayer.experiments import serve_bench
    from midlayer.experiments.bench import heldout_texts

    assert serve_bench._pct([3.0, 1.0], 0.5) == 2.0 and serve_bench._pct([5.0], 0.9) == 5.0
    assert serve_bench._pct([float(i) for i in range(1, 11)], 0.9) == pytest.approx(9.1)
    assert serve_bench._pct([1.0, 2.0, 4.0], 0.5) == 2.0 and math.isnan(serve_bench._pct([], 0.5))
    n = len(heldout_texts(10_000, "base"))
    with pytest.raises(ValueError, match=f"need {n + 1} prompts; the base prompt set holds {n} held-out ones"):
        serve_bench.bench_serve(model="no-such-model", clients=(1, n + 1), requests_per_client=1, prompts="base")


def test_whole_answers_count_total_tokens(server, llm):  # noqa: F811
    """A completion answered whole (several prompts, echo, logprobs): total_tokens = prompt + completion."""
    r = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": ["To be", "whether"],
                                                          "max_tokens": 3, "temperature": 0})
    u = r.json()["usage"]
    n_prompt = len(llm.encode("To be")) + len(llm.encode("whether"))
    assert u["prompt_tokens"] == n_prompt and u["completion_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u


def test_stop_takes_up_to_four_strings_and_a_zero_top_p_is_named(server):
    url = f"{server.url}/v1/completions"
    body = {"model": NAME, "prompt": "To be", "max_tokens": 1, "temperature": 0}
    assert httpx.post(url, json={**body, "stop": ["a1", "b2", "c3", "d4"]}).status_code == 200
    r = httpx.post(url, json={**body, "stop": ["a1", "b2", "c3", "d4", "e5"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    r = httpx.post(url, json={**body, "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text


def test_a_seeded_sample_is_the_apis(client, llm):  # noqa: F811
    """temperature 1 with a seed: the server's sample is the API's sample alone with that seed."""
    ref = llm.generate("To be", max_tokens=12, temperature=1.0, seed=11)
    for stream in (False, True):
        out = client.completions.create(model=NAME, prompt="To be", max_tokens=12, temperature=1.0, seed=11,
                                        stream=stream)
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == ref.text, stream

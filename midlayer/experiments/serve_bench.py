"""`midlayer bench serve`: the server under concurrent clients (issue 45). A real `midlayer serve` runs in this
process on a free localhost port; for each concurrency c, c client threads stream chat completions of
held-out prompts (the same max(clients) x requests_per_client requests at every concurrency, shared out
among the c clients; greedy, `max_tokens` each) through the OpenAI-compatible endpoint, each row against a fresh
server warmed up by a prompt of its own (`_clients`). Reported per row:
aggregate output tokens/s over the wall time, time to first token and time per output token (p50 / p90 over
requests), and that every output equals the API's single-request output. Plain and speculative (`--draft`,
default prompt lookup) run one after the other on the same prompts, each with its continuous batch.

Beside them, where `llama-cpp-python` is installed with its server extra (`pip install 'llama-cpp-python[server]'`,
built from source) and the model is a GGUF: llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`)
in a child process on the same GGUF, the same prompts and the same threads. Its own tokens are counted from its
stream (one chunk per token) when it reports no usage.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Iterator, Sequence

from midlayer.api import LLM
from midlayer.engine.pretrained import resolve_pretrained
from midlayer.experiments.bench import heldout_texts, machine_line, probe_llama_cpp
from midlayer.server import create_app, require_serve_extra


# Each row's warm-up request: a prompt outside every held-out set, so that no measured request finds its own
# prompt held by the server (beyond the chat template's start, which a running server has always seen)
WARM_UP = "Say hello in one word."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app: Any, timeout: float = 60.0) -> Iterator[str]:
    """A uvicorn server of the ASGI `app` in a thread on a port the OS picks; yields its URL, stops it after.
    RuntimeError if it has not started within `timeout` seconds, or has not stopped within them once asked.
    (Also the tests' server: tests/test_server.Running.)"""
    import uvicorn  # the serve extra

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    while not server.started:
        if not thread.is_alive() or time.perf_counter() - t0 > timeout:
            server.should_exit = True
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
    if thread.is_alive():
        raise RuntimeError("the server did not stop")


def _pct(values: list[float], q: float) -> float:
    """The q-quantile, linearly interpolated between the sorted values (numpy's default): p50 is the median (the
    upper of two values was taken for it, and p90 of ten values was their maximum)."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def _one_request(url: str, name: str, text: str, max_tokens: int
                 ) -> tuple[str, float, float, int, int | None, int | None]:
    """(text, seconds to the first token, seconds per later token, output tokens, prompt tokens, prompt tokens
    the server reused: OpenAI's usage.prompt_tokens_details.cached_tokens; None where the server does not say) of
    one streamed chat request. The client is the standard library's http.client: the clients share the server's
    cores, and a lighter client leaves more of them to the server it measures."""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    host, port = url.rsplit("//", 1)[1].split(":")
    t0 = time.perf_counter()
    first = None
    pieces, usage, chunks = [], None, 0
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        for raw in iter(r.readline, b""):
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            piece = chunk["choices"][0]["delta"].get("content") or ""
            if piece and first is None:
                first = time.perf_counter()
            chunks += bool(piece)
            pieces.append(piece)
            usage = chunk.get("usage") or usage
    finally:
        conn.close()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else chunks
    first = first or end
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return "".join(pieces), first - t0, (end - first) / max(n - 1, 1), n, (usage or {}).get("prompt_tokens"), cached


def _clients(serve: Callable[[], ContextManager[str]], name: str, texts: list[str], clients: Sequence[int],
             max_tokens: int, label: str, ref: dict[str, str] | None) -> list[dict[str, Any]]:
    """One row per concurrency c: the same requests, shared out among c client threads, each row against a fresh
    server (`serve()`: a context that yields its URL) warmed up by one request of WARM_UP. Fresh, because a
    server keeps finished requests' K/V for their follow-ups (prefix reuse): a row asking the previous row's
    prompts again found them whole and skipped their prefill, and the warm-up's prompt was the first measured
    one (a 98% reused share where a new server reuses the chat template's start), which flattered the rows'
    time to first token and throughput."""
    rows = []
    for c in clients:
        with serve() as url:
            _one_request(url, name, WARM_UP, 4)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                results = list(pool.map(lambda t: (t, *_one_request(url, name, t, max_tokens)), texts))
            wall = time.perf_counter() - t0
        tokens = sum(r[4] for r in results)
        known = [r for r in results if r[5] and r[6] is not None]
        reused = sum(r[6] for r in known) / sum(r[5] for r in known) if known else None
        rows.append(dict(mode=label, clients=c, requests=len(texts), tokens=tokens, tok_s=tokens / wall, reused=reused,
                         ttft_p50=_pct([r[2] for r in results], 0.5), ttft_p90=_pct([r[2] for r in results], 0.9),
                         tpot_p50=_pct([r[3] for r in results], 0.5), tpot_p90=_pct([r[3] for r in results], 0.9),
                         equal=None if ref is None else sum(r[1] == ref[r[0]] for r in results)))
    return rows


@contextlib.contextmanager
def _llama_cpp_server(gguf: str, threads: int) -> Iterator[str]:
    """llama.cpp's server on the GGUF in a child process; yields its URL once it answers, stops it after."""
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                             "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
                             "--n_ctx", "2048", "--interrupt_requests", "False"],  # queue, never cut a stream
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() - t0 > 300:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _llama_cpp_rows(gguf: str, texts: list[str], clients: Sequence[int], max_tokens: int, threads: int
                    ) -> list[dict[str, Any]]:
    """llama.cpp's own server on the GGUF, in a child process (module docstring), started anew for each row as
    ours is; [] when it cannot run."""
    try:
        import llama_cpp.server  # noqa: F401  (the optional extra: only its presence is checked here)
        probe_llama_cpp(gguf, threads)
    except ImportError as e:
        print(f"no llama.cpp server rows: {e}", file=sys.stderr)
        return []
    import httpx

    version = getattr(sys.modules.get("llama_cpp"), "__version__", "?")
    try:
        return _clients(lambda: _llama_cpp_server(gguf, threads), "llama.cpp", texts, clients, max_tokens,
                        f"llama.cpp server {version}", None)
    except (httpx.HTTPError, RuntimeError) as e:  # its failure costs its rows, not midlayer's
        print(f"no llama.cpp server rows: {type(e).__name__}: {e}", file=sys.stderr)
        return []


def bench_serve(model: str = "smollm2-135m", weights: str = "q4", draft: str | None = "lookup",
                clients: Sequence[int] = (1, 4, 16), requests_per_client: int = 4, max_tokens: int = 64,
                prompts: str = "scaled", llama_cpp: bool = True) -> dict[str, Any]:
    """Rows of the module docstring, for plain decoding, (with `draft`) speculative decoding, and (with
    `llama_cpp`, where it is installed) llama.cpp's server."""
    import torch

    require_serve_extra()  # (before the model loads; `serving` imports uvicorn when a row starts)
    if not clients or min(clients) < 1 or requests_per_client < 1 or max_tokens < 1:
        raise ValueError("clients, requests per client and max_tokens must be >= 1")
    texts = heldout_texts(max(clients) * requests_per_client, prompts)
    if len(texts) < max(clients) * requests_per_client:  # (it served fewer requests than it said)
        raise ValueError(f"--requests-per-client {requests_per_client}: {max(clients)} clients x {requests_per_client} "
                         f"requests need {max(clients) * requests_per_client} prompts; the {prompts} prompt set holds "
                         f"{len(texts)} held-out ones")
    llm = LLM.load(model, weights=weights)
    rows = []
    for mode in ["plain"] + ([f"draft {draft}"] if draft else []):
        llm.attach(draft if mode != "plain" else None, tree="auto")
        ref = {t: llm.generate([{"role": "user", "content": t}], max_tokens=max_tokens).text for t in texts}
        rows += _clients(lambda: serving(create_app(llm, model, max_queue=max(clients) * 2)), model, texts, clients,
                         max_tokens, f"midlayer {mode}", ref)
    gguf = str(resolve_pretrained(model).path)
    if llama_cpp and gguf.endswith(".gguf"):
        rows += _llama_cpp_rows(gguf, texts, clients, max_tokens, torch.get_num_threads())
    single = {r["mode"]: r["tok_s"] for r in rows if r["clients"] == 1}
    for r in rows:
        r["vs_one_client"] = r["tok_s"] / single[r["mode"]] if r["mode"] in single else None
    return dict(model=model, weights=weights, max_tokens=max_tokens, rows=rows)


def serve_table(r: dict[str, Any]) -> str:
    out = [machine_line(), "", f"{r['model']} ({r['weights']}), streamed chat requests of up to {r['max_tokens']} "
           "tokens, greedy; midlayer decodes the requests in one continuous batch (with a drafter, its chains verified "
           "in the batch); llama.cpp's server decodes them one after another", "",
           "| mode | clients | requests | aggregate tok/s | vs 1 client | TTFT p50 / p90 (s) | TPOT p50 / p90 (ms) "
           "| prompt tokens reused | = single-request output |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        vs = f"{x['vs_one_client']:.2f}x" if x["vs_one_client"] else "-"
        equal = "-" if x["equal"] is None else f"{x['equal']}/{x['requests']}"
        reused = "-" if x.get("reused") is None else f"{100 * x['reused']:.0f}%"
        out.append(f"| {x['mode']} | {x['clients']} | {x['requests']} | {x['tok_s']:.1f} | {vs} | "
                   f"{x['ttft_p50']:.2f} / {x['ttft_p90']:.2f} | {1e3 * x['tpot_p50']:.1f} / {1e3 * x['tpot_p90']:.1f} "
                   f"| {reused} | {equal} |")
    return "\n".join(out)

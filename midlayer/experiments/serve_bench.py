"""`midlayer bench serve`: the server under concurrent clients (issue 45). A real `midlayer serve` runs in this
process on a free localhost port; for each concurrency c, c client threads stream chat completions of
held-out prompts (the same max(clients) x requests_per_client requests at every concurrency, shared out
among the c clients; greedy, `max_tokens` each) through the OpenAI-compatible endpoint. Reported per row: aggregate output tokens/s over the wall time, time to first token and time per
output token (p50 / p90 over requests), and that every output equals the API's single-request output.
Plain and speculative (`--draft`, default prompt lookup) run one after the other on the same prompts.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from midlayer.api import LLM
from midlayer.experiments.bench import heldout_texts, machine_line
from midlayer.server import create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _one_request(url: str, name: str, text: str, max_tokens: int) -> tuple[str, float, float, int]:
    """(text, seconds to the first token, seconds per later token, output tokens) of one streamed chat request."""
    import httpx  # the serve extra, as the server itself

    body = {"model": name, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    pieces, usage = [], None
    with httpx.Client(timeout=600) as c, c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            piece = chunk["choices"][0]["delta"].get("content") or ""
            if piece and first is None:
                first = time.perf_counter()
            pieces.append(piece)
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    first = first or end
    return "".join(pieces), first - t0, (end - first) / max(n - 1, 1), n


def bench_serve(model: str = "smollm2-135m", weights: str = "q4", draft: str | None = "lookup",
                clients: Sequence[int] = (1, 4, 16), requests_per_client: int = 2, max_tokens: int = 64,
                prompts: str = "scaled") -> dict[str, Any]:
    """Rows of the module docstring, for plain decoding and (with `draft`) speculative decoding."""
    import uvicorn  # the serve extra

    if not clients or min(clients) < 1 or requests_per_client < 1 or max_tokens < 1:
        raise ValueError("clients, requests per client and max_tokens must be >= 1")
    llm = LLM.load(model, weights=weights)
    texts = heldout_texts(max(clients) * requests_per_client, prompts)
    rows = []
    for mode in ["plain"] + ([f"draft {draft}"] if draft else []):
        llm.attach(draft if mode != "plain" else None, tree="auto")
        ref = {t: llm.generate([{"role": "user", "content": t}], max_tokens=max_tokens).text for t in texts}
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(llm, model, max_queue=max(clients) * 2), host="127.0.0.1",
                                               port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        try:
            _one_request(url, model, texts[0], 4)  # warm-up
            for c in clients:
                work = texts  # the same requests at every concurrency: only the number of clients changes
                t0 = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    results = list(pool.map(lambda t: (t, *_one_request(url, model, t, max_tokens)), work))
                wall = time.perf_counter() - t0
                tokens = sum(r[4] for r in results)
                rows.append(dict(mode=mode, clients=c, requests=len(work), tokens=tokens, tok_s=tokens / wall,
                                 ttft_p50=_pct([r[2] for r in results], 0.5), ttft_p90=_pct([r[2] for r in results], 0.9),
                                 tpot_p50=_pct([r[3] for r in results], 0.5), tpot_p90=_pct([r[3] for r in results], 0.9),
                                 equal=sum(r[1] == ref[r[0]] for r in results)))
        finally:
            server.should_exit = True
            thread.join(timeout=60)
    single = {r["mode"]: r["tok_s"] for r in rows if r["clients"] == 1}
    for r in rows:
        r["vs_one_client"] = r["tok_s"] / single[r["mode"]] if r["mode"] in single else None
    return dict(model=model, weights=weights, max_tokens=max_tokens, rows=rows)


def serve_table(r: dict[str, Any]) -> str:
    out = [machine_line(), "", f"{r['model']} ({r['weights']}), streamed chat requests of up to {r['max_tokens']} "
           "tokens, greedy; one engine thread (requests decoded one after another: no continuous batching yet); "
           "with a drafter the text arrives round by round", "",
           "| mode | clients | requests | aggregate tok/s | vs 1 client | TTFT p50 / p90 (s) | TPOT p50 / p90 (ms) "
           "| = single-request output |", "|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        vs = f"{x['vs_one_client']:.2f}x" if x["vs_one_client"] else "-"
        out.append(f"| {x['mode']} | {x['clients']} | {x['requests']} | {x['tok_s']:.1f} | {vs} | "
                   f"{x['ttft_p50']:.2f} / {x['ttft_p90']:.2f} | {1e3 * x['tpot_p50']:.1f} / {1e3 * x['tpot_p90']:.1f} "
                   f"| {x['equal']}/{x['requests']} |")
    return "\n".join(out)

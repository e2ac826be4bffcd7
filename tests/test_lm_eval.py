"""lm-evaluation-harness through `midlayer serve` (issue 45, item 4): lm-eval's own local-completions model
talks to a real server on a free port; a local generation task (its dataset written here, read by lm-eval's
`json` builder: no download) scores the same, sample for sample, with plain and with speculative decoding."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")  # the test extra installs it

from lm_eval.tasks import TaskManager  # noqa: E402

from midlayer.server import create_app  # noqa: E402
from test_api import llm  # noqa: E402,F401  (the tiny model with a tiny ChatML tokenizer, a fixture)
from test_server import Running  # noqa: E402

QUESTIONS = ["To be, or not to be", "whether 'tis nobler", "in the mind to suffer", "the slings and arrows",
             "of outrageous fortune", "or to take arms"]


def _task(tmp_path, llm) -> TaskManager:  # noqa: F811
    """A task whose targets are the tiny model's own greedy continuations (so exact match is 1 when the
    server decodes exactly), and one wrong target (so the score is not trivially 1)."""
    rows = [{"q": q, "a": llm.generate(q, max_tokens=6).text} for q in QUESTIONS]
    rows[-1]["a"] = rows[-1]["a"] + " (wrong)"
    data = tmp_path / "own.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "own.yaml").write_text(f"""task: midlayer_own
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["<|never|>"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return TaskManager(include_path=str(tmp_path))


def _evaluate(url: str, tasks: TaskManager) -> tuple[float, list]:
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["midlayer_own"], task_manager=tasks, log_samples=True,
        model_args=f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=None,tokenized_requests=False")
    score = out["results"]["midlayer_own"]["exact_match,none"]
    samples = sorted(out["samples"]["midlayer_own"], key=lambda s: s["doc_id"])
    return score, [s["resps"] for s in samples]


def test_lm_eval_scores_the_same_plain_and_speculative(tmp_path, llm):  # noqa: F811
    tasks = _task(tmp_path, llm)
    running = Running(create_app(llm, "tiny"))
    try:
        plain, plain_resps = _evaluate(running.url, tasks)
    finally:
        running.stop()
    assert plain == pytest.approx(5 / 6)  # every continuation but the wrong one: the server decodes exactly
    try:
        llm.attach("lookup", tree="sparse:6")
        running = Running(create_app(llm, "tiny"))
        try:
            spec, spec_resps = _evaluate(running.url, tasks)
        finally:
            running.stop()
    finally:
        llm.attach(None)
    assert spec == plain and spec_resps == plain_resps


def test_the_committed_local_task_is_what_its_script_writes(tmp_path):
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    make = runpy.run_path(str(root / "scripts" / "make_eval_task.py"))["main"]
    assert make(tmp_path / "arith.jsonl").read_text() == (root / "evals" / "arith.jsonl").read_text()
    assert "evals/arith.jsonl" in (root / "evals" / "midlayer_arith.yaml").read_text()


def test_lm_eval_loglikelihood_task_through_echo_and_logprobs(tmp_path, llm):  # noqa: F811
    """A multiple-choice task: lm-eval tokenizes through the server's /tokenize (its remote tokenizer), sends
    token ids with echo + logprobs, and reads each choice's log-likelihood; every one equals the sum computed
    here from `LLM.logprobs` over the same tokens, and the accuracy follows from them."""
    rows = [{"q": q, "choices": [" alpha", " to be", " arrows"], "gold": i % 3} for i, q in enumerate(QUESTIONS)]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mc.yaml").write_text(f"""task: midlayer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
metadata:
  version: 1.0
""")
    running = Running(create_app(llm, "tiny"))
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["midlayer_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True, model_args=f"base_url={running.url}/v1/completions,model=tiny,"
                                         "tokenizer_backend=remote,tokenized_requests=True")
    finally:
        running.stop()
    samples = sorted(out["samples"]["midlayer_mc"], key=lambda s: s["doc_id"])
    hits = 0
    for row, s in zip(rows, samples):
        ctx = llm.tokenizer.encode(row["q"], add_bos=False)
        sums = []
        for choice, resp in zip(row["choices"], s["resps"]):
            whole = llm.tokenizer.encode(row["q"] + choice, add_bos=False)
            sums.append(sum(lp for lp, _ in llm.logprobs(whole)[len(ctx):]))
            assert resp[0][0] == pytest.approx(sums[-1], abs=1e-5)
        hits += max(range(3), key=lambda i: sums[i]) == row["gold"]
    assert out["results"]["midlayer_mc"]["acc,none"] == pytest.approx(hits / len(rows))

"""Follow-up chat turns in the continuous batch (engine/batch.py, `_leave` and `_keep_memory`): conversations of
several turns, each next turn (the conversation so far, its answers as the template renders them, and a new
user message) queued when its previous turn finishes, several conversations at a time in `LLM.batch`. Prints
the share of prompt tokens whose K/V a turn took from another row or from a free row's memory instead of
prefilling them, and the run's seconds.

    python benchmarks/follow_up_turns.py [--conversations 8] [--turns 3] [--rows 4] [--max-tokens 48]
        [--memory-rows 0]

To compare with another checkout's engine (e.g. one before free rows kept the left sequence), run this file
with that checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import time

import midlayer
from midlayer.experiments.bench import heldout_texts, machine_line

FOLLOW_UPS = ["Can you say that more briefly?", "Give one example.", "What is the main point?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4, help="rows of the batch (sequences at a time)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--memory-rows", type=int, default=0, help="batch cache rows that only keep left sequences' K/V")
    args = ap.parse_args()
    llm = midlayer.LLM.load(args.model, weights="q4")
    cfg = llm.settings(args.max_tokens, 0.0, 0, 1.0, None)
    chats = [[{"role": "user", "content": t}] for t in heldout_texts(args.conversations, "scaled")]
    batch = llm.batch(args.rows, memory_rows=args.memory_rows) if args.memory_rows else llm.batch(args.rows)
    turn = {i: 0 for i in range(len(chats))}
    running: dict[int, int] = {}  # handle -> conversation
    prompt_tokens = reused = 0
    t0 = time.perf_counter()
    for i, chat in enumerate(chats):
        running[batch.add(llm.encode(chat), cfg)] = i
    while len(batch):
        for seq, _, done in batch.step():
            if not done:
                continue
            i = running.pop(seq.handle)
            prompt_tokens += seq.prompt_len
            reused += seq.reused
            turn[i] += 1
            if turn[i] < args.turns:
                chats[i] += [{"role": "assistant", "content": llm.tokenizer.decode(seq.new, skip_special_tokens=True)},
                             {"role": "user", "content": FOLLOW_UPS[(turn[i] - 1) % len(FOLLOW_UPS)]}]
                running[batch.add(llm.encode(chats[i]), cfg)] = i
    seconds = time.perf_counter() - t0
    print(machine_line(), f"\n\n{args.model} (q4), {args.conversations} conversations x {args.turns} turns, "
          f"{args.rows} rows (+ {args.memory_rows} memory rows), up to {args.max_tokens} new tokens a turn\n")
    print(f"prompt tokens {prompt_tokens}, reused {reused} ({reused / prompt_tokens:.0%}); {seconds:.2f} s")


if __name__ == "__main__":
    main()

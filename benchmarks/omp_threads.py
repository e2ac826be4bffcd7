"""Why the server's engine thread releases the loading thread's OpenMP pool (kernels.release_threads;
docs/results/serve-cpu.md, 32nd session): one SmolLM2-135M q4 sequence decoded 64 steps in a `ContinuousBatch`,
ms per step, in three set-ups, each in a fresh process: the model loaded in the main thread and decoded in a
second thread (libgomp then manages more threads than CPUs and parks its workers at every parallel region),
the same after `kernels.release_threads()` in the main thread, and load and decode both in the second thread.

    python benchmarks/omp_threads.py
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys, threading, time
import midlayer
from midlayer.engine.generate import GenerationConfig
from midlayer.ops import kernels
mode = sys.argv[1]
state = {}

def load():
    state["llm"] = midlayer.LLM.load("smollm2-135m", weights="q4")

def decode():
    if mode == "load-in-thread":
        load()
    llm = state["llm"]
    batch = llm.batch(1)
    batch.add(llm.encode("Write a long story about a dragon and a knight."), GenerationConfig(max_new_tokens=66))
    batch.step()
    t, n = time.perf_counter(), 0
    while len(batch):
        batch.step()
        n += 1
    print(f"{(time.perf_counter() - t) / n * 1e3:.2f}")

if mode != "load-in-thread":
    load()
if mode == "released":
    kernels.release_threads()
worker = threading.Thread(target=decode)
worker.start()
worker.join()
"""


def main() -> None:
    print("| set-up | ms per decode step |\n|---|---|")
    for mode, what in (("loaded-in-main", "loaded in the main thread, decoded in a second one"),
                       ("released", "the same, after kernels.release_threads() in the main thread"),
                       ("load-in-thread", "loaded and decoded in the second thread")):
        ms = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
        print(f"| {what} | {ms.stdout.strip().splitlines()[-1]} |")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # (--help ran the benchmark)
    main()

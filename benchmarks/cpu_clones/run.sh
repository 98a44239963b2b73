#!/usr/bin/env bash
# Per-clone Adam ns/elem with and without -fno-trapping-math (see adam_clone_timing.cpp).
# Usage: bash benchmarks/cpu_clones/run.sh   (needs g++; runs from anywhere)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd); tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for clone in arch=x86-64-v4 arch=x86-64-v3 default; do
  mkdir -p "$tmp/$clone/cpu"; cp -r "$root/csrc/include/mpfused" "$tmp/$clone/"
  cp "$root"/csrc/cpu/*.h "$root/csrc/cpu/adam_cpu.cpp" "$tmp/$clone/cpu/"
  keep="\"$clone\", \"default\""; [ "$clone" = default ] && keep='"default"'
  sed -i "s/target_clones(\"arch=x86-64-v4\", \"arch=x86-64-v3\", \"default\")/target_clones($keep)/" \
    "$tmp/$clone/cpu/parallel.h"
  for fl in -ftrapping-math -fno-trapping-math; do
    g++ -O3 -fopenmp -fno-math-errno -ffp-contract=off $fl -std=c++17 -w -I"$tmp/$clone" \
      -I"$tmp/$clone/cpu" "$here/adam_clone_timing.cpp" "$tmp/$clone/cpu/adam_cpu.cpp" -o "$tmp/drv"
    echo "$clone $fl fp32: $(OMP_NUM_THREADS=1 "$tmp/drv" 0)  bf16+remainder: $(OMP_NUM_THREADS=1 "$tmp/drv" 2)"
  done
done

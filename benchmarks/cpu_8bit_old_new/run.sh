#!/usr/bin/env bash
# The CPU 8-bit / 4-bit kernels (Adam; SGD and Lion with one state) of an older revision against
# the working tree's, in one process, 1 thread: bit-for-bit agreement after 4 steps (odd sizes,
# NaN/inf/subnormal grads) and interleaved step times (median and min of the thread CPU time), per
# code width x param dtype x master mode, with the fp32-state Adam kernel (adam_cpu: the same math
# without quantization) as the floor of the Adam rows. The old sources are compiled with
# -Dmpfused=mpfold so both link into one binary.
# Usage: bash benchmarks/cpu_8bit_old_new/run.sh [REV=HEAD~1] [NUMEL=1e6] [REPS=21] [FILTER]
# FILTER: a substring of the row names ("4bit", "lion 4bit", "8bit fp32", ...).
# KEEP=dir keeps the objects and the driver there (dir/drv; e.g. for perf record).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP"; tmp=$(cd "$KEEP" && pwd); rm -rf "$tmp/csrc"
else tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT; fi
rev=${1:-HEAD~1}; numel=${2:-1e6}; reps=${3:-21}; filter=${4:-}
git -C "$root" archive "$rev" csrc | tar -x -C "$tmp"
old="$tmp/csrc"; new="$root/csrc"
fl="-O3 -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off -std=c++17 -w -g"
cd "$root"
python -c "
from mpfused import quant_maps as q, quant4 as q4
for name, m in (('s8', q.signed_map()), ('u8', q.unsigned_map()), ('s4', q4.signed4_map()), ('u4', q4.unsigned4_map())):
    m.numpy().astype('float32').tofile('$tmp/' + name + '.bin')"
cd "$tmp"
jobs=${JOBS:-2}
build() {  # tag src-root defines...
  local tag=$1 src=$2; shift 2
  printf '%s\n' "$here/wrap.cpp" "$here/wrap1.cpp" "$src/cpu/adam8bit_cpu.cpp" "$src/cpu/quant8_cpu.cpp" \
    "$src/cpu/sgd8bit_cpu.cpp" "$src/cpu/lion8bit_cpu.cpp" |
    xargs -P "$jobs" -I{} sh -c "g++ $fl $* -I$src/include -I$src/cpu -c {} -o $tag.\$(basename {} .cpp).o"
}
build o "$old" -Dmpfused=mpfold -DSTEP_FN=step_old -DSTEP1_FN=step1_old
build n "$new" -DSTEP_FN=step_new -DSTEP1_FN=step1_new
g++ $fl -I"$new/include" -I"$new/cpu" -c "$here/fp32_adam.cpp" -o f32.o &
g++ $fl -I"$new/include" -I"$new/cpu" -c "$new/cpu/adam_cpu.cpp" -o adamf.o &
g++ $fl -DMAPS_DIR="\"$tmp\"" -c "$here/main.cpp" -o main.o
wait
g++ -fopenmp main.o o.*.o n.*.o f32.o adamf.o -o drv
OMP_NUM_THREADS=1 ./drv "$numel" "$reps" "$filter"

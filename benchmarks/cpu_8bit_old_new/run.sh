#!/usr/bin/env bash
# The CPU 8-bit / 4-bit Adam kernels of an older revision against the working tree's, in one
# process, 1 thread: bit-for-bit agreement after 4 steps (odd sizes, NaN/inf/subnormal grads) and
# interleaved step times (median and min of the thread CPU time), per code width x param dtype x
# master mode, with the fp32-state Adam kernel (adam_cpu: the same math without quantization) as
# the floor. The old sources are compiled with -Dmpfused=mpfold so both link into one binary.
# Usage: bash benchmarks/cpu_8bit_old_new/run.sh [REV=HEAD~1] [NUMEL=1e6] [REPS=21] [FILTER]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd); tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rev=${1:-HEAD~1}; numel=${2:-1e6}; reps=${3:-21}; filter=${4:-}
git -C "$root" archive "$rev" csrc | tar -x -C "$tmp"
old="$tmp/csrc"; new="$root/csrc"
fl="-O3 -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off -std=c++17 -w"
cd "$root"
python -c "
from mpfused import quant_maps as q, quant4 as q4
for name, m in (('s8', q.signed_map()), ('u8', q.unsigned_map()), ('s4', q4.signed4_map()), ('u4', q4.unsigned4_map())):
    m.numpy().astype('float32').tofile('$tmp/' + name + '.bin')"
cd "$tmp"
g++ $fl -Dmpfused=mpfold -DSTEP_FN=step_old -I"$old/include" -I"$old/cpu" -c "$here/wrap.cpp" -o wo.o &
g++ $fl -Dmpfused=mpfold -I"$old/include" -I"$old/cpu" -c "$old/cpu/adam8bit_cpu.cpp" -o ao.o &
g++ $fl -Dmpfused=mpfold -I"$old/include" -I"$old/cpu" -c "$old/cpu/quant8_cpu.cpp" -o qo.o
wait
g++ $fl -DSTEP_FN=step_new -I"$new/include" -I"$new/cpu" -c "$here/wrap.cpp" -o wn.o &
g++ $fl -I"$new/include" -I"$new/cpu" -c "$new/cpu/adam8bit_cpu.cpp" -o an.o &
g++ $fl -I"$new/include" -I"$new/cpu" -c "$new/cpu/quant8_cpu.cpp" -o qn.o
wait
g++ $fl -I"$new/include" -I"$new/cpu" -c "$here/fp32_adam.cpp" -o f32.o &
g++ $fl -I"$new/include" -I"$new/cpu" -c "$new/cpu/adam_cpu.cpp" -o adamf.o &
g++ $fl -DMAPS_DIR="\"$tmp\"" -c "$here/main.cpp" -o main.o
wait
g++ -fopenmp main.o wo.o ao.o qo.o wn.o an.o qn.o f32.o adamf.o -o drv
OMP_NUM_THREADS=1 ./drv "$numel" "$reps" "$filter"

#!/usr/bin/env bash
# GPU verification: build for the local architecture, run the whole test suite on CUDA (native
# CUDA, compiled Triton, reference), compute-sanitizer on a small driver of every CUDA kernel, the
# micro-benchmarks and the main job. Logs and JSON go to $1 or $OUT.
#   usage: bash benchmarks/gpu_suite.sh [OUT_DIR] [all|verify|bench]   (peer wheels in .whl/)
# The per-step timeouts add up to more than one 10-minute device call: a lent machine that goes
# back after 30 s idle is best used in two calls, `verify` (build, tests, sanitizer) and `bench`
# (build, micro-benchmarks, main job); each builds, since the second call may get a fresh machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_out}}
phase=${2:-all}
case "$phase" in all|verify|bench) ;; *) echo "phase must be all, verify or bench" >&2; exit 2;; esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPFUSED_TEST_TRITON_COMPILED=1
step() { echo "== $1 ($(date +%T))" | tee -a "$out/summary.log"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  step "peer wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
step "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__)"; git rev-parse HEAD 2>/dev/null; } | tee "$out/env.log"
cap=$(python3 -c "import torch;print('%d.%d'%torch.cuda.get_device_capability())")

step "build (sm $cap)"
TORCH_CUDA_ARCH_LIST="$cap" MPFUSED_CUDA=1 MAX_JOBS=16 python3 -m pip install -q --no-build-isolation -e . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -m mpfused.info | tee "$out/info.log"

if [ "$phase" != bench ]; then
step "tests on CUDA"
# The host emulation of the CUDA kernels (test_cuda_emulation.py) and the ahead-of-time Triton
# compile (test_triton_compile.py) are CI's stand-ins for this machine: skipped here to keep the
# 10-minute call for the real GPU.
timeout 300 python3 -m pytest -q -rfE --durations=15 -p no:cacheprovider \
  --ignore=tests/test_cuda_emulation.py --ignore=tests/test_triton_compile.py tests >"$out/tests.log" 2>&1; echo "pytest rc=$?" | tee -a "$out/summary.log"
tail -5 "$out/tests.log" | tee -a "$out/summary.log"

for tool in memcheck racecheck; do
  step "compute-sanitizer $tool"
  timeout 180 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitizer_driver.py >"$out/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?" | tee -a "$out/summary.log"; tail -3 "$out/sanitizer_$tool.log" | tee -a "$out/summary.log"
done

fi

if [ "$phase" != verify ]; then
step "micro-benchmarks"
timeout 240 python3 -m benchmarks.bench_scaler --device cuda --totals 10000000,1000000000 --counts 1,100,10000 >"$out/bench_scaler.log" 2>&1
timeout 240 python3 -m benchmarks.bench_adamw --device cuda --totals 1000000,10000000,100000000 --counts 1,100,10000 >"$out/bench_adamw.log" 2>&1
timeout 240 python3 -m benchmarks.bench_adamw8bit --device cuda --out "$out" >"$out/bench_adamw8bit.log" 2>&1
cp benchmarks/results/*.json "$out/" 2>/dev/null

step "main job"
timeout 240 python3 -m mpfused.bench --device cuda --out "$out/bench" >"$out/main_job.log" 2>&1; echo "bench rc=$?" | tee -a "$out/summary.log"
tail -15 "$out/main_job.log" | tee -a "$out/summary.log"
fi
step "done"
# $OUT returns at most 8 files: everything travels as one archive too
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null

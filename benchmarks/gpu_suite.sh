#!/usr/bin/env bash
# The GPU run plan. One phase per device call (each call may get a fresh machine, so each builds
# first; a warm machine with this tree already built skips the build):
#   verify    build, per-kernel smoke (one PASS/FAIL/SKIP line per op x backend x dtype x mode,
#             each op family in its own process, families in parallel), the CUDA test files
#             (sgd/lion kernel tests included), then the rest of the suite
#   sanitize  build, compute-sanitizer memcheck (native, then Triton) / racecheck / synccheck /
#             initcheck over benchmarks/sanitizer_driver.py with the caching allocator off
#   roofline  build, benchmarks/roofline.py (kernels at 2^28 vs a same-bytes copy, the
#             10,000-tensor step per optimizer family), ncu counters per kernel when ncu is there
#   bench     build, peer wheels from .whl/, the micro-benchmarks (AdamW, scaler, 8-bit, SGD/Lion)
#   jobs      build, peer wheels, the main job with --optimizer adamw, sgd and lion
#
#   usage: [MPFUSED_COMMIT=<sha>] bash benchmarks/gpu_suite.sh [--dry-run] OUT PHASE
#          bash benchmarks/gpu_suite.sh --plan          (each phase's steps and time caps)
#          bash benchmarks/gpu_suite.sh --dry-run OUT all   (every step of every phase, on CPU)
# Everything is written under OUT/run-PHASE; on exit (also on SIGINT/SIGTERM) it becomes
# OUT/mpfused-gpu-PHASE-<commit>.tgz plus OUT/summary-PHASE.txt: two files, under the device's
# 8. Each step runs under `timeout -s INT` (pytest then still prints its summary and writes its
# junit XML) with a cap clipped to what is left of GPU_SUITE_BUDGET (560 s: a call has 600).
# The commit: MPFUSED_COMMIT, else benchmarks/.commit (python -m benchmarks.provenance write,
# run here before the call; the device's copy of the tree has no .git). Every log starts with it,
# every JSON and CSV is stamped with it, and the archive is named after it.
# --dry-run: the same control flow on CPU with the heavy steps shrunk (CI's stand-in, run by
# tests/test_gpu_plan.py): no build, CPU devices, tiny sizes, no compute-sanitizer or ncu.
set -uo pipefail
cd "$(dirname "$0")/.."

# caps (s) per phase, + RESERVE: first 20+180+90+120+135 = 545+15, verify 20+180+90+175+80 = 545+15, sanitize 20+180+120+70+50+60+45
# = 545+15, roofline 20+180+140+205 = 545+15, bench 20+180+20+60+70+70+90 = 510+15,
# jobs 20+180+20+3x105 = 535+15 (test_gpu_plan checks each against the 10-minute call)
declare -A CAP=([env]=20 [build]=180
  [smoke]=90 [tests_cuda]=175 [tests_cuda_short]=135 [tests_rest]=80
  [memcheck]=120 [racecheck]=70 [synccheck]=50 [memcheck_triton]=60 [initcheck]=45
  [roofline]=140 [ncu]=205
  [wheels]=20 [bench_scaler]=60 [bench_adamw]=70 [bench_8bit]=70 [bench_sgd_lion]=90
  [main_job]=105 [main_job_sgd]=105 [main_job_lion]=105)
# first: the one call a 15-minute device loan affords (a start of a few minutes, one call of at
# most 10, maybe a short second one on the warm machine): every kernel against the CPU, memcheck
# over every native kernel, then as many of the CUDA tests as the budget leaves
declare -A PLAN=([first]="env build smoke memcheck tests_cuda_short"
  [verify]="env build smoke tests_cuda tests_rest"
  [sanitize]="env build memcheck racecheck synccheck memcheck_triton initcheck"
  [roofline]="env build roofline ncu"
  [bench]="env build wheels bench_scaler bench_adamw bench_8bit bench_sgd_lion"
  [jobs]="env build wheels main_job main_job_sgd main_job_lion")
# the GPU's own test files (tests_cuda), in this order; tests_rest runs every other file
CUDA_TESTS="tests/test_cuda_kernels.py tests/test_cuda_adam_kernels.py tests/test_cuda_adam8bit.py
  tests/test_cuda_adam8bit_contract.py tests/test_cuda_adam4bit.py tests/test_sgd_lion_kernels.py
  tests/test_cuda_onestate8bit.py"
CUDA_TESTS=$(echo $CUDA_TESTS)
# the op families the sanitizers drive (an op with no kernel on the device is skipped and named)
ALL_OPS=check_grads,unscale_grads_,update_scale_,adam_step_,adam8bit_step_,adam4bit_step_,sgd_step_,lion_step_,sgd8bit_step_,lion8bit_step_,sgd4bit_step_,lion4bit_step_
# racecheck: the kernels with shared memory and barriers (amp reductions, 8-bit search tables,
# the elementwise kernel's per-block scalars)
SHARED_OPS=check_grads,unscale_grads_,adam8bit_step_,adam4bit_step_,sgd_step_,lion_step_,sgd8bit_step_,lion8bit_step_,sgd4bit_step_,lion4bit_step_
for k in "${!CAP[@]}"; do  # GPU_SUITE_CAP_<step>=S overrides one cap (the dry-run test shortens some)
  v=GPU_SUITE_CAP_$k; [ -n "${!v:-}" ] && CAP[$k]=${!v}
done
BUDGET=${GPU_SUITE_BUDGET:-560}
RESERVE=15  # seconds kept for stamping and the archive

if [ "${1:-}" = --plan ]; then
  for ph in first verify sanitize roofline bench jobs; do
    tot=$RESERVE; line=""
    for s in ${PLAN[$ph]}; do tot=$((tot + CAP[$s])); line+=" $s:${CAP[$s]}"; done
    echo "$ph total=$tot budget=$BUDGET reserve=$RESERVE$line"
  done
  exit 0
fi
dry=0
[ "${1:-}" = --dry-run ] && { dry=1; shift; }
[ $# -eq 2 ] || { echo "usage: bash benchmarks/gpu_suite.sh [--dry-run] OUT verify|sanitize|roofline|bench|jobs" >&2; exit 2; }
phase=$2
# `all` (every step once, one build) is for the dry run: on a GPU it cannot fit one call
[ $dry = 1 ] && PLAN[all]="env build smoke tests_cuda tests_rest memcheck racecheck synccheck memcheck_triton initcheck roofline ncu wheels bench_scaler bench_adamw bench_8bit bench_sgd_lion main_job main_job_sgd main_job_lion"
[ -n "${PLAN[$phase]:-}" ] || { echo "phase must be one of: ${!PLAN[*]}" >&2; exit 2; }
t_start=$(date +%s)
mkdir -p "$1" && out=$(cd "$1" && pwd)
run=$out/run-$phase
rm -rf "$run" && mkdir -p "$run"
touch "$run/.started"  # results newer than this were written by this run
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
prov=$(python3 -m benchmarks.provenance show 2>&1 | tail -1)
[[ $prov == commit\ * ]] || prov="commit unknown (provenance: $prov)"
sha=$(awk '{print substr($2, 1, 12)}' <<<"$prov" | tr -c 'A-Za-z0-9._\n-' '_')  # file names that come back: [A-Za-z0-9._-]
summary=$run/summary.txt
echo "mpfused GPU suite, phase $phase$([ $dry = 1 ] && echo ' (DRY RUN on CPU)'), $(date -u +%FT%TZ)" >"$summary"
echo "$prov" >>"$summary"
failed=0

finish() {
  trap - EXIT INT TERM
  mkdir -p "$run/results"
  # only what this run wrote: the repo's results/ also holds older (CPU) files
  find benchmarks/results -maxdepth 1 -type f -newer "$run/.started" -exec cp {} "$run/results/" \; 2>/dev/null
  python3 -m benchmarks.provenance stamp "$run" "$prov" >>"$summary" 2>&1
  echo "phase $phase: $([ $failed = 0 ] && echo 'all steps passed' || echo "$failed step(s) FAILED") in $(( $(date +%s) - t_start )) s" >>"$summary"
  rm -f "$run/.started"
  cp "$summary" "$out/summary-$phase.txt"
  tar czf "$out/mpfused-gpu-$phase-$sha.tgz" -C "$out" "run-$phase" && rm -rf "$run"
  cat "$out/summary-$phase.txt"
}
trap finish EXIT
trap 'echo "interrupted" >>"$summary"; exit 130' INT TERM

# step NAME LOG CMD...: CMD under `timeout -s INT` with the step's cap, clipped to the budget left;
# the log starts with the provenance line; one line per step in the summary
step() {
  local name=$1 logf=$run/$2 cap=${CAP[$1]}; shift 2
  local left=$(( BUDGET - RESERVE - ($(date +%s) - t_start) ))
  (( cap > left )) && cap=$left
  if (( cap < 5 )); then
    printf '%-7s %-15s no time left in the budget\n' SKIP "$name" | tee -a "$summary"; failed=$((failed + 1)); return 1
  fi
  echo "# $prov | $name | $(date -u +%FT%TZ) | cap ${cap}s | $*" >"$logf"
  local t0=$SECONDS rc
  # GPU_SUITE_STUB=step,...: the dry-run test replaces some slow steps by a no-op
  [[ $dry = 1 && ,${GPU_SUITE_STUB:-}, == *,$name,* ]] && set -- echo "stub: $name not run"
  if [ "$(type -t "$1")" = function ]; then  # timeout runs programs: a function goes through bash
    timeout -s INT -k 15 "$cap" bash -c '"$@"' _ "$@" >>"$logf" 2>&1
  else
    timeout -s INT -k 15 "$cap" "$@" >>"$logf" 2>&1
  fi
  rc=$?
  local v=PASS; (( rc )) && v=FAIL; (( rc == 124 || rc == 137 )) && v=TIMEOUT
  (( rc )) && failed=$((failed + 1))
  printf '%-7s %-15s rc=%-3s %4ss  %s\n' "$v" "$name" "$rc" $((SECONDS - t0)) "$(basename "$logf")" | tee -a "$summary"
  return $rc
}

if [ $dry = 1 ]; then
  dev=cpu; smoke_backends=native; tri_backend=native; smoke_jobs=2
else
  dev=cuda; smoke_backends=native,triton; tri_backend=triton; smoke_jobs=9
  export MPFUSED_TEST_TRITON_COMPILED=1  # the suite's Triton tests compile for the GPU
  [ -n "${CUDA_HOME:-}" ] || { [ -f /usr/local/cuda/include/cuda_runtime.h ] && export CUDA_HOME=/usr/local/cuda; }
fi

env_info() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import triton; print('triton', triton.__version__)" || true
  command -v nvcc >/dev/null && nvcc --version | tail -2
  for t in compute-sanitizer ncu cuobjdump; do echo "$t: $(command -v $t || echo absent)"; done
  echo "nproc $(nproc)  .git present: $([ -d .git ] && echo yes || echo no)"
}

build() {
  if [ $dry = 1 ]; then
    echo "dry run: no build, the installed extension serves"
  else
    cap=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") || return 1
    local h; h=$(python3 -c "from benchmarks.provenance import tree_hash; print(tree_hash())")
    # a warm machine keeps ignored build outputs between calls: the same tree needs no rebuild
    if [ "$(cat build/.suite_tree 2>/dev/null)" = "$h-$cap" ] && python3 -c "from mpfused import _extension as e; assert e.with_cuda()"; then
      echo "already built for tree $h, sm $cap"
    else
      TORCH_CUDA_ARCH_LIST=$cap MPFUSED_CUDA=1 MAX_JOBS=$(nproc) python3 -m pip install --no-index \
        --no-deps --no-build-isolation -e . || return 1
      mkdir -p build && echo "$h-$cap" >build/.suite_tree
    fi
    command -v cuobjdump >/dev/null && cuobjdump -res-usage mpfused/_C*.so >"$run/res_usage.txt" 2>&1
  fi
  python3 -m mpfused.info
}

run_pytest() {  # NAME JUNIT ARGS...: names and outcomes survive a timeout (-v -rA, junit, SIGINT)
  local name=$1 junit=$2; shift 2
  step "$name" "$name.log" python3 -m pytest -v -rA -p no:cacheprovider -p benchmarks.pytest_deadline \
    --deadline "${GPU_SUITE_TEST_DEADLINE:-60}" --maxfail 25 --junitxml "$run/$junit" \
    -o junit_suite_name="mpfused-$sha" -o junit_duration_report=call "$@"
}

sanitizer() {  # TOOL BACKENDS FAMILIES
  local tool=$1
  if [ $dry = 1 ]; then
    # no compute-sanitizer on CPU: the driver's own calls are what the dry run checks
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 python3 -m benchmarks.sanitizer_driver --device cpu --backends "$2" --only "$3"
  else
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --print-limit 30 python3 -m benchmarks.sanitizer_driver --backends "$2" --only "$3"
  fi
}

ncu_all() {
  if [ $dry = 0 ] && ! command -v ncu >/dev/null; then
    echo "ncu not installed: no counters"; return 0
  fi
  if [ $dry = 1 ]; then
    echo "dry run: no ncu; parsing a canned CSV instead"
    printf '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","dram__bytes_read.sum","byte","1600"\n"0","void mta_kernel<ew::Functor<AdamPolicy<false>, 0>>(Meta)","dram__bytes_write.sum","byte","1200"\n' >"$run/ncu_canned.csv"
    python3 -m benchmarks.roofline --ncu-csv "$run/ncu_canned.csv" --case canned --numel 100 --out "$run/roofline.json"
    return
  fi
  local n=$((1 << 25)) c rc=0 skip count cases  # 32M elements: far beyond L2, ncu's replays stay quick
  local base=dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_ld.sum
  local stalls; stalls=$(python3 -m benchmarks.roofline --stall-metrics) || return 1
  # the cases whose op has a native kernel here (one process, not one per case under ncu)
  cases=$(python3 -c "from benchmarks.roofline import CASES; from mpfused.ops import OPS
print(' '.join(c for c in '${GPU_SUITE_NCU_CASES:-adamw_fp32 adamw_bf16_master adamw8bit_fp32 adamw8bit_bf16_master adamw4bit_fp32 check_bf16 unscale_bf16 sgd_fp32 sgd_momentum_fp32 lion_fp32 sgd8bit_fp32 lion8bit_fp32 sgd4bit_fp32 lion4bit_fp32}'.split() if 'native' in OPS[CASES[c][0]].available('cuda')))") || return 1
  echo "ncu cases: $cases"
  for c in $cases; do
    # launches per call that the filter matches: every 8-bit / 4-bit step (Adam, SGD, Lion) is
    # prepare_kernel + mta_kernel (skip the warm-up call's two)
    case $c in *8bit_*|*4bit_*) skip=2 count=2 ;; *) skip=1 count=1 ;; esac
    prof() {
      ncu --csv --log-file "$run/ncu_$c.csv" --print-units base --clock-control none \
        -k "regex:mta_kernel|prepare_kernel" --launch-skip $skip --launch-count $count \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --metrics "$1" \
        python3 -m benchmarks.roofline --once --case "$c" --numel $n
    }
    # a stall metric this ncu does not know fails the run: then once more without them
    prof "$base,$stalls" || { echo "ncu refused the stall metrics for $c: again without"; prof "$base"; } || rc=1
    python3 -m benchmarks.roofline --ncu-csv "$run/ncu_$c.csv" --case "$c" --numel $n --out "$run/roofline.json" || rc=1
  done
  cat "$run"/ncu_*.csv >"$run/ncu_raw.txt" && rm -f "$run"/ncu_*.csv  # one file; ncu's own lines inside
  return $rc
}

# note LOG REGEX: a step's own tally line (smoke counts, sanitizer skips) into the summary
note() { grep -hE "$2" "$run/$1" 2>/dev/null | tail -1 | sed 's/^/        /' >>"$summary"; }

export -f env_info build sanitizer ncu_all
export dry run

for s in ${PLAN[$phase]}; do
  case $s in
    env) step env env.log env_info ;;
    build) step build build.log build || { echo "build failed: nothing else can run" | tee -a "$summary"; exit 1; } ;;
    smoke)
      step smoke smoke.log python3 -m benchmarks.gpu_smoke --device $dev --backends $smoke_backends \
        --timeout 30 --jobs $smoke_jobs --out "$run/smoke.txt" ${GPU_SUITE_SMOKE_ONLY:+--only "$GPU_SUITE_SMOKE_ONLY"}
      note smoke.log '^smoke: ' ;;
    tests_cuda|tests_cuda_short)
      # the GPU's own tests first, in their own process: a sticky CUDA error there cannot fail the rest
      # shellcheck disable=SC2086
      run_pytest $s junit-cuda.xml ${GPU_SUITE_TESTS_CUDA:-$CUDA_TESTS} ;;
    tests_rest)
      # everything else (CUDA-parametrized tests included); the host emulation, the Triton AOT and
      # nvcc compile checks are CI's stand-ins for this machine, and the dry run of this plan is CI's
      # shellcheck disable=SC2086
      run_pytest tests_rest junit-rest.xml ${GPU_SUITE_TESTS_REST:-tests ${CUDA_TESTS//tests\//--ignore=tests/} --ignore=tests/test_cuda_emulation.py \
        --ignore=tests/test_cuda_onestate8bit.py --ignore=tests/test_cuda_emulation_onestate8bit.py \
        --ignore=tests/test_cuda_one_state4bit.py \
        --ignore=tests/test_triton_compile.py --ignore=tests/test_cuda_compile.py --ignore=tests/test_cuda_compile_onestate8bit.py \
        --ignore=tests/test_cuda_mta_packing.py --ignore=tests/test_cuda_bindings_syntax.py \
        --ignore=tests/test_gpu_plan.py} ;;
    memcheck|racecheck|synccheck|memcheck_triton|initcheck)
      tool=${s%_triton}; be=native; ops=${GPU_SUITE_SAN_ONLY:-$ALL_OPS}
      [ $s = memcheck_triton ] && be=$tri_backend  # Triton's kernels: memcheck only
      [ $s = racecheck ] && ops=${GPU_SUITE_SAN_ONLY:-$SHARED_OPS}
      step $s $s.log sanitizer $tool $be "$ops"
      note $s.log '^sanitizer driver: [0-9]' ;;
    roofline)
      if [ $dry = 1 ]; then
        step roofline roofline.log python3 -m benchmarks.roofline --device cpu --numel 4096 --small 100x10 \
          --warmup 1 --reps 2 --cases adamw_fp32,adamw8bit_fp32,adamw4bit_fp32,check_bf16,sgd_fp32,sgd_momentum_fp32,lion_fp32,sgd8bit_fp32,sgd4bit_fp32 \
          --out "$run/roofline.json"
      else
        step roofline roofline.log python3 -m benchmarks.roofline --device cuda --out "$run/roofline.json"
      fi
      note roofline.log 'skipped: ' ;;
    ncu) step ncu ncu.log ncu_all ;;
    wheels)
      if compgen -G ".whl/*.whl" >/dev/null; then
        step wheels wheels.log python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
          && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      else
        echo "SKIP    wheels          no .whl/ (bitsandbytes, torchao absent: their columns stay empty)" | tee -a "$summary"
      fi ;;
    bench_scaler)
      if [ $dry = 1 ]; then a=(--device cpu --totals 20000 --counts 1,10 --dtypes bf16)
      else a=(--device cuda --totals 10000000,1000000000 --counts 1,100,10000); fi
      step bench_scaler bench_scaler.log python3 -m benchmarks.bench_scaler "${a[@]}" ;;
    bench_adamw)
      if [ $dry = 1 ]; then a=(--device cpu --totals 20000 --counts 1,10)
      else a=(--device cuda --totals 1000000,100000000 --counts 1,10000); fi
      step bench_adamw bench_adamw.log python3 -m benchmarks.bench_adamw "${a[@]}" ;;
    bench_8bit)
      if [ $dry = 1 ]; then a=(--device cpu --sizes 2e4 --steps 1 --rounds 1 --warmup 1)
      else a=(--device cuda); fi
      step bench_8bit bench_8bit.log python3 -m benchmarks.bench_adamw8bit "${a[@]}" --out "$run" ;;
    bench_sgd_lion)
      if [ $dry = 1 ]; then a=(--device cpu --totals 20000 --counts 1,10)
      else a=(--device cuda --totals 1000000,100000000 --counts 1,10000); fi
      step bench_sgd_lion bench_sgd_lion.log python3 -m benchmarks.bench_sgd_lion "${a[@]}" ;;
    main_job|main_job_sgd|main_job_lion)
      o=${s#main_job}; o=${o#_}
      if [ $dry = 1 ]; then a=(--device cpu --size tiny --steps 2 --recipes native,mpfused)
      else a=(--device cuda --steps 150); fi  # the medium preset's 400 steps x 5 recipes: past the cap
      step $s $s.log python3 -m mpfused.bench "${a[@]}" ${o:+--optimizer $o} --out "$run/$s" ;;
  esac
done
exit $(( failed > 0 ))

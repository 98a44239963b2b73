#!/usr/bin/env bash
# The build users will run: mpfused with its CUDA kernels against a CUDA build of torch, on a
# machine without a GPU. It must compile, link and import, `python -m mpfused.info` must report
# the CUDA kernels, and the test suite must pass with that build (CPU paths: no GPU here).
#   usage: bash benchmarks/cuda_torch_build.sh [REV] [WORKDIR]      (REV: a commit, default HEAD)
#   env:   TORCH_SPEC (torch==2.14.1)  VENV (/tmp/cudavenv)  MAX_JOBS (2)
#          TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX", setup.py's default)  TESTS (pytest args: "tests")
# It builds a clone of the committed REV in WORKDIR (default /tmp/mpfused-cudabuild), never the
# checkout it is called from, so an editable install there is not disturbed. About 20 minutes on
# 2 cores (README, "Install and build switches": its last result; not run by CI yet).
# Result: WORKDIR/result.txt (and the logs beside it).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
rev=$(git -C "$repo" rev-parse "${1:-HEAD}")
work=${2:-/tmp/mpfused-cudabuild}
venv=${VENV:-/tmp/cudavenv}
py=$venv/bin/python
export MAX_JOBS=${MAX_JOBS:-2} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}
export MPFUSED_CUDA=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch guesses CUDA_HOME from `which nvcc`; where that is a wrapper (/usr/local/bin/nvcc here) the
# guess (/usr/local) has no headers
[ -n "${CUDA_HOME:-}" ] || { [ -f /usr/local/cuda/include/cuda_runtime.h ] && export CUDA_HOME=/usr/local/cuda; }
mkdir -p "$work/logs"
log=$work/logs
t0=$SECONDS
note() { echo "$*" | tee -a "$work/result.txt"; }
: >"$work/result.txt"
note "commit $rev  torch spec ${TORCH_SPEC:-torch==2.14.1}  archs $TORCH_CUDA_ARCH_LIST  MAX_JOBS $MAX_JOBS  CUDA_HOME ${CUDA_HOME:-?}  $(date -u +%FT%TZ)"

# 1. a venv with a CUDA torch (the wheel and its nvidia-* dependencies come from local disk here)
if ! "$py" -c "import torch; assert torch.version.cuda" 2>/dev/null; then
  python3 -m venv "$venv"
  "$py" -m pip install -q "${TORCH_SPEC:-torch==2.14.1}" >"$log/pip_torch.log" 2>&1
fi
"$py" -m pip install -q setuptools wheel ninja pytest hypothesis tqdm matplotlib >"$log/pip_tools.log" 2>&1
note "torch $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)  nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')  ($((SECONDS - t0)) s)"

# 2. a clean clone of the commit (no uncommitted work of others, no build outputs)
rm -rf "$work/src"
git clone -q --no-hardlinks "$repo" "$work/src"
git -C "$work/src" checkout -q --detach "$rev"

# 3. build: compile and link against libtorch_cuda / libc10_cuda
cd "$work/src"
t1=$SECONDS
if ! nice -n 10 "$py" -m pip install -v --no-build-isolation --no-deps -e . >"$log/build.log" 2>&1; then
  note "BUILD FAILED after $((SECONDS - t1)) s: tail of $log/build.log"; tail -40 "$log/build.log"; exit 1
fi
so=$(ls mpfused/_C*.so)
note "build OK in $((SECONDS - t1)) s: $so, $(du -h "$so" | cut -f1)"
# every library resolves once torch's own are on the path (import torch loads them first; the
# extension carries no rpath to them), and the CUDA ones are really linked (not a CPU-only build)
tlib=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
LD_LIBRARY_PATH="$tlib:${LD_LIBRARY_PATH:-}" ldd "$so" >"$log/ldd.txt"
if grep -q "not found" "$log/ldd.txt"; then note "LINK: unresolved libraries"; cat "$log/ldd.txt"; exit 1; fi
grep -q libc10_cuda "$log/ldd.txt" || { note "LINK: libc10_cuda not linked: CPU-only build?"; exit 1; }
fatbin=$(readelf -SW "$so" | sed 's/\[ */[/' | awk '$2 == ".nv_fatbin" {print "0x" $6}')
[ -n "$fatbin" ] || { note "no .nv_fatbin section: no device code"; exit 1; }
if command -v cuobjdump >/dev/null; then  # not in every toolkit install (not here)
  archs=$(cuobjdump --list-elf "$so" | grep -o 'sm_[0-9]*' | sort | uniq -c | tr -s ' \n' ' ')
else
  archs="(cuobjdump not installed)"
fi
note "linked: $(grep -o 'lib[a-z0-9_]*cuda[a-z0-9_]*\.so[.0-9]*' "$log/ldd.txt" | sort -u | tr '\n' ' '); device code (.nv_fatbin) $((fatbin / 1024)) KiB $archs"

# 4. import and report (torch.cuda.is_available() is False here; the extension must load anyway)
"$py" -m mpfused.info >"$log/info.log" 2>&1 || { note "mpfused.info FAILED"; cat "$log/info.log"; exit 1; }
grep -q "CUDA kernels yes" "$log/info.log" || { note "mpfused.info does not report CUDA kernels"; cat "$log/info.log"; exit 1; }
note "info: $(grep 'native extension' "$log/info.log")"

# 5. the test suite with this build
t2=$SECONDS
set +e
# shellcheck disable=SC2086
nice -n 10 "$py" -m pytest -q -rfE -p no:cacheprovider ${TESTS:-tests} >"$log/tests.log" 2>&1
rc=$?
set -e
note "tests rc=$rc in $((SECONDS - t2)) s: $(tail -1 "$log/tests.log")"
note "total $((SECONDS - t0)) s"
exit $rc

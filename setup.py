"""Build of mpfused.

Environment switches
--------------------
MPFUSED_NO_EXT=1        pure-Python install: no extension; Triton and reference backends serve.
MPFUSED_CUDA=auto|0|1   CUDA kernels: auto (default) builds them when the installed torch has CUDA
                        (torch.version.cuda) and a CUDA toolkit is found (CUDA_HOME / nvcc), never
                        because a GPU happens to be visible; 0 never; 1 requires them (error if
                        impossible).
TORCH_CUDA_ARCH_LIST    architectures to build for (torch's variable); default "8.0;9.0+PTX".
MAX_JOBS                parallel compile jobs (ninja), torch's variable.

Install with `pip install --no-build-isolation .` (or `-e .`): torch is not a build requirement,
so the torch already installed is the one built against.
"""
import glob
import json
import os
import re
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
NO_EXT = os.environ.get("MPFUSED_NO_EXT", "0") == "1"
CUDA_MODE = os.environ.get("MPFUSED_CUDA", "auto")
if CUDA_MODE not in ("auto", "0", "1"):
    sys.exit(f"MPFUSED_CUDA must be auto, 0 or 1, got {CUDA_MODE!r}")

PACKAGES = ["mpfused", "mpfused.ops", "mpfused.reference", "mpfused.optim", "mpfused.triton_kernels",
            "mpfused.bench"]
PACKAGE_DIR = {"mpfused.triton_kernels": "triton_kernels"}


def _sources(pattern):
    return sorted(glob.glob(os.path.join("csrc", pattern)))


def _cxx_std(torch_include: str) -> str:
    # ATen.h states the standard it needs (`__cplusplus < 202002L` since torch 2.14); an explicit
    # -std is kept by cpp_extension, so it must follow torch's
    try:
        with open(os.path.join(torch_include, "ATen", "ATen.h")) as f:
            m = re.search(r"__cplusplus < (\d+)L", f.read())
    except OSError:
        m = None
    return "-std=c++20" if m and int(m.group(1)) >= 202002 else "-std=c++17"


# The bit-exact CPU = CUDA contract needs IEEE float math on both sides: fail the build rather
# than silently ship kernels that differ from the CPU ones (tests/test_cuda_compile.py tests this).
_INEXACT_NVCC = re.compile(r"^-?-(use_fast_math|fmad(=true)?|ftz=true|prec-div=false|"
                           r"prec-sqrt=false)$")
_INEXACT_CXX = re.compile(r"^-(ffast-math|Ofast|ffp-contract=(fast|on)|funsafe-math-optimizations)$")


def _check_exact_math(nvcc, cxx, env=os.environ):
    """Error message if the flags (or nvcc's NVCC_APPEND/PREPEND_FLAGS) allow inexact float math."""
    extra = (env.get("NVCC_PREPEND_FLAGS", "") + " " + env.get("NVCC_APPEND_FLAGS", "")).split()
    bad = [f for f in [*nvcc, *extra] if _INEXACT_NVCC.match(f)]
    bad += [f for f in cxx if _INEXACT_CXX.match(f)]
    if nvcc and "--fmad=false" not in nvcc:
        bad.append("(--fmad=false missing)")
    if "-ffp-contract=off" not in cxx:
        bad.append("(-ffp-contract=off missing)")
    if bad:
        return ("mpfused: flags that break the bit-exact CPU = CUDA contract: " + " ".join(bad))
    return None


def _extensions():
    if NO_EXT:
        return [], {}
    import torch
    from torch.utils import cpp_extension as ce

    want_cuda = CUDA_MODE != "0"
    has_toolkit = torch.version.cuda is not None and ce.CUDA_HOME is not None
    if CUDA_MODE == "1" and not has_toolkit:
        sys.exit("MPFUSED_CUDA=1 but torch has no CUDA (torch.version.cuda is None) or no CUDA "
                 "toolkit was found (set CUDA_HOME)")
    use_cuda = want_cuda and has_toolkit
    if use_cuda and not os.path.isfile(os.path.join(ce.CUDA_HOME, "include", "cuda_runtime.h")):
        # torch guesses CUDA_HOME from `which nvcc`; a wrapper script on PATH (/usr/local/bin/nvcc)
        # makes that /usr/local, which has no CUDA headers
        msg = (f"CUDA_HOME={ce.CUDA_HOME} has no include/cuda_runtime.h: set CUDA_HOME to the "
               "toolkit (e.g. /usr/local/cuda)")
        if CUDA_MODE == "1":
            sys.exit(msg)
        print(f"mpfused: {msg}; building without CUDA kernels", file=sys.stderr)
        use_cuda = False
    # SASS for A100 and H100, PTX of sm_90 for newer GPUs (JIT); older GPUs get the Triton kernels
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    archs = os.environ["TORCH_CUDA_ARCH_LIST"] if use_cuda else ""

    sources = (_sources("bindings/module.cpp") + _sources("bindings/bound_lists.cpp")
               + _sources("bindings/release_worker.cpp") + _sources("bindings/release_hook.cpp")
               + _sources("bindings/op_versions.cpp")
               + _sources("bindings/*_cpu.cpp") + _sources("cpu/*.cpp"))
    define = [("Py_LIMITED_API", "0x03090000"), ("MPFUSED_WITH_CUDA", "1" if use_cuda else "0"),
              ("MPFUSED_CUDA_ARCHS", f'"{archs}"')]
    # no FMA contraction: the AVX-512/AVX2/baseline clones, CUDA and Triton round identically.
    # -fno-trapping-math changes no result (no reassociation, no contraction, NaN rules kept); it
    # only lets GCC if-convert and vectorize the kernels' selects: without it the AVX2 and baseline
    # clones stay scalar (Adam fp32 2.6 -> 1.0 ns/elem on AVX2, 3.5 -> 1.25 baseline, 1 thread).
    cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
           _cxx_std(ce.include_paths()[0])]
    args = dict(include_dirs=[os.path.join(ROOT, "csrc", "include")], define_macros=define,
                py_limited_api=True)
    if use_cuda:
        sources += _sources("bindings/*_cuda.cpp") + _sources("cuda/*.cu")
        nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", "--fmad=false"]
        err = _check_exact_math(nvcc, cxx)
        if err:
            sys.exit(err)
        ext = ce.CUDAExtension("mpfused._C", sources, extra_compile_args={
            "cxx": cxx, "nvcc": nvcc}, extra_link_args=["-fopenmp"], **args)
    else:
        err = _check_exact_math([], cxx)
        if err:
            sys.exit(err)
        ext = ce.CppExtension("mpfused._C", sources, extra_compile_args={"cxx": cxx},
                              extra_link_args=["-fopenmp"], **args)
    info = {"torch_version": torch.__version__, "with_cuda": use_cuda, "cuda_archs": archs,
            "cuda_version": torch.version.cuda if use_cuda else None}
    with open(os.path.join(ROOT, "mpfused", "_build_info.json"), "w") as f:
        json.dump(info, f)
    cmdclass = {"build_ext": ce.BuildExtension.with_options(use_ninja=True)}
    return [ext], cmdclass


ext_modules, cmdclass = _extensions()
setup(
    name="mpfused",
    version="0.1.0",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"mpfused": ["_build_info.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp39"}} if ext_modules else {},
)

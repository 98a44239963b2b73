"""Loading of the native extension ``mpfused._C``.

``import mpfused`` never fails because of the extension: when it is missing, disabled
(``MPFUSED_NO_EXT=1``) or was built against another torch, a single warning is issued and the
Triton / reference backends serve every op.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

_BUILD_INFO = Path(__file__).with_name("_build_info.json")
_module = None
_error: str | None = None
_tried = False


def build_info() -> dict:
    """What setup.py recorded when it built the extension (empty for a pure-Python install)."""
    try:
        return json.loads(_BUILD_INFO.read_text())
    except (OSError, ValueError):
        return {}


def _torch_release(version: str) -> str:
    return version.split("+")[0]


def load():
    """Import ``mpfused._C`` once; return the module or None (and remember why)."""
    global _module, _error, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("MPFUSED_NO_EXT", "0") == "1":
        _error = "disabled by MPFUSED_NO_EXT=1"
        return None
    info = build_info()
    built_for = info.get("torch_version")
    if built_for and _torch_release(built_for) != _torch_release(torch.__version__):
        # Loading a libtorch-ABI extension built for another torch can crash, not just fail.
        _error = f"built for torch {built_for}, running torch {torch.__version__}; rebuild mpfused"
    else:
        try:
            from mpfused import _C  # noqa: F401  (runs the TORCH_LIBRARY_IMPL registrars)

            _module = _C
        except (ImportError, OSError, RuntimeError) as exc:
            _error = f"{type(exc).__name__}: {exc}"
    if _module is None:
        warnings.warn(
            f"mpfused: native extension unavailable ({_error}); using the Triton/reference "
            "backends. Build it with `pip install --no-build-isolation .`.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _module


def error() -> str | None:
    return _error


def with_cuda() -> bool:
    return bool(_module is not None and getattr(_module, "with_cuda", 0))


def archs_run_on(archs: str, capability: tuple[int, int]) -> bool:
    """Whether kernels built for TORCH_CUDA_ARCH_LIST `archs` (e.g. "8.0;9.0+PTX") run on a GPU of
    compute `capability`: SASS of its major version and a minor not above its own, or PTX of an
    architecture not above it (the driver JIT-compiles it)."""
    for entry in archs.replace(",", ";").replace(" ", ";").split(";"):
        ptx = entry.endswith("+PTX")
        version = entry.removesuffix("+PTX")
        if not version:
            continue
        major, _, minor = version.partition(".")
        try:
            arch = (int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0))
        except ValueError:  # a named architecture ("Hopper"): trust the build, as before
            return True
        if (arch[0] == capability[0] and arch[1] <= capability[1]) or (ptx and arch <= capability):
            return True
    return False


def cuda_kernels_run_here() -> bool:
    """The native CUDA kernels have code for the current GPU (else the first launch would fail
    with "no kernel image is available": the router registers Triton instead)."""
    try:
        capability = torch.cuda.get_device_capability()
    except Exception:
        return False
    return archs_run_on(build_info().get("cuda_archs") or "", capability)

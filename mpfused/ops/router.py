"""The router: which implementation ``torch.ops.mpfused.<op>`` runs on each device, decided once.

``route_all()`` runs at ``import mpfused`` (the end of ``mpfused/ops/__init__.py``, after the
native extension has loaded), and ``define_op`` routes any op defined later the same way. It reads
``MPFUSED_BACKEND`` once, then, per op and per dispatch key (CPU, CUDA), registers what the
dispatcher runs:

* ``native``: the C++ kernel the extension registered for that key (``TORCH_LIBRARY_IMPL``); the
  router leaves it in place. On CUDA it must also have code for this GPU
  (``_extension.cuda_kernels_run_here``): that is only known once CUDA initializes, so with native
  CUDA kernels the CUDA route is completed then (``torch.cuda._lazy_call``), with the request read
  at import; ``import mpfused`` never initializes CUDA.
* ``triton``: the Triton function, registered as the kernel for the key (imported on first call).
  CUDA only, unless requested: the interpreter (TRITON_INTERPRET=1) is a test aid, never an
  automatic pick on CPU.
* ``reference``: the float64 reference, already the ``CompositeExplicitAutograd`` fallback of every
  device (``define_op``); registered for the key only where it must hide a native kernel.
* a request for a backend that cannot serve a key registers a kernel that raises, naming the
  request: ``import mpfused`` does not fail, the op call does (as an explicit request did before).

Registering over the extension's kernel (``MPFUSED_BACKEND=triton|reference``, or a GPU the build
has no code for) is an override torch warns about once per process; the router's overrides are
deliberate, so it silences that warning for its own registrations only (without using up torch's
once-per-process warning for anyone else's).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch

from mpfused import _extension

BACKENDS = ("native", "triton", "reference")
REQUESTS = BACKENDS + ("auto",)
KEYS = {"cpu": "CPU", "cuda": "CUDA"}
UNAVAILABLE = "unavailable"

REQUEST: str | None = None  # MPFUSED_BACKEND as read by route_all(); None before
_LIB: torch.library.Library | None = None  # holds the router's registrations (kept for the process)
_pending_cuda: list = []  # ops whose CUDA route waits for CUDA to initialize


def read_request() -> str:
    """``MPFUSED_BACKEND``, validated (``auto`` when unset)."""
    value = os.environ.get("MPFUSED_BACKEND", "") or "auto"
    if value not in REQUESTS:
        raise ValueError(f"MPFUSED_BACKEND must be one of {', '.join(REQUESTS)} "
                         f"(read at `import mpfused`), got {value!r}")
    return value


def triton_installed() -> bool:
    """Triton and mpfused's Triton kernels can be imported (checked without importing them)."""
    return all(importlib.util.find_spec(m) is not None
               for m in ("triton", "mpfused.triton_kernels"))


def decide(device_type: str, request: str, *, native: bool, triton: bool, interpret: bool) -> str:
    """What the dispatcher runs for ``device_type`` given the request and what exists: a backend
    name, or ``UNAVAILABLE`` when the request cannot be met. ``native``: the extension's kernel
    for the key runs here; ``triton``: the op has a Triton function and Triton is installed;
    ``interpret``: TRITON_INTERPRET=1 (Triton on CPU tensors)."""
    can = {"native": native, "reference": True,
           "triton": triton and (device_type == "cuda" or (device_type == "cpu" and interpret))}
    if request != "auto":
        return request if can[request] else UNAVAILABLE
    if native:
        return "native"
    return "triton" if can["triton"] and device_type == "cuda" else "reference"


def route_all(ops) -> None:
    """Route every op (once, at import)."""
    global REQUEST, _LIB
    if REQUEST is not None:
        return
    REQUEST = read_request()
    _LIB = torch.library.Library("mpfused", "IMPL")
    for op in ops:
        route(op)
    if _pending_cuda:
        _when_cuda_initializes(finish_cuda)


def route(op) -> None:
    """Register what ``torch.ops.mpfused.<op.name>`` runs on CPU and CUDA (``op.routes``)."""
    triton = op.triton_path is not None and triton_installed()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for device_type, key in KEYS.items():
        has_native = torch._C._dispatch_has_kernel_for_dispatch_key(op.qualname, key)
        op.native_keys[device_type] = has_native
        if device_type == "cuda" and has_native and REQUEST in ("auto", "native"):
            op.routes["cuda"] = None  # native or not depends on the GPU: decided at CUDA init
            _pending_cuda.append(op)
            continue
        chosen = decide(device_type, REQUEST, native=has_native, triton=triton, interpret=interpret)
        _register(op, device_type, chosen)


def finish_cuda() -> None:
    """Complete the CUDA routes left pending (CUDA is initialized: the GPU is known)."""
    runs = _extension.cuda_kernels_run_here()
    triton = triton_installed()
    while _pending_cuda:
        op = _pending_cuda.pop()
        chosen = decide("cuda", REQUEST, native=runs, triton=triton and op.triton_path is not None,
                        interpret=False)
        _register(op, "cuda", chosen)


def _when_cuda_initializes(fn) -> None:
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is None or torch.cuda.is_initialized():
        fn()
        return

    def guarded():  # an exception here would fail CUDA's initialization itself
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"mpfused: routing the CUDA kernels failed ({exc!r}); the native CUDA "
                          "kernels stay registered", RuntimeWarning, stacklevel=2)
    lazy_call(guarded)


def _register(op, device_type: str, chosen: str) -> None:
    op.routes[device_type] = chosen
    if chosen == "native" or (chosen == "reference" and not op.native_keys[device_type]):
        return  # the extension's kernel, or the CompositeExplicitAutograd fallback, serves
    if chosen == "triton":
        kernel = _triton_kernel(op)
    elif chosen == "reference":
        kernel = reference_kernel(op)
    else:
        kernel = _refusing_kernel(unavailable_message(op, device_type, REQUEST,
                                                     "MPFUSED_BACKEND at `import mpfused`"))
    with _quiet_override():
        _LIB.impl(op.name, kernel, KEYS[device_type])


def _triton_kernel(op):
    def triton_kernel(*args, **kwargs):  # imports the Triton module on the first call
        return op.triton(*args, **kwargs)
    triton_kernel.__name__ = f"{op.name}_triton"
    return triton_kernel


def reference_kernel(op):
    def reference_kernel(*args, **kwargs):  # op.reference looked up per call, as op.triton
        return op.reference(*args, **kwargs)
    reference_kernel.__name__ = f"{op.name}_reference"
    return reference_kernel


def _refusing_kernel(message: str):
    def unavailable(*args, **kwargs):
        raise RuntimeError(message)
    return unavailable


def unavailable_message(op, device_type: str, backend: str, asked_by: str) -> str:
    why = ""
    if backend == "native":
        if not op.native_keys.get(device_type):
            why = f"; native extension: {_extension.error() or 'built without a kernel for it'}"
        elif REQUEST not in ("auto", "native"):
            why = f"; MPFUSED_BACKEND={REQUEST} at `import mpfused` registered {REQUEST} instead"
        else:
            why = "; the build has no code for this GPU's architecture"
    elif backend == "triton" and device_type == "cpu":
        why = "; Triton runs on CPU tensors only under TRITON_INTERPRET=1"
    return (f"mpfused: backend {backend!r} ({asked_by}) is not available for op {op.name} on "
            f"{device_type} (available: {', '.join(op.available(device_type))}){why}")


@contextlib.contextmanager
def _quiet_override():
    """Silence torch's "Overriding a previously registered kernel" for the router's own,
    deliberate overrides. warnAlways makes torch's warn-once a plain warning, so its single
    per-process warning stays for anyone else's override."""
    always = torch._C._get_warnAlways()
    torch._C._set_warnAlways(True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered")
            yield
    finally:
        torch._C._set_warnAlways(always)

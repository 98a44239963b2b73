"""The op registry: every op is declared once here, with its schema, its fake (meta) kernel, its
pure-PyTorch reference and, where they exist, its Triton and native implementations.

Dispatch model
--------------
* The schema is defined in Python (``torch.library``), so the op exists with or without the
  extension. The reference is registered as the CompositeExplicitAutograd kernel, i.e. the
  fallback on every device; the fake kernel lets ``torch.compile`` trace the op.
* The native extension registers CPU and CUDA kernels for the same op names from C++
  (``TORCH_LIBRARY_IMPL(mpfused, CPU/CUDA, m)``); the dispatcher then prefers them.
* Backends are ``native``, ``triton`` and ``reference``. ``Op.__call__`` resolves which one
  serves a call: the ``backend=`` argument, else ``MPFUSED_BACKEND``, else automatic (native when
  it has a kernel for the device, then Triton on CUDA, then the reference). An explicit request
  for an unavailable backend raises; automatic selection falls back silently.
"""
from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from mpfused import _extension

NAMESPACE = "mpfused"
BACKENDS = ("native", "triton", "reference")
_LIB = torch.library.Library(NAMESPACE, "DEF")
OPS: dict[str, "Op"] = {}


def requested_backend(backend: str | None = None) -> str:
    """The backend asked for: the explicit argument, else ``MPFUSED_BACKEND``, else ``auto``."""
    choice = backend or os.environ.get("MPFUSED_BACKEND", "") or "auto"
    if choice not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {BACKENDS + ('auto',)}, got {choice!r}")
    return choice


def triton_usable(device_type: str) -> bool:
    """Triton runs on CUDA, and on CPU tensors only under TRITON_INTERPRET=1."""
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if device_type not in ("cpu", "cuda"):
        return False
    try:
        import mpfused.triton_kernels  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Op:
    name: str
    schema: str
    reference: Callable
    triton_path: str | None = None  # "module:function", imported on first use
    _overload: object = field(default=None, repr=False)
    _triton_fn: Callable | None = field(default=None, repr=False)
    _resolved: dict = field(default_factory=dict, repr=False)

    @property
    def triton(self) -> Callable | None:
        """The Triton implementation, imported lazily (TRITON_INTERPRET is read at import)."""
        if self._triton_fn is None and self.triton_path is not None:
            module, fn = self.triton_path.split(":")
            self._triton_fn = getattr(importlib.import_module(module), fn)
            if self.schema.endswith("-> ()"):
                self._triton_fn = _no_derivative(self._triton_fn)
        return self._triton_fn

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def overload(self):
        """``torch.ops.mpfused.<name>.default``: the dispatcher entry (for opcheck/compile)."""
        if self._overload is None:
            self._overload = getattr(torch.ops.mpfused, self.name).default
        return self._overload

    def native_available(self, device_type: str) -> bool:
        key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
        if not key or not torch._C._dispatch_has_kernel_for_dispatch_key(self.qualname, key):
            return False
        # a kernel is registered; on CUDA it must also have code for this GPU's architecture
        return device_type != "cuda" or _extension.cuda_kernels_run_here()

    def available(self, device_type: str) -> list[str]:
        out = []
        if self.native_available(device_type):
            out.append("native")
        if self.triton_path is not None and triton_usable(device_type):
            out.append("triton")
        out.append("reference")
        return out

    def resolve(self, device_type: str, backend: str | None = None) -> str:
        choice = requested_backend(backend)
        avail = self.available(device_type)
        if choice == "auto":
            if device_type == "cpu" and "native" not in avail:
                return "reference"  # the interpreter is a test aid, never an automatic pick
            return avail[0]
        if choice not in avail:
            raise RuntimeError(
                f"mpfused: backend {choice!r} is not available for op {self.name} on "
                f"{device_type} (available: {', '.join(avail)})"
                + (f"; native extension: {_extension.error()}" if choice == "native" else "")
            )
        return choice

    def chosen(self, device_type: str, backend: str | None = None) -> str:
        """``resolve``, cached per (device, request, environment): the optimizers call every
        step, and resolving costs more than a small kernel."""
        key = (device_type, backend, os.environ.get("MPFUSED_BACKEND"),
               os.environ.get("TRITON_INTERPRET"))
        chosen = self._resolved.get(key)
        if chosen is None:
            chosen = self._resolved[key] = self.resolve(device_type, backend)
        return chosen

    def __call__(self, *args, backend: str | None = None):
        if torch.compiler.is_compiling():
            return self._traced_call(args, backend)
        chosen = self.chosen(_first_device_type(args), backend)
        if chosen == "native":
            return self.overload(*args)
        if chosen == "triton":
            return self.triton(*args)
        return self.reference(*args)


    def _traced_call(self, args, backend: str | None):
        """Under ``torch.compile``: a native kernel goes into the graph as the dispatcher op (its
        fake kernel traces it; no graph break, so ``fullgraph=True`` works), and runs as in eager.
        Triton and the reference run eagerly behind a graph break: traced, their Python would be
        re-fused by the compiler and round differently from the eager step."""
        chosen = _chosen_when_traced(self.name, _first_device_type(args), backend)
        if chosen == "native":
            return self.overload(*args)
        return _run_eagerly(self, chosen, args)


@torch.compiler.assume_constant_result
def _chosen_when_traced(name: str, device_type: str, backend: str | None) -> str:
    # Asked at trace time and baked into the graph (the answer is a registration fact).
    return OPS[name].chosen(device_type, backend)


@torch._dynamo.disable
def _run_eagerly(op: "Op", chosen: str, args):
    return (op.triton if chosen == "triton" else op.reference)(*args)


def _first_device_type(args) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor):
                    return t.device.type
    return "cpu"


def define_op(schema: str, *, reference: Callable, fake: Callable | None = None,
              triton: str | None = None) -> Op:
    """Declare ``mpfused::<schema>`` once and register its fake kernel and its reference."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    qual = f"{NAMESPACE}::{name}"
    in_place = schema.endswith("-> ()")
    if in_place:
        reference = _no_derivative(reference)
    torch.library.register_fake(qual, fake or _no_output_fake, lib=_LIB)
    torch.library.register_kernel(qual, "default", reference, lib=_LIB)
    if in_place:
        # No outputs, so no derivative to record: autograd passes the call straight on. Torch's
        # default autograd fallback would box it (turn every tensor list into an IValue list and
        # back: ~0.5 us per tensor, 5 ms of a call with 10,000 tensors) only to attach nothing.
        _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    op = Op(name=name, schema=schema, reference=reference, triton_path=triton)
    OPS[name] = op
    return op


def _no_derivative(fn: Callable) -> Callable:
    """An in-place op's Python implementation (reference, Triton) run without autograd, as its
    native kernels are (and as torch's fused optimizer ops): in grad mode its in-place updates
    of leaf tensors that require grad would otherwise raise."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)
    return run


def _no_output_fake(*args, **kwargs):
    """Fake kernel of an in-place op that returns nothing: its effect is declared in the schema."""
    return None

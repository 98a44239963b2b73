"""The op registry: every op is declared once here, with its schema, its fake (meta) kernel, its
pure-PyTorch reference and, where they exist, its Triton and native implementations.

Dispatch model: one router, torch's dispatcher
----------------------------------------------
* ``define_op`` defines the schema in Python (``torch.library``), so the op exists with or without
  the extension; registers the fake kernel (``torch.compile`` traces the op as one opaque node)
  and the reference as the ``CompositeExplicitAutograd`` kernel (the fallback on every device).
* The native extension registers CPU and CUDA kernels for the same op names from C++
  (``TORCH_LIBRARY_IMPL(mpfused, CPU/CUDA, m)``) when it loads.
* ``router.route_all`` (at ``import mpfused``) then decides once, per op and dispatch key, what
  ``torch.ops.mpfused.<op>`` runs: native, else Triton on CUDA (registered as the CUDA kernel),
  else the reference; ``MPFUSED_BACKEND`` (read then, once) forces one. See ``router.py``.
* Every schema takes its operands (tensor lists, operand tensors) positionally and every scalar,
  option and optional tensor after ``*`` (keyword-only), as torch's ``_fused_adamw_``. Each op has
  one typed wrapper beside its schema (``mpfused/ops/<family>.py``, registered with ``op.wraps``):
  the entry the package calls, with a docstring, the schema's parameter names and ``backend=``.
* ``op(*operands, **scalars)`` is the dispatcher op: what the optimizers run is what ``opcheck``
  checks and what ``torch.compile`` traces. ``op(..., backend=...)`` (the per-object ``backend=``
  of the optimizers, the scaler, ``clip_grad_norm_``) is an explicit test/debug request: it calls
  that implementation directly (native: only where the router registered it), and raises when it
  is unavailable. The reference and Triton functions take the schema's keyword names (the
  dispatcher passes keyword-only arguments to Python kernels as keywords, leaving out those equal
  to their default).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from mpfused.ops import router

NAMESPACE = "mpfused"
BACKENDS = router.BACKENDS
_LIB = torch.library.Library(NAMESPACE, "DEF")
OPS: dict[str, "Op"] = {}
REQUIRED = object()  # Op.keyword_args: a keyword-only argument without a default


def triton_usable(device_type: str) -> bool:
    """Triton runs on CUDA, and on CPU tensors only under TRITON_INTERPRET=1 (explicit calls)."""
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
    routes: dict = field(default_factory=dict, repr=False)  # device type -> what torch.ops runs
    native_keys: dict = field(default_factory=dict, repr=False)  # device type -> extension kernel?
    wrapper: Callable | None = field(default=None, repr=False)  # the typed entry (op.wraps)
    _overload: object = field(default=None, repr=False)
    _triton_fn: Callable | None = field(default=None, repr=False)

    def wraps(self, fn: Callable) -> Callable:
        """Register ``fn`` as the op's typed wrapper (``fn.op`` is this op) and return it."""
        self.wrapper = fn
        fn.op = self
        return fn

    def wraps_like(self, template: Callable, module: str, doc: str) -> Callable:
        """The typed wrapper of an op whose arguments are those of ``template``'s op (a sibling
        with another state format, e.g. ``sgd4bit_step_`` of ``sgd8bit_step_``): ``template``'s
        signature and annotations (what ``inspect.signature`` shows), this op's name, the
        ``module`` it is published in and its own ``doc``. It binds its arguments as
        ``template`` does and calls this op as ``template`` calls its own: operands positionally,
        every scalar by keyword."""
        if self.schema[len(self.name):] != template.op.schema[len(template.op.name):]:
            raise ValueError(f"{self.name}: wraps_like({template.op.name}) needs the same schema")
        sig = inspect.signature(template)
        op = self

        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            return op(*bound.args, **bound.kwargs)

        wrapper.__name__ = wrapper.__qualname__ = self.name
        wrapper.__module__, wrapper.__doc__ = module, doc
        wrapper.__signature__ = sig
        wrapper.__annotations__ = dict(template.__annotations__)
        return self.wraps(wrapper)

    @functools.cached_property
    def keyword_args(self) -> tuple:
        """The keyword-only arguments in schema order: (name, default or REQUIRED) pairs."""
        out = []
        for a in torch._C.parse_schema(self.schema).arguments:
            if a.kwarg_only:
                default = a.default_value if a.has_default_value() else REQUIRED
                out.append((a.name, tuple(default) if isinstance(default, list) else default))
        return tuple(out)

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
        """``torch.ops.mpfused.<name>.default``: the dispatcher entry, what ``op(*args)`` calls."""
        if self._overload is None:
            self._overload = getattr(torch.ops.mpfused, self.name).default
        return self._overload

    def route(self, device_type: str) -> str:
        """What ``torch.ops.mpfused.<name>`` runs on ``device_type``: ``native``, ``triton``,
        ``reference`` or ``unavailable`` (MPFUSED_BACKEND asked for what cannot serve)."""
        chosen = self.routes.get(device_type)
        if chosen is None:
            if device_type not in router.KEYS:
                return "reference"  # the CompositeExplicitAutograd fallback
            if device_type == "cuda" and router._pending_cuda:
                router.finish_cuda()
            chosen = self.routes.get(device_type, "reference")
        return chosen

    def native_available(self, device_type: str) -> bool:
        """The dispatcher runs the extension's kernel for this device."""
        return self.route(device_type) == "native"

    def available(self, device_type: str) -> list[str]:
        """The backends an explicit ``backend=`` can call on this device now."""
        out = ["native"] if self.native_available(device_type) else []
        if self.triton_path is not None and triton_usable(device_type):
            out.append("triton")
        return out + ["reference"]

    def impl(self, backend: str, device_type: str) -> Callable:
        """The implementation an explicit ``backend=`` calls; raises when it is unavailable."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS + ('auto',)}, got {backend!r}")
        if not (self.native_available(device_type) if backend == "native"
                else backend in self.available(device_type)):
            raise RuntimeError(router.unavailable_message(self, device_type, backend,
                                                          "backend= argument"))
        return {"native": self.overload, "triton": self.triton,
                "reference": self.reference}[backend]

    def __call__(self, *args, backend: str | None = None, **kwargs):
        if backend is None or backend == "auto":
            return self.overload(*args, **kwargs)
        if backend == "native" or not torch.compiler.is_compiling():
            return self._run(backend, args, kwargs)
        return _run_eagerly(self, backend, args, kwargs)

    def _run(self, backend: str, args, kwargs):
        """The explicit call; after a Triton one, which writes through pointers, what the
        dispatcher's ADInplaceOrView kernel does (csrc/bindings/op_versions.cpp): the version of
        every tensor the schema marks written bumped (the reference's in-place ops bump their
        own; native is the dispatcher op)."""
        out = self.impl(backend, _first_device_type(args))(*args, **kwargs)
        if backend == "triton":
            self._bump_written(args, kwargs)
        return out

    def _bump_written(self, args, kwargs) -> None:
        schema = self.overload._schema.arguments
        named = dict(zip((a.name for a in schema), args)) | kwargs
        for a in schema:
            if a.alias_info is not None and a.alias_info.is_write:
                v = named.get(a.name)
                for t in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(t, torch.Tensor) and not t.is_inference():
                        torch.autograd.graph.increment_version(t)


@torch.compiler.disable
def _run_eagerly(op: "Op", backend: str, args, kwargs):
    """An explicit Triton/reference request under ``torch.compile`` runs eagerly behind a graph
    break: traced, its Python would be re-fused by the compiler and round differently from the
    eager step (the dispatcher op, the default, needs no break: it is one opaque node)."""
    return op._run(backend, args, kwargs)


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
    """Declare ``mpfused::<schema>`` once and register its fake kernel and its reference; the
    router (at import) adds the per-device choice."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    qual = f"{NAMESPACE}::{name}"
    in_place = schema.endswith("-> ()")
    if in_place:
        reference = _no_derivative(reference)
    op = Op(name=name, schema=schema, reference=reference, triton_path=triton)
    torch.library.register_fake(qual, fake or _no_output_fake, lib=_LIB)
    torch.library.register_kernel(qual, "default", router.reference_kernel(op), lib=_LIB)
    if in_place:
        # No outputs, so no derivative to record: autograd passes the call straight on. Torch's
        # default autograd fallback would box it (turn every tensor list into an IValue list and
        # back: ~0.5 us per tensor, 5 ms of a call with 10,000 tensors) only to attach nothing.
        _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    OPS[name] = op
    if router.REQUEST is not None:  # defined after import: routed now, as the others were then
        router.route(op)
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

"""Calls of a multi-tensor step op whose operand lists, all but the grads, are bound once.

An optimizer bucket's params and state tensors stay the same from step to step; only its grads
are new. Passing all of them to the op each step makes torch convert every Python tensor list to
C++ (~145 ns per tensor: 7 ms of a 10 ms call with 10,000 tensors and five lists). A
``BoundOp`` converts the fixed lists once, on its first native eager call, into
``torch.classes.mpfused.BoundLists`` (see csrc/bindings/bound_lists.cpp), and a step passes only
the grads. Under ``torch.compile``, where the dispatcher does not run the native kernel (router.py),
with an explicit Triton/reference ``backend=`` or without the extension it calls the op with the
plain lists, so every path computes the same thing. The op's trailing
``param_ids`` and ``elem_offsets`` (the stochastic-rounding keys) are fixed per bucket too: they
are bound with the lists. A call passes the grads, the operand tensors after the lists (the 8-bit
maps) positionally and the scalars by keyword, as the op's wrapper takes them; the native path
puts the scalars in schema order for the BoundLists method (whose C++ signature is the op's:
keyword-only schema arguments are positional in C++), filling in the schema's defaults.

Gradient release (mpfused/optim/release.py) arms a call with ``check_first``: the release
bucket's non-finite check, its flags recorded, then the step, in one native call
(``BoundLists.released_<op>``); every other path runs ``check_and_record`` (the check op, the
same flags) and then the plain call. Its plain path holds each bucket's call armed
(``arm_native``: the scalars and params held natively, a release is one call).
"""
from __future__ import annotations

import torch

from mpfused import _extension
from mpfused.ops import amp as amp_ops
from mpfused.ops.registry import REQUIRED

_UNBUILT = object()
_BOUND_KEYWORDS = ("param_ids", "elem_offsets")  # bound with the lists, not passed per call


class BoundOp:
    """``op(lists[0], grads, *lists[1:], *operands, **scalars, param_ids=..., elem_offsets=...)``
    with ``lists``, ``param_ids`` and ``elem_offsets`` bound once. ``op``: the op's wrapper (e.g.
    ``mpfused.ops.adam.adam_step_``) or its ``Op``."""

    def __init__(self, op, lists: list[list[torch.Tensor]], param_ids=(), elem_offsets=()):
        op = getattr(op, "op", op)
        self.op = op
        # the keyword-only arguments a call passes, in schema order, with their defaults
        self._keywords = tuple(kw for kw in op.keyword_args if kw[0] not in _BOUND_KEYWORDS)
        self._order = tuple(name for name, _ in self._keywords)
        self._names = frozenset(self._order)
        self._required = frozenset(name for name, d in self._keywords if d is REQUIRED)
        self.lists = lists
        self.param_ids = [int(i) for i in param_ids]
        self.elem_offsets = [int(o) for o in elem_offsets]
        self.device_type = lists[0][0].device.type if lists[0] else "cpu"
        self._native = _UNBUILT
        self._released = False  # the native lists have released_<op> (not a stale build)
        self._step = self._released_step = self._arm = None  # their methods, looked up once
        self._pre = None  # check_first's arguments, for the next call only

    def native(self):
        """The lists held natively, built on first use; None without a usable extension (one
        built before BoundLists existed included: the plain call still works there)."""
        if self._native is _UNBUILT:
            self._native = None
            if _extension.load() is not None:
                try:
                    self._native = torch.classes.mpfused.BoundLists(
                        [t for tensors in self.lists for t in tensors], [len(t) for t in self.lists],
                        self.param_ids, self.elem_offsets)
                    self._released = self._native._has_method("released_" + self.op.name)
                    self._step = getattr(self._native, self.op.name)
                    if self._released:
                        self._released_step = getattr(self._native, "released_" + self.op.name)
                    if self._native._has_method("arm_released_" + self.op.name):
                        self._arm = getattr(self._native, "arm_released_" + self.op.name)
                except RuntimeError:  # a stale build: no such class
                    pass
        return self._native

    def check_first(self, check_grads, found, inv_scale, found_total, skipped) -> None:
        """Make the next call check ``check_grads`` before the step (``check_and_record``); that
        call's found_inf must be ``found``."""
        self._pre = (check_grads, found, inv_scale, found_total, skipped)

    def _goes_native(self, backend) -> bool:
        """A call with this ``backend`` runs the native kernel through the bound lists."""
        # BoundLists calls the dispatcher op: only where the router registered the native kernel
        # is_compiling first: under torch.compile nothing here may build the ScriptClass
        return ((backend is None or backend == "auto" or backend == "native")
                and not torch.compiler.is_compiling()
                and self.op.native_available(self.device_type)
                and (self._native if self._native is not _UNBUILT else self.native()) is not None)

    def arm_native(self, backend: str | None):
        """``BoundLists.arm_released_<op>`` (``(params, flags, *operands, *ordered(scalars))`` ->
        an ``ArmedStep`` whose ``run()`` releases the bucket: csrc/bindings/bound_lists.cpp)
        where a call with this ``backend`` would run the native kernel; else None."""
        return self._arm if self._goes_native(backend) else None

    def ordered(self, scalars: dict):
        """The keyword scalars in schema order, defaults filled in, as the native methods take
        them (an iterable)."""
        if scalars.keys() == self._names:  # the optimizers pass every keyword: one compare
            return map(scalars.__getitem__, self._order)
        self._check_keywords(scalars)
        return [scalars.get(name, d) for name, d in self._keywords]

    def __call__(self, grads: list[torch.Tensor], *operands, backend: str | None = None,
                 **scalars):
        pre, self._pre = self._pre, None
        if self._goes_native(backend) and (pre is None or self._released):
            if pre is not None:
                return self._released_step(*pre, grads, *operands, *self.ordered(scalars))
            return self._step(grads, *operands, *self.ordered(scalars))
        if pre is not None:
            check_and_record(*pre, backend=backend)
        return self.op(self.lists[0], grads, *self.lists[1:], *operands, **scalars,
                       param_ids=self.param_ids, elem_offsets=self.elem_offsets, backend=backend)

    def _check_keywords(self, scalars) -> None:
        """Some keywords left to their defaults: fine unless a required one is missing or a name
        is unknown (TypeError, as the plain call's)."""
        missing = sorted(self._required - scalars.keys())
        unknown = sorted(scalars.keys() - self._names)
        if missing or unknown:
            raise TypeError(f"mpfused: bound {self.op.name}: " + "; ".join(
                ([f"missing keyword argument(s) {', '.join(missing)}"] if missing else [])
                + ([f"unexpected keyword argument(s) {', '.join(unknown)}"] if unknown else [])))


def check_and_record(check_grads, found, inv_scale, found_total, skipped, per_grad=None,
                     backend: str | None = None) -> None:
    """A gradient-release bucket's check (what ``BoundLists.released_<op>`` does before the step,
    csrc/bindings/bound_lists.cpp): ``found`` cleared, then set to 1 if a grad of
    ``check_grads`` is non-finite once unscaled by ``inv_scale`` (``per_grad``: their sums of
    squares, accumulated into); ``found_total = max(found_total, found)``, ``skipped += found >
    0``. All in place, on the device."""
    found.zero_()
    amp_ops.check_grads(check_grads, found, inv_scale, norm_sq=None, norm_sq_per_tensor=per_grad,
                        backend=backend)
    torch.maximum(found_total, found, out=found_total)
    skipped.add_((found > 0).to(skipped.device))

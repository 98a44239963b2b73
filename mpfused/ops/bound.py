"""Calls of a multi-tensor step op whose operand lists, all but the grads, are bound once.

An optimizer bucket's params and state tensors stay the same from step to step; only its grads
are new. Passing all of them to the op each step makes torch convert every Python tensor list to
C++ (~145 ns per tensor: 7 ms of a 10 ms call with 10,000 tensors and five lists). A
``BoundOp`` converts the fixed lists once into ``torch.classes.mpfused.BoundLists`` (see
csrc/bindings/bound_lists.cpp) and a step passes only the grads. It serves native calls in eager
mode; under ``torch.compile``, on the Triton or reference backend, or without the extension it
calls the op with the plain lists, so every path computes the same thing.
"""
from __future__ import annotations

import torch

from mpfused import _extension
from mpfused.ops.registry import Op


class BoundOp:
    """``op(lists[0], grads, *lists[1:], *rest)`` with ``lists`` bound once."""

    def __init__(self, op: Op, lists: list[list[torch.Tensor]]):
        self.op = op
        self.lists = lists
        self.device_type = lists[0][0].device.type if lists[0] else "cpu"
        self._native = None
        if _extension.load() is not None:
            flat = [t for tensors in lists for t in tensors]
            self._native = torch.classes.mpfused.BoundLists(flat, [len(t) for t in lists])

    def __call__(self, grads: list[torch.Tensor], *rest, backend: str | None = None):
        if (self._native is not None and self.op.chosen(self.device_type, backend) == "native"
                and not torch.compiler.is_compiling()):
            return getattr(self._native, self.op.name)(grads, *rest)
        return self.op(self.lists[0], grads, *self.lists[1:], *rest, backend=backend)

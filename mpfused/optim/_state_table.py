"""``optimizer.state`` with a cheap answer to "changed since the kernel plans were made?".

The fused step caches each bucket's state tensors (its plan). torch re-reads ``optimizer.state``
every step, so writing a param's state (``opt.state[p] = {}``), one of its entries
(``opt.state[p]["exp_avg"] = torch.zeros_like(p)``, a new ``step``) or deleting either must take
effect at the next step. Every such write bumps one module-wide counter; the step compares it with
the value its plans were made at: O(1) a step, no walk over the params. In-place writes to state
tensors (``state["exp_avg"].zero_()``) need nothing: the kernels use those very tensors.

One counter for every optimizer (not one per table): writes happen when plans are made, at loads
and in user code, never in a steady-state step, so another optimizer's write costs at most one
re-plan (a re-plan that changes nothing writes nothing: two optimizers never re-plan each other
in turn); and unpickling (which sets dict items before any instance attribute) needs no attribute.

A plain dict assigned as a param's state (``opt.state[p] = {...}``) is adopted as a tracked copy:
later writes through ``opt.state[p]`` are seen, writes through the caller's own reference to the
plain dict are not. Tracked dicts pickle (``torch.save``, ``copy.deepcopy``) as plain dicts, so
checkpoints never name an mpfused class.
"""
from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["ParamState", "StateTable", "epoch", "tracked"]

_EPOCH = [0]


def epoch() -> int:
    """The number of writes to tracked optimizer state so far (any optimizer)."""
    return _EPOCH[0]


def _bump() -> None:
    # Traced steps read no plans (AdamW.step), and a counter read under torch.compile would be
    # guarded on: every write would recompile.
    if not torch.compiler.is_compiling():
        _EPOCH[0] += 1


class _CountsWrites:
    """The writes every tracked dict counts (mixed in before dict / defaultdict)."""
    __slots__ = ()

    def __delitem__(self, key):
        _bump()
        super().__delitem__(key)

    def pop(self, key, *default):
        # popping an absent key (the engine drops every master key a mode does not use, at every
        # re-plan) changes nothing: a bump here made two optimizers re-plan each other forever
        if key in self:
            _bump()
        return super().pop(key, *default)

    def popitem(self):
        _bump()
        return super().popitem()

    def clear(self):
        _bump()
        super().clear()


class ParamState(_CountsWrites, dict):
    """One param's state: a dict whose writes are counted."""
    __slots__ = ()

    def __setitem__(self, key, value):
        _bump()
        dict.__setitem__(self, key, value)

    def __ior__(self, other):
        _bump()
        return dict.__ior__(self, other)

    def update(self, *args, **kwargs):
        _bump()
        dict.update(self, *args, **kwargs)

    def setdefault(self, key, default=None):
        if key not in self:
            _bump()
        return dict.setdefault(self, key, default)

    def __reduce__(self):
        return (dict, (dict(self),))


def _adopt(value):
    return value if type(value) is ParamState or not isinstance(value, dict) else ParamState(value)


class StateTable(_CountsWrites, defaultdict):
    """``optimizer.state``: param -> ParamState, a ``defaultdict`` as torch's, writes counted."""

    def __init__(self, items=()):
        super().__init__(ParamState)
        for key, value in dict(items).items():
            dict.__setitem__(self, key, _adopt(value))
        _bump()

    def __missing__(self, key):
        # A new empty entry changes no plan (plans hold params that had state), so reading the
        # state of a param without one (logging every param's state) costs no re-plan.
        value = ParamState()
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key, value):
        _bump()
        dict.__setitem__(self, key, _adopt(value))

    def __ior__(self, other):
        self.update(other)
        return self

    def update(self, *args, **kwargs):
        _bump()
        for key, value in dict(*args, **kwargs).items():
            dict.__setitem__(self, key, _adopt(value))

    def setdefault(self, key, default=None):
        if key not in self:
            _bump()
        return dict.setdefault(self, key, _adopt(default))

    def __reduce__(self):
        return (defaultdict, (dict, {k: dict(v) if isinstance(v, dict) else v
                                     for k, v in self.items()}))


def tracked(state) -> StateTable:
    """``state`` itself when it is a StateTable, else a StateTable of its items."""
    return state if type(state) is StateTable else StateTable(state)

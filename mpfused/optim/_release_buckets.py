"""Gradient release's buckets (mpfused/optim/release.py): a release bucket (``_Chunk``: params of
one group adjacent in backward order), the state-kind rule that groups them, and a bucket's
update made once per (group, ready params) (``_Entry``)."""
from __future__ import annotations

from mpfused.optim._overrides import _kept_32bit_ids


class _Chunk:
    """Params of one group, adjacent in backward order, whose grads add up to ~bucket_bytes."""
    __slots__ = ("group_index", "indices", "ready", "order", "params", "call", "armed")

    def __init__(self, group_index: int):
        self.group_index = group_index
        self.indices: list[int] = []
        self.ready: set[int] = set()
        self.order: tuple = ()  # the indices sorted: the ready set of a full chunk
        self.params: list = []  # the group's params at those indices
        self.call = None  # (state epoch, state, ArmedStep, its address) of this backward, or None
        self.armed = None  # (its BoundOp, the arguments it holds, the ArmedStep, its address)



def _state_kind(optimizer):
    """``kind(group, p)``: the param's state kind as the planner will split it (8/4-bit or
    fp32 state, ``State8bit._wants_8bit``; one kind for other optimizers). Release buckets hold
    params of one kind: the planner would split a mixed one into two kernel calls (the small
    fp32-state params, below ``min_8bit_size``, then gather into buckets of their own, whose
    grads wait for their last param: they are small). Only the grouping depends on it: a param
    whose kind changes later (``keep_32bit_state`` after attaching) is still updated exactly,
    in a split call."""
    wants = getattr(optimizer, "_wants_8bit", None)
    if wants is None:
        return lambda group, p: True
    kept = _kept_32bit_ids()
    return lambda group, p: wants(group, p, kept)


class _Entry:
    """A release bucket's update, made once per (group, ready params): the planner's buckets,
    each with the getter of its grads from the release bucket's (``ready`` order), their
    device and, with clip='previous', the params' flat positions. ``whole``: one planner bucket
    whose grads are the release bucket's, in ``ready`` order (no getter needed). ``options``:
    the group's plan options it was made with (``_plan_options``: a change re-plans)."""
    __slots__ = ("parts", "device", "clip_ids", "whole", "options")

    def __init__(self, parts: list, device, clip_ids, whole: bool = False, options=()):
        self.parts, self.device, self.clip_ids, self.whole = parts, device, clip_ids, whole
        self.options = options

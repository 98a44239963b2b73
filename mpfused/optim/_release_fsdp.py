"""Gradient release under FSDP2 (``step_in_backward(opt, fsdp=model)``): each FSDP param group
steps as soon as its reduce-scatter has written its sharded grads.

FSDP2's sharded params (DTensors) are not autograd leaves of the forward (it computes with
unsharded copies), so autograd never fires their post-accumulate-grad hooks; FSDP2 fires them
itself, in ``foreach_reduce`` right after the reduce-scatter (and, for HSDP, the all-reduce) has
written or accumulated each sharded grad (torch >= 2.5: pytorch/pytorch#129450). The hooks of one
``foreach_reduce`` fire one after the other, one per param of the FSDP param group that had a grad.

A release bucket is one FSDP param group (its params that this optimizer holds and that require
grad), taken from FSDP2's own group membership, the same on every rank, never from local shard
sizes (a rank's shard may be empty). When the last of them has fired, the bucket is checked and
updated on the local shards with the optimizer's own fused kernels (release's ``_update``); a
bucket some of whose params got no grad in this backward is released at the end of the backward
with what it has (FSDP2 reduce-scatters the same params on every rank, so every rank releases
the same buckets, in the same order). Then its grads are set to None: FSDP2's reduce-scatter
output is one flat buffer per group, viewed by its sharded grads, so grad memory is freed per
FSDP group.

Non-finite grads: a shard may hold a NaN the other ranks' shards do not. The bucket's local check
flag is MAX-all-reduced over every dim of its params' mesh (``async_op``; on NCCL ``wait()`` only
orders the stream, no host sync) before the update, whose kernels take the device flag: every
rank skips the same buckets, so step counters and state stay identical across ranks, and the
backward's flag handed to ``GradScaler.step`` is the same everywhere (the scale backs off
everywhere).

``clip="previous"``: the same check pass gives each local shard's sum of squares (of the
unscaled grad); that small vector (one float32 per param of the bucket) is SUM-all-reduced,
right after the flag's MAX reduction and as asynchronously, over the mesh dims whose placement is
not Replicate (FSDP2's shard dim; under HSDP not the replicate dim, whose ranks hold copies of
the same shard): the sums of squares of the full, unsharded grads, as ``clip_grad_norm_`` and the
ordinary step's ``max_grad_norm`` compute them. Params of one FSDP group may shard different mesh
dims (FSDP + TP: a norm weight Replicate on the TP dim, a matmul weight Shard on it): the vector
is then split by its params' groups (``shard_groups``, the same on every rank) and each part
SUM-reduced over its own, all started before any completes, in the same order on every rank. A
Partial placement is refused (its local values are addends: their squares do not sum to the
norm). ``_release_clip.PreviousNormClip.norm_sq_for``
then gives the bucket's norm estimate, one for the FSDP group across the optimizer's param
groups, from these global sums (a skipped bucket counts zero), so every rank clips every bucket
with the same norm and carries the same per-param sums into the next step and into
``release.state_dict()`` (the same on every rank: DCP saves it once). The sums differ from a
single process's only in the order of summation (shard by shard).

Not yet run on a GPU (tested on gloo ranks on CPU).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from mpfused.distributed import (_PARTIAL, found_inf_groups, local, shard_groups,
                                 start_all_reduce_)
from mpfused.ops import amp as amp_ops
from mpfused.optim._release_clip import check_sums_of_squares


class _FSDPBucket:
    """One FSDP param group's params held by the optimizer: ``members`` its (group index, index)
    keys, sorted; ``groups`` the process groups its flag is MAX-reduced over; ``sum_groups``
    (clip='previous') {key: the groups its param's sum of squares is SUM-reduced over};
    ``clip_ids`` the flat param positions and ``splits`` the split by ``sum_groups`` of each
    ready set (cached)."""
    __slots__ = ("members", "ready", "groups", "sum_groups", "clip_ids", "splits")

    def __init__(self, members: tuple, groups: tuple, sum_groups: dict | None = None):
        self.members, self.groups, self.sum_groups = members, groups, sum_groups or {}
        self.ready: set = set()
        self.clip_ids: dict = {}
        self.splits: dict = {}


def fsdp_param_groups(model) -> list:
    """FSDP2's param groups under ``model`` (fully_shard modules), in module order (the same on
    every rank). torch >= 2.13 keeps a list per state (``_fsdp_param_groups``), older ones one
    group (``_fsdp_param_group``)."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        out.extend(groups)
    return out


class FSDPRelease:
    """The FSDP2 part of ``GradRelease`` (which provides ``optimizer``, ``_accumulating``,
    ``_backward_open``, ``_handles``, ``_start_backward``, ``_entry``, ``_flags_on``, ``skipped``
    and ``_update``)."""

    _fsdp_buckets: list = ()  # (set per instance by _watch_fsdp)

    def _watch_fsdp(self, model) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise TypeError("fsdp must be the fully_shard (FSDP2) root module, got "
                            f"{type(model).__name__}")
        if torch.torch_version.TorchVersion(torch.__version__) < (2, 5):
            raise NotImplementedError(  # older FSDP2 never fires the hooks: nothing would step
                "step_in_backward(fsdp=...) needs torch >= 2.5 (FSDP2 calls the sharded params' "
                f"post-accumulate-grad hooks from 2.5 on), got {torch.__version__}")
        self._fsdp_buckets, self._fsdp_bucket_of, hooked = self._fsdp_plan(model)
        self._handles.extend(p.register_post_accumulate_grad_hook(self._on_fsdp_grad)
                             for p in hooked)

    def _fsdp_plan(self, model) -> tuple:
        """(buckets, {id(param): (bucket, key)}, the params to hook) of the optimizer's current
        groups under ``model``; raises before anything changes."""
        opt = self.optimizer
        where = {id(p): (gi, i) for gi, g in enumerate(opt.param_groups)
                 for i, p in enumerate(g["params"])}
        buckets, bucket_of, hooked = [], {}, []
        for fsdp_group in fsdp_param_groups(model):
            members = [(where[id(fp.sharded_param)], fp.sharded_param)
                       for fp in fsdp_group.fsdp_params
                       if id(fp.sharded_param) in where and fp.sharded_param.requires_grad]
            if not members:
                continue
            bucket = _FSDPBucket(tuple(sorted(k for k, _ in members)),
                                 tuple(found_inf_groups([p for _, p in members])),
                                 self._norm_groups(members) if self._clip is not None else None)
            buckets.append(bucket)
            for key, p in members:
                bucket_of[id(p)] = (bucket, key)
                hooked.append(p)
        missing = [f"param_groups[{gi}]['params'][{i}]" for gi, g in enumerate(opt.param_groups)
                   for i, p in enumerate(g["params"])
                   if p.requires_grad and id(p) not in bucket_of]
        if missing:
            raise ValueError(
                "step_in_backward(fsdp=...): every param of the optimizer that requires grad must "
                "be a sharded param of a fully_shard module under `fsdp` (FSDP2 fires its hooks "
                f"after the reduce-scatter); not: {', '.join(missing[:4])}"
                + (" ..." if len(missing) > 4 else ""))
        return buckets, bucket_of, hooked

    @staticmethod
    def _norm_groups(members) -> dict:
        """{key: the groups its param's sum of squares is SUM-reduced over}: the param's mesh dims
        that are not Replicate (they may differ within an FSDP group, e.g. under FSDP + TP)."""
        out = {}
        for (gi, i), p in members:
            groups = shard_groups(p)
            if _PARTIAL in groups:
                raise NotImplementedError(
                    f"step_in_backward(fsdp=..., clip='previous'): param_groups[{gi}]['params']"
                    f"[{i}] has a Partial placement; clip='previous' needs Shard or Replicate "
                    "placements (a Partial shard's values are addends of the param, their squares "
                    "do not sum to its norm): redistribute it first")
            out[(gi, i)] = groups
        return out

    def _fsdp_add_group(self) -> None:
        """A group added after attaching: the buckets are remade from FSDP2's groups (built
        first: if that raises, the old buckets and hooks stay)."""
        buckets, bucket_of, hooked = self._fsdp_plan(self._fsdp)
        new = [p.register_post_accumulate_grad_hook(self._on_fsdp_grad) for p in hooked]
        for h in self._handles:
            h.remove()
        self._handles = new
        self._fsdp_buckets, self._fsdp_bucket_of = buckets, bucket_of

    def _on_fsdp_grad(self, p: torch.Tensor) -> None:
        """Called by FSDP2 once p's sharded grad is reduced (and accumulated)."""
        if self._accumulating:
            return
        if not self._backward_open():
            self._start_backward(local(p).device)
        bucket, key = self._fsdp_bucket_of[id(p)]
        bucket.ready.add(key)
        if len(bucket.ready) == len(bucket.members):
            self._release_fsdp(bucket)

    def _release_fsdp(self, bucket: _FSDPBucket) -> None:
        """Check the bucket's local grads, MAX-reduce the flag over the mesh (whatever the local
        shards hold: every rank makes the same collectives), record it, update each optimizer
        group's part with it, free the grads."""
        ready, bucket.ready = sorted(bucket.ready), set()
        groups = self.optimizer.param_groups
        params = [groups[gi]["params"][i] for gi, i in ready]
        with torch.no_grad():
            parts: dict[int, list] = defaultdict(list)  # group index -> [(index, local grad)]
            for (gi, i), p in zip(ready, params):
                if p.grad is not None:
                    parts[gi].append((i, local(p.grad)))
            scale, inv, found, total = self._flags_on(local(params[0]).device)
            found.zero_()
            grads = [g for items in parts.values() for _, g in items]
            sq = self._check_fsdp(grads, found, inv)
            finish = start_all_reduce_(found, bucket.groups, "max")
            if sq is not None:  # clip='previous': the global per-param sums of squares
                keys = tuple((gi, i) for gi, items in parts.items() for i, _ in items)
                finish = _then(finish, _start_sum_split(sq, _fsdp_split(bucket, keys, sq.device)))
            updates = [(gi, tuple(i for i, _ in items), [g for _, g in items])
                       for gi, items in parts.items()]
            for gi, idx, gs in updates:  # plan (cached) while the reductions are in flight
                self._entry(gi, idx, gs)
            finish()
            torch.maximum(total, found, out=total)
            self.skipped.add_((found > 0).to(self.skipped.device))
            norm_sq = None
            if sq is not None:  # one norm for the FSDP group, the same on every rank
                norm_sq = self._clip.norm_sq_for(self._fsdp_clip_ids(bucket, updates, found),
                                                 sq, found)
            for gi, idx, gs in updates:
                self._update(gi, idx, gs, checked=True, norm_sq=norm_sq)
        for p in params:
            p.grad = None

    def _check_fsdp(self, grads: list, found: torch.Tensor, inv: torch.Tensor):
        """The bucket's check of its local grads into ``found``; with clip='previous' also each
        local grad's sum of squares (of grad * inv), returned (one per grad, zero for an empty
        shard: every rank's vector has the same length)."""
        backend = self.optimizer._backend
        if self._clip is not None:
            return check_sums_of_squares(grads, found, inv, backend)
        if any(g.numel() for g in grads):  # (empty shards check as nothing)
            amp_ops.check_grads(grads, found, inv, backend=backend)
        return None

    def _fsdp_clip_ids(self, bucket: _FSDPBucket, updates: list, found: torch.Tensor):
        """The flat positions of the updated params, in the order of their sums (cached)."""
        key = tuple((gi, idx) for gi, idx, _ in updates)
        ids = bucket.clip_ids.get(key)
        if ids is None:
            ids = bucket.clip_ids[key] = torch.tensor(
                [self._group_base[gi] + i for gi, idx in key for i in idx], dtype=torch.long,
                device=found.device)
        return ids


def split_positions(groups_of: list) -> list:
    """``[(groups, positions)]``: the positions of ``groups_of`` (one tuple of process groups per
    item) grouped by their value, in first-seen order (the same on every rank when the items
    are)."""
    out: dict[tuple, list] = {}
    for k, groups in enumerate(groups_of):
        out.setdefault(groups, []).append(k)
    return list(out.items())


def _fsdp_split(bucket: _FSDPBucket, keys: tuple, device) -> list:
    """The bucket's per-param sums (of the params ``keys``, in that order) split by their
    groups: ``[(groups, positions tensor or None when all share them)]`` (cached)."""
    split = bucket.splits.get(keys)
    if split is None:
        parts = split_positions([bucket.sum_groups[k] for k in keys])
        split = bucket.splits[keys] = (
            [(parts[0][0], None)] if len(parts) == 1 else
            [(g, torch.tensor(pos, dtype=torch.long, device=device)) for g, pos in parts if g])
    return split


def _start_sum_split(sq: torch.Tensor, split: list):
    """Start the SUM-all-reduce of each part of ``sq`` over its groups (``split``: _fsdp_split's;
    every part started before any completes); returns the function that completes them all,
    leaving the sums in ``sq``."""
    if len(split) == 1 and split[0][1] is None:
        return start_all_reduce_(sq, split[0][0], "sum")
    started = []
    for groups, pos in split:
        part = sq.index_select(0, pos)
        started.append((pos, part, start_all_reduce_(part, groups, "sum")))

    def finish():
        for pos, part, wait in started:
            wait()
            sq.index_copy_(0, pos, part)
    return finish


def _then(first, second):
    def both():
        first()
        second()
    return both

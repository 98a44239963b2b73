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
everywhere). ``clip="previous"`` is refused under FSDP2 (its per-bucket norm would have to be
SUM-reduced over the shard dims): see release.py.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from mpfused.distributed import all_reduce_, found_inf_groups, local
from mpfused.ops import amp as amp_ops


class _FSDPBucket:
    """One FSDP param group's params held by the optimizer: ``members`` its (group index, index)
    keys, sorted; ``groups`` the process groups its flag is MAX-reduced over."""
    __slots__ = ("members", "ready", "groups")

    def __init__(self, members: tuple, groups: tuple):
        self.members, self.groups = members, groups
        self.ready: set = set()


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
    ``_in_backward``, ``_handles``, ``_start_backward``, ``_entry``, ``_flags_on``, ``skipped``
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
        opt = self.optimizer
        where = {id(p): (gi, i) for gi, g in enumerate(opt.param_groups)
                 for i, p in enumerate(g["params"])}
        self._fsdp_buckets, self._fsdp_bucket_of, hooked = [], {}, []
        for fsdp_group in fsdp_param_groups(model):
            members = [(where[id(fp.sharded_param)], fp.sharded_param)
                       for fp in fsdp_group.fsdp_params
                       if id(fp.sharded_param) in where and fp.sharded_param.requires_grad]
            if not members:
                continue
            bucket = _FSDPBucket(tuple(sorted(k for k, _ in members)),
                                 tuple(found_inf_groups([p for _, p in members])))
            self._fsdp_buckets.append(bucket)
            for key, p in members:
                self._fsdp_bucket_of[id(p)] = (bucket, key)
                hooked.append(p)
        missing = [f"param_groups[{gi}]['params'][{i}]" for gi, g in enumerate(opt.param_groups)
                   for i, p in enumerate(g["params"])
                   if p.requires_grad and id(p) not in self._fsdp_bucket_of]
        if missing:
            raise ValueError(
                "step_in_backward(fsdp=...): every param of the optimizer that requires grad must "
                "be a sharded param of a fully_shard module under `fsdp` (FSDP2 fires its hooks "
                f"after the reduce-scatter); not: {', '.join(missing[:4])}"
                + (" ..." if len(missing) > 4 else ""))
        self._handles.extend(p.register_post_accumulate_grad_hook(self._on_fsdp_grad)
                             for p in hooked)

    def _fsdp_add_group(self) -> None:
        """A group added after attaching: the buckets are remade from FSDP2's groups."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._watch_fsdp(self._fsdp)

    def _on_fsdp_grad(self, p: torch.Tensor) -> None:
        """Called by FSDP2 once p's sharded grad is reduced (and accumulated)."""
        if self._accumulating:
            return
        if not self._in_backward:
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
            grads = [g for items in parts.values() for _, g in items if g.numel()]
            if grads:
                amp_ops.check_grads(grads, found, inv, backend=self.optimizer._backend)
            finish = _start_max_reduce(found, bucket.groups)
            updates = [(gi, tuple(i for i, _ in items), [g for _, g in items])
                       for gi, items in parts.items()]
            for gi, idx, gs in updates:  # plan (cached) while the flag is in flight
                self._entry(gi, idx, gs)
            finish()
            torch.maximum(total, found, out=total)
            self.skipped.add_((found > 0).to(self.skipped.device))
            for gi, idx, gs in updates:
                self._update(gi, idx, gs, checked=True)
        for p in params:
            p.grad = None


def _start_max_reduce(flag: torch.Tensor, groups: tuple):
    """Start the in-place MAX all-reduce of ``flag`` over ``groups`` (one after another: over
    their product); returns the function that completes it. One group (FSDP): asynchronous, so
    the caller's host work overlaps it; ``wait()`` on NCCL orders the current stream only."""
    if not groups:
        return lambda: None
    import torch.distributed as dist

    if any(dist.get_backend(g) == "nccl" for g in groups) and flag.device.type != "cuda":
        return lambda: all_reduce_(flag, groups, "max")  # CPU-offloaded grads on NCCL: a copy
    for g in groups[:-1]:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g, async_op=True).wait()
    return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups[-1], async_op=True).wait

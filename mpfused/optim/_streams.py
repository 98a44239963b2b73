"""The stochastic-rounding keys the optimizers pass to the step ops (``param_ids``,
``elem_offsets``; see mpfused/ops/adam.py).

A param's random stream must not depend on how the params are grouped or bucketed, nor on which
params have grads this step: keyed by the tensor's position in a kernel call, the k-th tensor of
every group drew the same bits, so identical params in two groups rounded identically. The key is
the param's index in the optimizer's flat param order (param_groups in order, params in order):
the id torch's ``state_dict`` gives it, so it survives re-planning and a checkpoint round trip.

DTensor params (FSDP2): each shard passes the global row-major index of its first element, so
with dim-0 sharding (FSDP2's default) or replication every element draws the bits of its index
in the whole param, whatever the world size, and replicas (HSDP) round alike. Limitation: shards of
another layout (a non-zero shard dim, strided shards) are not one contiguous range of the whole
param; their streams start at the first element's global index too, so they depend on the layout
and two shards may give the same draws to different elements of the param (never to the same
element on two ranks, and never across params).
"""
from __future__ import annotations


def flat_param_ids(optimizer, group, indices) -> list[int]:
    """The flat ids of ``group["params"][i]`` for i in ``indices``."""
    base = 0
    for g in optimizer.param_groups:
        if g is group:
            return [base + i for i in indices]
        base += len(g["params"])
    raise ValueError("mpfused: the param group is not one of the optimizer's param_groups")


def elem_offsets(params) -> list[int]:
    """Per param: the global row-major index of its local shard's first element (0 for a plain
    tensor)."""
    return [_first_global_index(p) if hasattr(p, "to_local") else 0 for p in params]


def _first_global_index(p) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if 0 in tuple(shape):
        return 0  # an empty shard draws nothing
    index, stride = 0, 1
    for d in reversed(range(len(p.shape))):
        index += int(offset[d]) * stride
        stride *= int(p.shape[d])
    return index

"""Cached grouping of a param group's tensors into kernel buckets.

Re-grouping every step costs more host time than the GPU work for many small tensors, so the
lists handed to the multi-tensor kernels are built once and reused until the group's parameters,
the set of params that have grads, or their state change."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """Params of one (device, dtype) within a group, and their state tensors, in kernel order."""
    indices: list[int]                    # positions in group["params"]
    params: list[torch.Tensor]
    state: dict[str, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class GroupPlan:
    key: tuple                            # identity of what the plan was built from
    buckets: list[Bucket]


def plan_key(params, grads, extra=()) -> tuple:
    return (tuple(map(id, params)), tuple(g is not None for g in grads)) + tuple(extra)


def build_buckets(params, grads) -> list[Bucket]:
    by_kind: dict[tuple, Bucket] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        key = (local.device, local.dtype)
        b = by_kind.setdefault(key, Bucket(indices=[], params=[]))
        b.indices.append(i)
        b.params.append(p)
    return list(by_kind.values())

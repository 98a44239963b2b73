"""mpfused inside PyTorch's distributed engines: DDP, FSDP2 (``fully_shard``) and
``torch.distributed.checkpoint`` (DCP).

What happens where
------------------
* **DDP.** Params and grads are ordinary tensors, identical on every rank after the backward's
  all-reduce; mpfused needs no collective of its own (found_inf and the clipping norm are the same
  on every rank). A ``GradScaler(process_group=...)`` additionally all-reduces found_inf with MAX
  (for grads changed after the backward, or for FSDP1-style flat shards).
* **FSDP2.** Params, grads and optimizer state are DTensors. Every kernel runs on the local shards
  (``DTensor.to_local()``); state tensors are created with ``zeros_like(p)`` / ``p.float()`` and so
  are DTensors with the param's mesh and placements (DCP saves and re-shards them).

  - found_inf is all-reduced with **MAX** over every dim of the grads' device meshes (1-D or
    N-D; MAX is idempotent, so a Replicate dim costs one tiny collective and guarantees that
    every rank of the mesh skips together and keeps the same loss scale). Never SUM (hazard H1).
  - The fused clipping norm (``max_grad_norm=``, from the scaler's check pass or the optimizer's
    own pass) and ``mpfused.clip_grad_norm_`` compute the sum of squares of the local shards and
    **SUM**-all-reduce it over the mesh dims whose placement is not ``Replicate`` (the ranks that
    hold different elements), so clipping uses the global norm. Grads are split by those groups
    (e.g. TP + FSDP params with different placements), one reduce per distinct set of groups.
    Plain-tensor grads count as replicated (DDP).
  - ``AdamW8bit``: the small-tensor rule (``min_8bit_size``) is judged on the full logical shape
    (``p.numel()`` of the DTensor), so sharding never changes which params get 8-bit state. The
    block layout is **per local shard**: each rank cuts its own shard (row-major) into
    ``block_size`` blocks, one absmax each. FSDP2 shards dim 0, so when every local shard's numel is
    a multiple of ``block_size`` the blocks coincide with those of the unsharded param and the
    update is the single-process one bit for bit; otherwise the last block of a shard is short.
* **Checkpoints.** Use ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
  ``set_state_dict`` with ``dcp.save`` / ``dcp.load``: fp32 moments and masters (int16 remainders,
  int8 corrections: per-element, sharded as the param) are saved as DTensors (re-shardable, e.g. 2 ranks -> 1), ``step`` as a float32 0-d tensor, and mpfused's load
  hooks keep every floating state fp32 after the load (torch would cast it to the param dtype).
  ``AdamW8bit``: its live codes/absmax are per local shard, but ``state_dict()`` hands them in
  the unsharded layout (codes: uint8 DTensors with the param's placements; absmax: float32
  DTensors of ceil(numel / block_size) entries, the whole param's blocks), i.e. the keys, dtypes
  and global shapes of a single-process ``AdamW8bit``, so DCP re-shards them (2 ranks -> 2 or
  1). When every shard's blocks are blocks of the whole param (FSDP2: each local numel a
  multiple of ``block_size`` and the blocks split evenly) save and load are exact views with no
  collective; otherwise the state is re-blocked at save (a small MAX-all-reduce per param) and
  re-quantized at load (nearest codes, not bit-exact), and those calls are collectives.
  ``AdamW4bit``: the same with packed codes (mpfused/distributed_4bit.py: a flat uint8 DTensor
  of ceil(numel / 2) bytes; byte chunks that differ from a rank's elements are moved between
  ranks, and blocks that coincide with the whole param's stay bit-exact when re-blocking).

Collectives are issued in param order, identically on every rank (SPMD): all ranks must call
``step`` together, as with any collective.
"""
from __future__ import annotations

import torch

from mpfused.device_copy import copy_to

__all__ = ["is_dtensor", "local", "shard_groups", "mesh_groups", "split_by_shard_groups",
           "found_inf_groups", "all_reduce_", "start_all_reduce_"]


_PARTIAL = "partial"


def is_dtensor(t) -> bool:
    return t is not None and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t):
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def _groups(mesh, dims) -> tuple:
    out = []
    for d in dims:
        g = mesh.get_group(d)
        if g.size() > 1:  # a 1-rank group needs no collective
            out.append(g)
    return tuple(out)


def shard_groups(t) -> tuple:
    """Process groups over which the local shards of ``t`` hold different elements (one per mesh
    dim whose placement is not Replicate); ``()`` for a plain tensor. A norm's sum of squares over
    the local shards is SUM-reduced over these."""
    if not is_dtensor(t):
        return ()
    groups = _groups(t.device_mesh, [d for d, pl in enumerate(t.placements)
                                      if not pl.is_replicate()])
    # Local values of a Partial placement are addends, not elements: their squares do not add up
    # to the norm. Marked here, refused by reduce_norm_parts (found_inf is still fine).
    return groups + (_PARTIAL,) if any(pl.is_partial() for pl in t.placements) else groups


def mesh_groups(t) -> tuple:
    """Every dim's group of ``t``'s mesh (found_inf is MAX-reduced over the whole mesh)."""
    if not is_dtensor(t):
        return ()
    return _groups(t.device_mesh, range(t.device_mesh.ndim))


def _unique(groups):
    seen, out = set(), []
    for g in groups:
        if g not in seen:
            seen.add(g)
            out.append(g)
    return out


def found_inf_groups(tensors) -> list:
    """The groups to MAX-reduce found_inf over: every mesh dim of every DTensor in ``tensors``, in
    first-seen order (the same on every rank)."""
    meshes = _unique(t.device_mesh for t in tensors if is_dtensor(t))
    return _unique(g for m in meshes for g in _groups(m, range(m.ndim)))


def split_by_shard_groups(tensors) -> dict:
    """``{shard groups: [local tensors]}`` in first-seen order; plain tensors under ``()``."""
    out: dict[tuple, list] = {}
    for t in tensors:
        out.setdefault(shard_groups(t), []).append(local(t))
    return out


def _device_type_of(group) -> str | None:
    import torch.distributed as dist

    try:
        return "cuda" if dist.get_backend(group) == "nccl" else None
    except Exception:  # noqa: BLE001  (not a c10d group we can ask)
        return None


def all_reduce_(t: torch.Tensor, groups, op: str, device_type: str | None = None) -> torch.Tensor:
    """In-place all-reduce of a small tensor over each group in turn (``op`` "sum" or "max"); a
    reduction over the groups of several mesh dims one after another is one over their product.
    The tensor is moved to ``device_type`` for the collective when needed (e.g. found_inf of
    CPU-offloaded grads on an NCCL group) and copied back."""
    start_all_reduce_(t, groups, op, device_type)()
    return t


def start_all_reduce_(t: torch.Tensor, groups, op: str, device_type: str | None = None):
    """``all_reduce_`` started: returns the function that completes it (``t`` holds the result
    once that has run), so that host work overlaps the last group's collective (``async_op``;
    on NCCL ``wait()`` orders the current stream only). The groups before the last, and a
    reduction that moves ``t`` to another device, complete here."""
    if not groups:
        return _done
    import torch.distributed as dist

    red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    want = device_type or _device_type_of(groups[0])
    if want is not None and t.device.type != want:
        work = t.to(want)
        for g in groups:
            dist.all_reduce(work, op=red, group=g)
        t.copy_(work)
        return _done
    for g in groups[:-1]:
        dist.all_reduce(t, op=red, group=g, async_op=True).wait()
    return dist.all_reduce(t, op=red, group=groups[-1], async_op=True).wait


def _done() -> None:
    return None


def reduce_norm_parts(parts: dict, out: torch.Tensor) -> torch.Tensor:
    """Add the per-shard-groups sums of squares in ``parts`` ({groups: 0-d tensor}) into ``out``,
    each SUM-all-reduced over its groups first."""
    for groups, part in parts.items():
        if _PARTIAL in groups:
            raise NotImplementedError(
                "mpfused: the grad norm of a DTensor grad with a Partial placement is not "
                "supported; redistribute the grads to Shard/Replicate first")
        out += copy_to(all_reduce_(part, groups, "sum"), out.device)
    return out

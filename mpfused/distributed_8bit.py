"""FSDP2 / DCP: 8-bit optimizer state of DTensor params in the unsharded (global) block layout:
whether a shard's blocks are the whole param's, and the collectives that re-block codes and
absmax when they are not (used by the 8-bit checkpoint format, mpfused/optim/_checkpoint.py)."""
from __future__ import annotations

import torch

from mpfused.distributed import all_reduce_, is_dtensor, mesh_groups
from mpfused.distributed import local as _local
from mpfused.quant_maps import (dequantize_blockwise, encode, inv_scale, num_blocks,
                                quantize_blockwise, zero_code)


# ---- FSDP2 / DCP: the global block layout ----------------------------------------------------
# The live 8-bit state of a DTensor param is per local shard: plain uint8 codes of the local
# shape, one absmax per block of the local shard (row-major). In state_dict() it takes the
# layout of the unsharded param instead, so that a checkpoint has the same keys, dtypes and
# global shapes on any number of ranks, 1 (the non-distributed format) included:
#   codes  -> uint8 DTensor with the param's mesh, placements, shape and stride;
#   absmax -> float32 DTensor of ceil(numel / block_size) entries, the blocks of the whole param
#             (its row-major order), Shard(0) on the mesh dims that shard the param.
# Aligned case (_aligned: every rank's local blocks are blocks of the whole param, and the ones
# its absmax chunk holds): both are views of the live tensors, exact, no collective. FSDP2
# (dim-0 shards) with every shard's numel a multiple of block_size and evenly split blocks is.
# Otherwise state_dict() re-blocks: each rank dequantizes its shard, the absmax of every global
# block is MAX-all-reduced over the mesh and each rank re-encodes its elements with it (the
# codes of bitsandbytes' encoder applied to the unsharded dequantized state); a load into a
# layout that is not aligned dequantizes with the global absmax and re-quantizes per local
# shard. Both round to the nearest codes of the new blocks (not bit-exact); every rank decides
# alike from global facts, so the collectives match.
def _local_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """[lo, hi) of chunk i of n items cut in `parts` (torch.chunk / DTensor Shard semantics)."""
    size = -(-n // parts)
    lo = min(i * size, n)
    return lo, min(lo + size, n)


def _plain_shard(pl) -> bool:
    from torch.distributed.tensor import Shard

    return type(pl) is Shard  # noqa: E721  (not _StridedShard or other subclasses)


def _absmax_placements(p) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Replicate() if pl.is_replicate() else Shard(0) for pl in p.placements)


def _aligned(p, block: int) -> bool:
    """Whether, on every rank, the local shard's blocks are blocks of the whole param and are
    exactly the absmax entries that rank holds under ``_absmax_placements`` (decided from the
    param's global shape, mesh and placements only: the same answer on every rank)."""
    dims = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if not dims:
        return True  # replicated: local = global
    if len(dims) != 1 or not _plain_shard(p.placements[dims[0]]) or p.placements[dims[0]].dim:
        return False
    parts, rows, numel = p.device_mesh.size(dims[0]), p.shape[0], p.numel()
    inner = numel // rows if rows else 0
    nb = num_blocks(numel, block)
    for i in range(parts):
        r0, r1 = _local_range(rows, parts, i)
        e0, e1 = r0 * inner, r1 * inner
        lo, hi = _local_range(nb, parts, i)
        if e1 == e0:
            if hi != lo:
                return False
            continue
        if e0 % block or (e1 != numel and e1 % block) or \
                (e0 // block, num_blocks(e1, block)) != (lo, hi):
            return False
    return True


def _dim_indices(p, d: int, device) -> torch.Tensor:
    """Global indices along dim d of the local shard's entries, as DTensor places them: any
    Shard-like placement of dim d (Shard, FSDP2 + TP's _StridedShard) taken to a 1-D arange
    (each rank cuts its own copy: no collective); other dims' placements count as replicated.
    The local shard is the product of these per-dim index sets."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    pls = []
    for pl in p.placements:
        strided = isinstance(pl, _StridedShard)  # not a Shard to is_shard()
        if pl.is_replicate() or ((strided or pl.is_shard()) and pl.dim % p.ndim != d):
            pls.append(Replicate())
        elif strided:
            pls.append(_StridedShard(0, split_factor=pl.split_factor))
        elif pl.is_shard():
            pls.append(Shard(0))
        else:
            raise NotImplementedError(
                f"mpfused: the 8-bit / 4-bit state of a DTensor param with placements "
                f"{tuple(p.placements)} cannot be checkpointed: Shard, _StridedShard and "
                "Replicate placements are supported")
    arange = torch.arange(p.shape[d], device=device)
    return distribute_tensor(arange, p.device_mesh, pls, src_data_rank=None).to_local()


def _global_block_index(p, block: int) -> torch.Tensor:
    """int64 tensor of the local shard's shape: the index of each local element's block in the
    unsharded param's (row-major) block layout."""
    local = _local(p)
    index = [_dim_indices(p, d, local.device) for d in range(p.ndim)]
    shape = tuple(len(i) for i in index)
    if shape != tuple(local.shape):
        raise RuntimeError(f"mpfused: local shard shape {tuple(local.shape)} differs "
                           f"from its DTensor layout {shape}")
    idx = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = shape[d]
        idx = idx + (index[d] * stride).view(view)
        stride *= p.shape[d]
    return (idx.expand(shape) // block).contiguous()


def _encode_scaled(values: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """quantize_blockwise's encoding with a given absmax per element (uint8, values' shape)."""
    flat = values.reshape(-1).float()
    codes = encode(flat * inv_scale(absmax.reshape(-1)), qmap)
    zero = zero_code(qmap)
    if zero > 0:  # bitsandbytes' sign rule, as quantize_blockwise
        codes = torch.where(torch.signbit(flat) & (codes == zero), codes - 1, codes)
    return codes.to(torch.uint8).reshape(values.shape)


def _like_param(t: torch.Tensor, p):
    """A local per-element tensor as p: a DTensor with p's layout when p is one."""
    if not is_dtensor(p):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _to_global(p, codes, absmax, qmap, block):
    """Local codes/absmax of DTensor param p -> (codes, absmax) DTensors of the global layout."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh, nb = p.device_mesh, num_blocks(p.numel(), block)
    placements = _absmax_placements(p)
    if _aligned(p, block):
        gabs = DTensor.from_local(absmax, mesh, placements, run_check=False, shape=(nb,),
                                  stride=(1,))
        return _like_param(codes, p), gabs
    idx = _global_block_index(p, block)  # collective below: every rank gets here together
    values = dequantize_blockwise(codes, absmax, qmap, block)
    full = torch.zeros(nb, dtype=torch.float32, device=values.device)
    full.scatter_reduce_(0, idx.reshape(-1), values.abs().reshape(-1), "amax")
    all_reduce_(full, mesh_groups(p), "max")
    codes = _encode_scaled(values, full[idx], qmap)
    gabs = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False,
                              shape=(nb,), stride=(1,)).redistribute(mesh, placements)
    return _like_param(codes, p), gabs


def _from_global(p, codes, absmax, qmap, block):
    """Loaded (codes, absmax) of param p -> local codes and absmax of the local blocks. Plain
    ones are taken as they are (the local layout: a per-rank or non-distributed state_dict)."""
    if not is_dtensor(p):  # DTensor state for a plain param: gather it
        return (codes.full_tensor() if is_dtensor(codes) else codes,
                absmax.full_tensor() if is_dtensor(absmax) else absmax)
    if is_dtensor(codes) and (codes.device_mesh != p.device_mesh
                              or tuple(codes.placements) != tuple(p.placements)):
        codes = codes.redistribute(p.device_mesh, p.placements)
    local_codes = _local(codes)
    if not is_dtensor(absmax):
        return local_codes, absmax
    if (_aligned(p, block) and absmax.device_mesh == p.device_mesh
            and tuple(absmax.placements) == _absmax_placements(p)):
        return local_codes, absmax.to_local()
    full = absmax.full_tensor()  # collective: every rank takes this branch together
    idx = _global_block_index(p, block)
    values = qmap.to(local_codes.device)[local_codes.long()] * full.to(local_codes.device)[idx]
    return quantize_blockwise(values, qmap.to(local_codes.device), block)

"""FSDP2 / DCP: 4-bit optimizer state of DTensor params in the global layout. The 8-bit rules
(mpfused/distributed_8bit.py) with packed codes.

Live state (as 8-bit): per local shard, the shard cut into blocks from its own first element,
its codes packed two per byte from its own first element (ceil(local numel / 2) bytes, an odd
shard's last low nibble 0), one float32 absmax per local block. torchao's FSDP2 layout is the
same (its ``OptimState4bit`` of each local shard).

Global layout (``state_dict()``; what DCP saves, so a checkpoint has the keys, dtypes and global
shapes of a single-process ``AdamW4bit`` on any number of ranks):
  codes  -> uint8 DTensor of ceil(numel / 2) bytes: the whole param's codes in row-major order,
            two per byte (element 2k in the high nibble of byte k), ``Shard(0)`` on the mesh dims
            that shard the param (each rank holds the torch.chunk of the *bytes*);
  absmax -> float32 DTensor of ceil(numel / block_size) entries, the whole param's blocks,
            ``Shard(0)`` where the param is sharded (as 8-bit).
A byte split across shards: a shard boundary at an odd element offset puts elements 2k (one
rank) and 2k + 1 (the next) into one global byte. Neither rank's live bytes hold it (each packs
from its own first element), so the global bytes are built from the codes per element: byte k
always holds global elements 2k and 2k + 1, whoever owns them, and a byte chunk belongs to the
rank that DTensor's Shard(0) gives it, not to the owner of its elements.

Which path a param takes (decided from global facts only: the same on every rank, so every
rank issues the same collectives):
* ``_bytes_aligned`` (every rank's blocks are whole-param blocks and its live bytes are exactly
  its chunk of the global bytes: FSDP2 with evenly split, block-multiple shards): views of the
  live tensors, exact, no collective.
* ``_aligned`` only (blocks coincide, byte chunks do not, e.g. uneven row splits): absmax as
  views, codes moved between ranks: exact.
* otherwise the 8-bit re-blocking: each rank decodes its shard, every global block's absmax is
  MAX-all-reduced over the mesh and each rank re-encodes its elements with it; a load into a
  layout whose blocks are not the checkpoint's re-quantizes per local shard. The absmax of a
  new block is the largest absmax of the old blocks it overlaps (a bound on its values; 8-bit
  takes the max of the decoded values instead): a new block equal to an old one keeps its codes
  and absmax bit for bit, and a block whose largest moment is negative is not shrunk (the 4-bit
  signed map's most negative entry is -0.8875, so the max of the decoded values would scale it
  by 0.8875 at every re-blocking). Blocks that really change get the nearest codes of the new
  block: not bit-exact, as 8-bit.
Moving codes: with dim-0 shards (one mesh dim, plain Shard(0): FSDP2, HSDP) every rank's elements
and every byte chunk are contiguous runs, so each rank sends its neighbours only the codes of
their byte chunk / element run that it holds (point to point, one byte per element, about a
shard's worth in all); other layouts (Shard(1), several sharded dims) all-gather the param's
codes (one byte per element on every rank, one param at a time).
"""
from __future__ import annotations

import torch

from mpfused.distributed import all_reduce_, is_dtensor, mesh_groups
from mpfused.distributed import local as _local
from mpfused.distributed_8bit import (_absmax_placements, _aligned, _global_block_index,
                                      _like_param, _local_range, _plain_shard)
from mpfused.quant4 import pack4, unpack4
from mpfused.quant_maps import encode, inv_scale, num_blocks


def _bytes_aligned(p, block: int) -> bool:
    """_aligned, and every rank's local bytes are the chunk of the global bytes that Shard(0)
    gives it (decided from global facts: the same answer on every rank)."""
    if not _aligned(p, block):
        return False
    dims = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if not dims:
        return True
    parts, rows, numel = p.device_mesh.size(dims[0]), p.shape[0], p.numel()
    inner = numel // rows if rows else 0
    nbytes = (numel + 1) // 2
    for i in range(parts):
        r0, r1 = _local_range(rows, parts, i)
        if _local_range(nbytes, parts, i) != (r0 * inner // 2, (r1 * inner + 1) // 2):
            return False
    return True


def _reencode(values: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """4-bit codes (int64, one per element) of float32 values with a given absmax per element
    (quantize4_blockwise's encoding: nearest entry of values * (1 / absmax), no sign rule)."""
    return encode(values * inv_scale(scale), qmap)


def _bound_absmax(scale: torch.Tensor, idx: torch.Tensor, blocks: int) -> torch.Tensor:
    """float32[blocks]: per block of ``idx``, the largest per-element old absmax in it."""
    out = torch.zeros(blocks, dtype=torch.float32, device=scale.device)
    return out.scatter_reduce_(0, idx, scale, "amax")


def _dim0_shards(p):
    """(process group, this rank's index in it, every index's element range [e0, e1)) when p is
    sharded over one mesh dim with plain Shard(0) (FSDP2, HSDP): each rank's elements are one
    contiguous run of the row-major param. None for other layouts."""
    dims = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if len(dims) != 1 or not _plain_shard(p.placements[dims[0]]) or p.placements[dims[0]].dim:
        return None
    mesh, parts, rows = p.device_mesh, p.device_mesh.size(dims[0]), p.shape[0]
    inner = p.numel() // rows if rows else 0
    ranges = [tuple(r * inner for r in _local_range(rows, parts, i)) for i in range(parts)]
    return mesh.get_group(dims[0]), mesh.get_local_rank(dims[0]), ranges


def _byte_elements(numel: int, parts: int) -> list:
    """Every index's elements [2 * b0, 2 * b1) of its Shard(0) chunk [b0, b1) of the bytes."""
    nbytes = (numel + 1) // 2
    return [(min(2 * b0, numel), min(2 * b1, numel))
            for b0, b1 in (_local_range(nbytes, parts, i) for i in range(parts))]


def _move(src: torch.Tensor, have: list, want: list, me: int, group) -> torch.Tensor:
    """Index ``me`` of ``group`` holds ``src``, the items have[me] of a 1-D array split over the
    group; returns the items want[me]. Point to point: every pair of ranks exchanges the overlap
    of one's range with the other's (one message each way at most; all ranks call it)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    (h0, h1), (w0, w1) = have[me], want[me]
    out = src.new_empty(w1 - w0)
    reqs, recvs = [], []
    for j, rank in enumerate(ranks):
        lo, hi = max(have[j][0], w0), min(have[j][1], w1)  # j's items that I want
        if lo < hi and j == me:
            out[lo - w0:hi - w0] = src[lo - h0:hi - h0]
        elif lo < hi:
            buf = src.new_empty(hi - lo)
            reqs.append(dist.irecv(buf, src=rank, group=group))
            recvs.append((lo - w0, buf))
        lo, hi = max(h0, want[j][0]), min(h1, want[j][1])  # my items that j wants
        if lo < hi and j != me:
            reqs.append(dist.isend(src[lo - h0:hi - h0].contiguous(), dst=rank, group=group))
    for req in reqs:
        req.wait()
    for at, buf in recvs:
        out[at:at + buf.numel()] = buf
    return out


def _codes_to_bytes(p, elems: torch.Tensor) -> torch.Tensor:
    """This rank's Shard(0) chunk of the packed global bytes, from its local elements' codes
    (uint8, one per element). Dim-0 shards: the elements of its byte chunk moved point to point
    (a split byte's other nibble comes from the neighbour); other layouts: all-gathered."""
    shards = _dim0_shards(p)
    if shards is None:
        return _gather_to_bytes(p, elems)
    group, me, ranges = shards
    return pack4(_move(elems, ranges, _byte_elements(p.numel(), len(ranges)), me, group))


def _gather_to_bytes(p, elems: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    packed = pack4(_like_param(elems.view(_local(p).shape), p).full_tensor())
    shape, offset = compute_local_shape_and_global_offset(
        packed.shape, p.device_mesh, _absmax_placements(p))
    return packed[offset[0]:offset[0] + shape[0]].clone()


def _bytes_to_codes(p, codes) -> torch.Tensor:
    """int64 codes of p's local elements from the loaded global bytes (a DTensor on p's mesh or
    the whole plain tensor): point to point for dim-0 shards, else all-gathered."""
    shards = _dim0_shards(p)
    want = _absmax_placements(p)
    if shards is None or not is_dtensor(codes) or codes.device_mesh != p.device_mesh:
        return _gather_from_bytes(p, codes)
    if tuple(codes.placements) != want:
        codes = codes.redistribute(p.device_mesh, want)
    group, me, ranges = shards
    have = _byte_elements(p.numel(), len(ranges))
    elems = unpack4(codes.to_local(), have[me][1] - have[me][0]).to(torch.uint8)
    return _move(elems, have, ranges, me, group).long()


def _gather_from_bytes(p, codes) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    whole = codes.full_tensor() if is_dtensor(codes) else codes
    whole = unpack4(whole.reshape(-1), p.numel()).to(torch.uint8).view(p.shape)
    mesh = p.device_mesh
    rep = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, p.placements).to_local().reshape(-1).long()


def to_global4(p, codes, absmax, qmap, block):
    """Local packed codes / absmax of DTensor param p -> (codes, absmax) global DTensors. A
    collective unless _bytes_aligned (every rank calls it for the same params)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = p.device_mesh, _absmax_placements(p)
    nbytes, nb = (p.numel() + 1) // 2, num_blocks(p.numel(), block)

    def wrap(t, shape):
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=(1,))

    if _bytes_aligned(p, block):
        return wrap(codes, (nbytes,)), wrap(absmax, (nb,))
    local = _local(p)
    n = local.numel()
    elems = unpack4(codes, n)
    if _aligned(p, block):  # the local blocks are the whole param's: codes and absmax as they are
        gabs = wrap(absmax, (nb,))
    else:  # re-block (the module docstring's rule)
        qmap = qmap.to(local.device)
        scale = absmax.float()[torch.arange(n, device=local.device) // block]
        values = qmap[elems] * scale
        idx = _global_block_index(p, block).reshape(-1)
        full = _bound_absmax(scale, idx, nb)
        all_reduce_(full, mesh_groups(p), "max")
        elems = _reencode(values, full[idx], qmap)
        gabs = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False,
                                  shape=(nb,), stride=(1,)).redistribute(mesh, placements)
    return wrap(_codes_to_bytes(p, elems.to(torch.uint8)), (nbytes,)), gabs


def from_global4(p, codes, absmax, qmap, block):
    """Loaded global (codes, absmax) of param p -> the local ones (packed, per local block). A
    collective unless _bytes_aligned with the saved placements (every rank takes the same path)."""
    if not is_dtensor(p):
        return (codes.full_tensor() if is_dtensor(codes) else codes,
                absmax.full_tensor() if is_dtensor(absmax) else absmax)
    want = _absmax_placements(p)

    def same_layout(t):
        return is_dtensor(t) and t.device_mesh == p.device_mesh and tuple(t.placements) == want

    if _bytes_aligned(p, block) and same_layout(codes) and same_layout(absmax):
        return codes.to_local(), absmax.to_local()
    local = _local(p)
    n = local.numel()
    elems = _bytes_to_codes(p, codes)
    if _aligned(p, block) and same_layout(absmax):
        return pack4(elems), absmax.to_local()
    qmap = qmap.to(local.device)
    full = (absmax.full_tensor() if is_dtensor(absmax) else absmax).float().to(local.device)
    gscale = full[_global_block_index(p, block).reshape(-1)]
    lidx = torch.arange(n, device=local.device) // block
    labs = _bound_absmax(gscale, lidx, num_blocks(n, block))
    return pack4(_reencode(qmap[elems] * gscale, labs[lidx], qmap)), labs

"""FSDP2 / DCP: 4-bit optimizer state of DTensor params in the global layout. The 8-bit rules
(mpfused/distributed_8bit.py) with packed codes: the global codes are a flat uint8 DTensor of
ceil(numel / 2) bytes (the whole param's codes in row-major order, two per byte), ``Shard(0)``
where the param is sharded; absmax as for 8-bit. Only block-aligned shards whose byte ranges are
also torch.chunk's (FSDP2 over dim 0 with evenly split, block-multiple shards) are saved and
loaded, as views (exact, no collective); other layouts raise NotImplementedError (the 8-bit
re-blocking path is not ported to packed codes yet)."""
from __future__ import annotations

from mpfused.distributed import local as _local
from mpfused.distributed_8bit import _absmax_placements, _aligned, _local_range
from mpfused.quant_maps import num_blocks


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


def _unsupported(p):
    return NotImplementedError(
        f"mpfused.AdamW4bit: the 4-bit state of a DTensor param of shape {tuple(p.shape)} with "
        f"placements {tuple(p.placements)} is not block- and byte-aligned on this mesh; only "
        "aligned shards (FSDP2 dim-0 shards of whole blocks) can be checkpointed so far")


def to_global4(p, codes, absmax, block):
    """Local packed codes / absmax of DTensor param p -> (codes, absmax) global DTensors."""
    from torch.distributed.tensor import DTensor

    if not _bytes_aligned(p, block):
        raise _unsupported(p)
    mesh, placements = p.device_mesh, _absmax_placements(p)
    nbytes, nb = (p.numel() + 1) // 2, num_blocks(p.numel(), block)
    gcodes = DTensor.from_local(codes, mesh, placements, run_check=False, shape=(nbytes,),
                                stride=(1,))
    gabs = DTensor.from_local(absmax, mesh, placements, run_check=False, shape=(nb,), stride=(1,))
    return gcodes, gabs


def from_global4(p, codes, absmax, block):
    """Loaded global (codes, absmax) of param p -> the local ones."""
    from mpfused.distributed import is_dtensor

    if not is_dtensor(p):
        return (codes.full_tensor() if is_dtensor(codes) else codes,
                absmax.full_tensor() if is_dtensor(absmax) else absmax)
    if not _bytes_aligned(p, block):
        raise _unsupported(p)
    want = _absmax_placements(p)
    out = []
    for t in (codes, absmax):
        if is_dtensor(t):
            if t.device_mesh != p.device_mesh or tuple(t.placements) != want:
                t = t.redistribute(p.device_mesh, want)
            t = _local(t)
        out.append(t)
    return tuple(out)

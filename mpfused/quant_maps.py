"""The 8-bit dynamic ("tree") quantization maps of bitsandbytes, their decision thresholds, and
the block-wise codec in pure torch (used by the reference, state conversions and tests).

``signed_map()`` (bnb ``"dynamic"``, for exp_avg) and ``unsigned_map()`` (bnb ``"udynamic"``, for
exp_avg_sq) are built exactly as ``bitsandbytes.functional.create_dynamic_map`` with the same
float32 torch ops, so they are byte-equal to bnb's (tested): 256 sorted float32 entries, an exact
0 at index 127 (signed) / 0 (unsigned), max 1.0, signed min -0.99296875.

``thresholds(map)`` turns a sorted map into the 256 float32 decision points every backend
encodes with: ``thr[i]`` is the largest float32 <= the exact midpoint of ``map[i]`` and
``map[i+1]``, and ``thr[255] = +inf``. Then, for a float32 ``x``,
``code(x) = #{i : x > thr[i]}`` is the nearest map entry, ties going to the lower index (what
``argmin |x - map|`` returns), with no rounding in the decision.
"""
from __future__ import annotations


import torch

__all__ = ["create_dynamic_map", "signed_map", "unsigned_map", "thresholds", "quantize_blockwise",
           "dequantize_blockwise", "block_absmax", "num_blocks", "SIGNED_ZERO_CODE",
           "UNSIGNED_ZERO_CODE", "BLOCK_SIZES", "DEFAULT_BLOCK_SIZE"]

SIGNED_ZERO_CODE = 127
UNSIGNED_ZERO_CODE = 0
# The block sizes of block-wise state, stated once for the ops' checks, the optimizers and the
# checkpoints: powers of two from 64 to 4096 (bitsandbytes' CUDA set; a Triton program is one
# block). The default per code width: bitsandbytes' 256 (8-bit), torchao's 128 (4-bit).
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCK_SIZE = {8: 256, 4: 128}


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7,
                       total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map``, op for op (float32 linspace, Python-scalar multiply,
    ``tolist`` to Python floats, sort, float32): the result must match bnb to the byte."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:  # never for the 8-bit maps (max_exponent_bits=7)
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2**total_bits
    data += [0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


# Built at import (a few small torch ops), not on first use: a step traced by torch.compile
# reads the maps, and create_dynamic_map's tolist() cannot be traced.
_CPU_MAPS = {signed: create_dynamic_map(signed=signed) for signed in (True, False)}
_MAPS: dict[tuple, torch.Tensor] = {}


def _cpu_map(signed: bool) -> torch.Tensor:
    return _CPU_MAPS[signed]


def _on_device(signed: bool, device: torch.device) -> torch.Tensor:
    qmap = _MAPS.get((signed, device))
    if qmap is None:
        qmap = _MAPS[(signed, device)] = _CPU_MAPS[signed].to(device)
    return qmap


def signed_map(device: torch.device | str = "cpu") -> torch.Tensor:
    """The shared signed map (exp_avg). Do not modify it in place."""
    return _on_device(True, torch.device(device))


def unsigned_map(device: torch.device | str = "cpu") -> torch.Tensor:
    """The shared unsigned map (exp_avg_sq). Do not modify it in place."""
    return _on_device(False, torch.device(device))


_THRESHOLDS: dict[tuple, tuple] = {}


def thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """Decision thresholds of a sorted float32 map, cached per map tensor (and its version).
    See ``compute_thresholds``."""
    thr = _info(qmap)[1]
    return thr if thr is not None else compute_thresholds(qmap)  # (unsorted: raises)


def zero_code(qmap: torch.Tensor) -> int:
    """Index of the +0.0 entry of a map (-1 if none), cached like ``thresholds``."""
    return _info(qmap)[2]


def is_sorted(qmap: torch.Tensor) -> bool:
    """Whether a map's entries are strictly increasing (the codecs' rule), cached like
    ``thresholds``."""
    return _info(qmap)[3]


def _info(qmap: torch.Tensor):
    """(qmap, thresholds or None, zero code, sorted), cached per (tensor, version, device).
    The version counter sees in-place torch writes, not writes through ``.data``, NumPy or
    DLPack aliases: replace a map rather than edit it that way. Not cached: a map that breaks
    the sorted rule (a caller refuses it) and an inference tensor (no version counter)."""
    if qmap.is_inference():
        return _read(qmap)
    key = (id(qmap), qmap._version, str(qmap.device))
    hit = _THRESHOLDS.get(key)
    if hit is None:
        hit = _read(qmap)
        if hit[3]:  # holds qmap, so its id is not reused while cached
            _THRESHOLDS[key] = hit
    return hit


def _read(qmap: torch.Tensor):
    q = qmap.detach().cpu()
    zero = torch.nonzero((q == 0) & ~torch.signbit(q))
    ok = bool((q[1:] > q[:-1]).all())
    return (qmap, compute_thresholds(qmap) if ok else None, int(zero[0]) if len(zero) else -1, ok)


def compute_thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """Decision thresholds of a sorted float32 map (see the module docstring), float32[256].
    The midpoint of two float32 values is exact in float64; rounding it down to float32 makes
    ``x > thr[i]`` equivalent to ``x > exact midpoint`` for every float32 x."""
    q = qmap.detach().double().cpu()
    if q.numel() not in (16, 256) or not bool((q[1:] > q[:-1]).all()):
        raise ValueError("a quantization map must hold 256 (8-bit) or 16 (4-bit) strictly "
                         "increasing values")
    mid = (q[:-1] + q[1:]) * 0.5
    t = mid.float()
    t = torch.where(t.double() > mid, torch.nextafter(t, torch.tensor(-float("inf"))), t)
    return torch.cat([t, torch.tensor([float("inf")])]).to(qmap.device)


# ---- the block-wise codec (pure torch; the kernels do the same per element) ------------------
def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32[ceil(n / block_size)]: max |x| over each block of the flattened tensor."""
    flat = x.detach().reshape(-1).float()
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size).abs().amax(dim=1)


FLT_MAX = 3.4028234663852886e38


def inv_scale(absmax: torch.Tensor) -> torch.Tensor:
    """quant8_inv_scale: float32 1/absmax saturated at FLT_MAX (0 -> FLT_MAX, encodes zeros)."""
    r = 1.0 / absmax.float()
    return torch.where(r < FLT_MAX, r, torch.full_like(r, FLT_MAX))


def encode(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Nearest code (int64) of each float32 value of x, ties to the lower code (8-bit or 4-bit
    map: 256 or 16 entries; NaN encodes as 0)."""
    thr = thresholds(qmap).to(x.device)
    xf = x.float().contiguous()
    c = torch.searchsorted(thr, xf, side="left").clamp_(max=qmap.numel() - 1)
    return torch.where(torch.isnan(xf), torch.zeros_like(c), c)


def quantize_blockwise(x: torch.Tensor, qmap: torch.Tensor, block_size: int,
                       keep_negative: bool | None = None):
    """(uint8 codes of x's shape, float32 absmax per block). ``keep_negative`` (default: the map
    is signed) applies bitsandbytes' rule that a negative value never encodes as 0 or positive."""
    flat = x.detach().reshape(-1).float()
    absmax = block_absmax(flat, block_size)
    scale = absmax.repeat_interleave(block_size)[: flat.numel()]
    xn = flat * inv_scale(scale)
    codes = encode(xn, qmap)
    zero = zero_code(qmap)
    if keep_negative is None:
        keep_negative = zero > 0
    if keep_negative:
        codes = torch.where(torch.signbit(flat) & (codes == zero), codes - 1, codes)
    return codes.to(torch.uint8).reshape(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """float32 values of x's shape: qmap[code] * absmax[block] (one float32 product)."""
    flat = codes.reshape(-1).long()
    scale = absmax.float().repeat_interleave(block_size)[: flat.numel()]
    return (qmap.to(codes.device)[flat] * scale).reshape(codes.shape)

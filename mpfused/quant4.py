"""Block-wise 4-bit optimizer state (Li et al. 2023, "Memory Efficient Optimizers with 4-bit
States"; torchao's ``AdamW4bit``): the maps, the nibble packing and the codec in pure torch (the
reference, state conversions and tests use it; the kernels do the same per element, see
csrc/include/mpfused/quant8_math.h "4-bit codes" and triton_kernels/_quant8.py).

Format (torchao's, so that states convert by copying bytes)
-----------------------------------------------------------
* ``signed4_map()`` (first moment): torchao's ``create_dynamic_map(True, 3, 4)``, 16 sorted
  float32 entries, +0 at code 7, smallest magnitude 0.0055, max 1.0, min -0.8875. Byte-equal to
  torchao's (tested).
* ``unsigned4_map()`` (second moment): the linear map 1/16, 2/16, ..., 1 **without zero**
  (torchao's ``linspace(0, 1, 17)[1:]``). Li et al.'s zero-point problem: with a map holding 0, a
  small v in a block with a large one rounds to 0 and the update m / (sqrt(v) + eps) explodes;
  here a v > 0 encodes as at least absmax / 16 (the update can only shrink). A zero-free map
  with finer small values (Li et al.'s DE-0) would break byte-for-byte conversion with torchao;
  Li et al. report linear and DE-0 equal at rank-1 / block 128.
* Blocks of ``block_size`` (default 128) consecutive elements, one float32 absmax each:
  ``value = map[code] * absmax`` (as 8-bit). An all-zero block has absmax 0 and decodes to 0.
* Codes packed two per byte, torchao's order: element 2k in the high nibble of byte k, 2k+1 in
  the low nibble; an odd-sized tensor's last byte has a zero low nibble. The live state is a flat
  uint8 tensor of ceil(numel / 2) bytes.
* Encoding: nearest entry to ``x = s * (1 / absmax)`` with the 8-bit codec's exact decision
  thresholds (ties to the lower code), no sign rule (a negative m may round to +0, as in torchao
  and Li et al.: with 16 codes, bitsandbytes' rule would store -0.0055 * absmax instead).
  torchao divides per element, clamps the scale at 1e-12 and rounds ties up: its codes of the same
  float values can differ at a tie or within an ulp of one; decoding is identical.
* NaN / inf as 8-bit: a NaN moment makes its block's absmax NaN (the block decodes to NaN), NaN
  encodes as code 0; an inf moment gives an inf absmax, x = 0 or NaN in that block.
"""
from __future__ import annotations

import torch

from mpfused.quant_maps import block_absmax, encode, inv_scale, num_blocks

__all__ = ["signed4_map", "unsigned4_map", "SIGNED4_ZERO_CODE", "pack4", "unpack4",
           "quantize4_blockwise", "dequantize4_blockwise", "codes4_numel", "zero_codes4"]

SIGNED4_ZERO_CODE = 7
UNSIGNED4_ZERO_CODE = 0  # the code of the smallest entry (1/16): v's zeros are absmax-0 blocks


def _create_signed4() -> torch.Tensor:
    """torchao's ``create_dynamic_map(True, 3, 4)`` op for op (float32 linspace, Python-scalar
    multiply, ``tolist``, sort): one fraction bit per decade over three decades, then 0 and 1."""
    data: list[float] = []
    max_exp, non_sign_bits = 3, 3
    for i in range(max_exp):
        items = int(2 ** (i + non_sign_bits - max_exp) + 1)
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exp - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exp - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


_CPU_MAPS = {True: _create_signed4(),
             False: torch.tensor(torch.linspace(0, 1, 17)[1:].tolist(), dtype=torch.float32)}
_MAPS: dict[tuple, torch.Tensor] = {}


def _on_device(signed: bool, device) -> torch.Tensor:
    device = torch.device(device)
    qmap = _MAPS.get((signed, device))
    if qmap is None:
        qmap = _MAPS[(signed, device)] = _CPU_MAPS[signed].to(device)
    return qmap


def signed4_map(device="cpu") -> torch.Tensor:
    """The shared 16-entry signed map (exp_avg). Do not modify it in place."""
    return _on_device(True, device)


def unsigned4_map(device="cpu") -> torch.Tensor:
    """The shared 16-entry zero-free unsigned map (exp_avg_sq). Do not modify it in place."""
    return _on_device(False, device)


def codes4_numel(numel: int) -> int:
    return (numel + 1) // 2


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Flat uint8 bytes of ceil(n / 2): code 2k in the high nibble, 2k+1 in the low one."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    c = c.view(-1, 2)
    return (c[:, 0] << 4) | c[:, 1]


def unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` codes (int64) of packed bytes."""
    b = packed.reshape(-1)
    return torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)[:numel].long()


def zero_codes4(numel: int, signed: bool, device="cpu") -> torch.Tensor:
    """The packed codes of a zero state (absmax 0), as a kernel would write them."""
    code = SIGNED4_ZERO_CODE if signed else 0
    return pack4(torch.full((numel,), code, dtype=torch.uint8, device=device))


def quantize4_blockwise(x: torch.Tensor, qmap: torch.Tensor, block_size: int):
    """(packed uint8 codes, float32 absmax per block) of x (flattened, row-major)."""
    flat = x.detach().reshape(-1).float()
    absmax = block_absmax(flat, block_size)
    scale = absmax.repeat_interleave(block_size)[: flat.numel()]
    codes = encode(flat * inv_scale(scale), qmap)
    return pack4(codes), absmax


def dequantize4_blockwise(packed: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor,
                          block_size: int, shape) -> torch.Tensor:
    """float32 values of ``shape``: qmap[code] * absmax[block] (one float32 product)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    codes = unpack4(packed, numel)
    assert absmax.numel() == num_blocks(numel, block_size)
    scale = absmax.float().repeat_interleave(block_size)[:numel]
    return (qmap.to(packed.device)[codes] * scale).reshape(shape)

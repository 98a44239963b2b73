"""Which state keys of an optimizer with quantized state are codes, and their codec: a
``QuantState`` per key (from the optimizer's ``_QUANT_STATES`` and ``_STATE_BITS``), 8-bit
(bitsandbytes' maps, codes of the param's shape) or 4-bit (mpfused/quant4.py: torchao's maps,
codes packed two per byte, flat). Used by the State8bit mixin and the checkpoint format
(mpfused/optim/state8bit.py, _checkpoint_8bit.py), which never branch on the width themselves."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mpfused import quant4
from mpfused.quant_maps import (SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE, dequantize_blockwise,
                                num_blocks, quantize_blockwise, signed_map, unsigned_map)


@dataclass(frozen=True)
class QuantState:
    """A per-element state kept as 8-bit codes: its live key, its map (bitsandbytes' signed
    "dynamic" or unsigned "udynamic") and its number n in bitsandbytes' layout (state{n},
    absmax{n}, qmap{n}). The live absmax is ``{key}_absmax``."""
    key: str
    signed: bool
    n: int
    bits: int = 8  # 4: mpfused/quant4.py (16-entry maps, codes packed two per byte, flat)

    @property
    def absmax_key(self) -> str:
        return f"{self.key}_absmax"

    @property
    def saved_key(self) -> str:
        return f"state{self.n}"

    @property
    def saved_absmax_key(self) -> str:
        return f"absmax{self.n}"

    @property
    def zero_code(self) -> int:
        if self.bits == 4:
            return quant4.SIGNED4_ZERO_CODE if self.signed else quant4.UNSIGNED4_ZERO_CODE
        return SIGNED_ZERO_CODE if self.signed else UNSIGNED_ZERO_CODE

    def qmap(self, device="cpu") -> torch.Tensor:
        if self.bits == 4:
            return quant4.signed4_map(device) if self.signed else quant4.unsigned4_map(device)
        return signed_map(device) if self.signed else unsigned_map(device)

    # the codec of this state's width: 8-bit codes have the param's shape, 4-bit codes are flat
    def codes_shape(self, shape) -> tuple:
        if self.bits == 4:
            return (quant4.codes4_numel(int(torch.Size(shape).numel())),)
        return tuple(shape)

    def quantize(self, x: torch.Tensor, block: int):
        if self.bits == 4:
            return quant4.quantize4_blockwise(x, self.qmap(x.device), block)
        return quantize_blockwise(x, self.qmap(x.device), block)

    def dequantize(self, codes, absmax, block: int, shape) -> torch.Tensor:
        if self.bits == 4:
            return quant4.dequantize4_blockwise(codes, absmax, self.qmap(codes.device), block,
                                                shape)
        return dequantize_blockwise(codes, absmax, self.qmap(codes.device), block)

    def zeros(self, local: torch.Tensor, block: int):
        """(codes, absmax) of a zero state of `local`'s size, as a kernel writes them."""
        absmax = torch.zeros(num_blocks(local.numel(), block), dtype=torch.float32,
                             device=local.device)
        if self.bits == 4:
            return quant4.zero_codes4(local.numel(), self.signed, local.device), absmax
        return torch.full(local.shape, self.zero_code, dtype=torch.uint8,
                          device=local.device), absmax


def parse_quant_states(spec, bits: int = 8) -> tuple[QuantState, ...]:
    """``(("exp_avg", "signed"), ("exp_avg_sq", "unsigned"))`` -> QuantStates, in bitsandbytes'
    order (the first is its state1)."""
    kinds = {"signed": True, "unsigned": False}
    for key, kind in spec:
        if kind not in kinds:
            raise ValueError(f"_QUANT_STATES: {key!r} has map {kind!r}; 'signed' or 'unsigned'")
    return tuple(QuantState(key, kinds[kind], n, bits) for n, (key, kind) in enumerate(spec, 1))

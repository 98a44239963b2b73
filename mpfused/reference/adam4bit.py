"""Reference Adam/AdamW step with block-wise 4-bit moments: adam8bit's reference with the 4-bit
codec (mpfused/quant4.py): dequantize (float32 products), update in float64, round the new
moments to float32, take their block absmax and requantize them (nearest code, no sign rule)."""
from __future__ import annotations

from mpfused.reference.adam8bit import adam8bit_step_


def adam4bit_step_(*args, **kwargs):
    """mpfused::adam4bit_step_: adam8bit_step_'s loop with the 4-bit codec (_bits=4)."""
    return adam8bit_step_(*args, **kwargs, _bits=4)

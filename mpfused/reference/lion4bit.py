"""Reference Lion step with a block-wise 4-bit moment (torchao's 4-bit format of AdamW4bit's
first moment, mpfused/quant4.py): lion8bit's reference with the 4-bit codec: dequantize (float32
products), the Lion update in float64 (sign(0) = 0, NaN stays NaN), round the new moment to
float32, take its block absmax and requantize it (nearest code of the signed 16-entry map, no
sign rule). The kernels update in float32, so a code may differ where the moment lies within
rounding of a threshold."""
from __future__ import annotations

from mpfused.reference.lion8bit import lion8bit_step_


def lion4bit_step_(params, grads, exp_avgs, absmaxs, masters, steps, qmap, **kwargs):
    """mpfused::lion4bit_step_: lion8bit_step_'s loop with the 4-bit codec (_bits=4)."""
    return lion8bit_step_(params, grads, exp_avgs, absmaxs, masters, steps, qmap, **kwargs,
                          _bits=4)

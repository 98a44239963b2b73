"""Reference SGD step with a block-wise 4-bit momentum buffer (torchao's 4-bit format of
AdamW4bit's first moment, mpfused/quant4.py): sgd8bit's reference with the 4-bit codec:
dequantize (float32 products), torch.optim.SGD's momentum update in float64, round the new buffer
to float32, take its block absmax and requantize it (nearest code of the signed 16-entry map, no
sign rule). The kernels update in float32, so a code may differ where the buffer lies within
rounding of a threshold."""
from __future__ import annotations

from mpfused.reference.sgd8bit import sgd8bit_step_


def sgd4bit_step_(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, **kwargs):
    """mpfused::sgd4bit_step_: sgd8bit_step_'s loop with the 4-bit codec (_bits=4)."""
    return sgd8bit_step_(params, grads, momentum_buffers, absmaxs, masters, steps, qmap, **kwargs,
                         _bits=4)

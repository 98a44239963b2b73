"""Multi-tensor Lion step with a block-wise 4-bit moment (torchao's 4-bit format of AdamW4bit's
first moment, see mpfused/quant4.py): exp_avgs are flat uint8 tensors of ceil(numel / 2) bytes,
two codes each, into qmap (the signed 16-entry map, +0 inside), with one fp32 absmax per block of
block_size elements. Nearest code, no sign rule.

A separate op with lion8bit_step_'s schema, not a bits argument (as adam4bit_step_). Scalars are
keyword-only (operands positional). The kernels are the 8-bit ones specialized on the code
width: the same update (decoupled weight decay, maximize; NaN is kept, not signed to 0), master
modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes, step counters
included), fused clipping and stochastic-rounding streams. Native kernels: CPU and CUDA (the CUDA
one only in a CUDA build, checked by nvcc and the host emulation, never on a GPU); without it the
router serves the Triton kernel on CUDA."""
from __future__ import annotations

from mpfused.operand_checks import fake_kernel, one_state_operands
from mpfused.ops.lion8bit import ARGS, lion8bit_step_
from mpfused.ops.registry import define_op
from mpfused.reference import lion4bit as ref

_op = define_op(
    "lion4bit_step_" + ARGS,
    reference=ref.lion4bit_step_,
    fake=fake_kernel(one_state_operands, "lion4bit_step_", "exp_avgs",
                     bits=4),
    triton="mpfused.triton_kernels.lion8bit:lion4bit_step_",
)

# The typed wrapper: lion8bit_step_'s signature (the same arguments), this op's name and
# docstring (Op.wraps_like).
lion4bit_step_ = _op.wraps_like(lion8bit_step_, __name__, """\
One Lion step with a block-wise 4-bit moment, in place
(``torch.ops.mpfused.lion4bit_step_``).

Operands: ``exp_avgs`` flat uint8 tensors of ceil(numel / 2) bytes (two codes each, element
2k in the high nibble) into ``qmap`` (the signed 16-entry map); ``absmaxs`` fp32, one per
block of ``block_size`` elements; everything else as ``lion8bit_step_``. ``backend``: an
explicit implementation, else the dispatcher's route.""")

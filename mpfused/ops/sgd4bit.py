"""Multi-tensor SGD step with a block-wise 4-bit momentum buffer (torchao's 4-bit format of
AdamW4bit's first moment, see mpfused/quant4.py): momentum_buffers are flat uint8 tensors of
ceil(numel / 2) bytes, two codes each, into qmap (the signed 16-entry map, +0 inside), with one
fp32 absmax per block of block_size elements. Nearest code, no sign rule. momentum must be > 0
(the buffer is the only state).

A separate op with sgd8bit_step_'s schema, not a bits argument (as adam4bit_step_): the state's
size rule and the map's length are the op's contract. Scalars are keyword-only (operands
positional). The kernels are the 8-bit ones specialized on the code width: the same update
(dampening, Nesterov, L2 weight decay, maximize; a tensor whose step counter is 0 starts its
buffer as the gradient), master modes, in-kernel unscale (grad_scale), skip on found_inf > 0
(nothing changes, step counters included), fused clipping and stochastic-rounding streams.
Native kernels: CPU and CUDA (the CUDA one only in a CUDA build, checked by nvcc and the host
emulation, never on a GPU); without it the router serves the Triton kernel on CUDA."""
from __future__ import annotations

from mpfused.ops.registry import define_op
from mpfused.operand_checks import fake_kernel, one_state_operands
from mpfused.ops.sgd8bit import ARGS, sgd8bit_step_
from mpfused.reference import sgd4bit as ref

_op = define_op(
    "sgd4bit_step_" + ARGS,
    reference=ref.sgd4bit_step_,
    fake=fake_kernel(one_state_operands, "sgd4bit_step_", "momentum_buffers",
                     bits=4),
    triton="mpfused.triton_kernels.sgd8bit:sgd4bit_step_",
)

# The typed wrapper: sgd8bit_step_'s signature (the same arguments), this op's name and
# docstring (Op.wraps_like).
sgd4bit_step_ = _op.wraps_like(sgd8bit_step_, __name__, """\
One SGD step with a block-wise 4-bit momentum buffer, in place
(``torch.ops.mpfused.sgd4bit_step_``).

Operands: ``momentum_buffers`` flat uint8 tensors of ceil(numel / 2) bytes (two codes each,
element 2k in the high nibble) into ``qmap`` (the signed 16-entry map); ``absmaxs`` fp32,
one per block of ``block_size`` elements; everything else as ``sgd8bit_step_``.
``backend``: an explicit implementation, else the dispatcher's route.""")

"""Multi-tensor Adam/AdamW step with block-wise 4-bit moments (torchao's AdamW4bit format, see
mpfused/quant4.py): exp_avgs and exp_avg_sqs are flat uint8 tensors of ceil(numel / 2) bytes, two
codes each, into 16-entry maps qmap1 (signed, +0 inside) / qmap2 (unsigned, zero-free), with one
fp32 absmax per block of block_size elements. No sign rule (nearest code).

A separate op with adam8bit_step_'s schema, not a bits argument: the state's size rule (bytes =
ceil(numel / 2)) and the maps' length are the op's contract, checked per op without a flag that
every call site, fake kernel and bound list would carry; the kernels are the 8-bit ones
specialized on the code width. Same master modes, in-kernel unscale (grad_scale), skip on
found_inf > 0 (nothing changes, step counters included), fused clipping and stochastic-rounding
streams as adam8bit_step_."""
from __future__ import annotations

from mpfused.ops.adam8bit import ARGS, adam8bit_step_
from mpfused.operand_checks import adam8bit_operands, fake_kernel
from mpfused.ops.registry import define_op
from mpfused.reference import adam4bit as ref

_op = define_op(
    "adam4bit_step_" + ARGS,
    reference=ref.adam4bit_step_,
    fake=fake_kernel(adam8bit_operands, "adam4bit_step_", bits=4),
    triton="mpfused.triton_kernels.adam8bit:adam4bit_step_",
)

# The typed wrapper: adam8bit_step_'s signature (the same arguments), this op's name and
# docstring (Op.wraps_like).
adam4bit_step_ = _op.wraps_like(adam8bit_step_, __name__, """\
One Adam/AdamW step with block-wise 4-bit moments, in place
(``torch.ops.mpfused.adam4bit_step_``).

Operands: ``exp_avgs`` / ``exp_avg_sqs`` flat uint8 tensors of ceil(numel / 2) bytes (two
codes each, element 2k in the high nibble) into ``qmap1`` (signed, 16 fp32 entries) /
``qmap2`` (zero-free linear); ``absmax1s`` / ``absmax2s`` fp32, one per block of
``block_size`` elements; everything else as ``adam8bit_step_``. ``backend``: an explicit
implementation, else the dispatcher's route.""")

"""Multi-tensor Adam/AdamW step with block-wise 8-bit moments (bitsandbytes layout): exp_avgs and
exp_avg_sqs are uint8 codes into qmap1 (signed) / qmap2 (unsigned) with one fp32 absmax per
block of block_size elements. Same master modes, in-kernel unscale (grad_scale), skip on
found_inf > 0 (nothing changes, step counters included), fused clipping and stochastic-rounding
streams (param_ids, elem_offsets) as adam_step_.
See csrc/include/mpfused/quant8_math.h for the encoding."""
from mpfused.ops.registry import define_op
from mpfused.reference import adam8bit as ref

adam8bit_step_ = define_op(
    "adam8bit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] absmax1s, Tensor(e!)[] absmax2s, "
    "Tensor(f!)[] masters, Tensor(g!)[] steps, Tensor qmap1, Tensor qmap2, int block_size, "
    "float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
    "bool maximize, bool decoupled, int master_mode, Tensor? grad_scale=None, "
    "Tensor? found_inf=None, Tensor? norm_sq=None, float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.adam8bit_step_,
    triton="mpfused.triton_kernels.adam8bit:adam8bit_step_",
)

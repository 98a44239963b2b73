"""Multi-tensor Lion step with a block-wise 8-bit moment (bitsandbytes' Lion8bit layout): exp_avgs
are uint8 codes into qmap (the signed map) with one fp32 absmax per block of block_size elements.
The update is lion_step_'s (decoupled weight decay, maximize; NaN is kept, not signed to 0), with
the same master modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes,
step counters included), fused clipping and stochastic-rounding streams. See
csrc/include/mpfused/quant8_math.h for the encoding."""
from mpfused.ops.registry import define_op
from mpfused.reference import lion8bit as ref

lion8bit_step_ = define_op(
    "lion8bit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] absmaxs, Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor qmap, "
    "int block_size, float lr, Tensor? lr_tensor, float beta1, float beta2, "
    "float weight_decay, bool maximize, int master_mode, Tensor? grad_scale=None, "
    "Tensor? found_inf=None, Tensor? norm_sq=None, float max_grad_norm=0.0, int seed=0, "
    "int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.lion8bit_step_,
    triton="mpfused.triton_kernels.lion8bit:lion8bit_step_",
)

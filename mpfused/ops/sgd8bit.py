"""Multi-tensor SGD step with a block-wise 8-bit momentum buffer (bitsandbytes' SGD8bit layout):
momentum_buffers are uint8 codes into qmap (the signed map) with one fp32 absmax per block of
block_size elements. momentum must be > 0 (the buffer is the only state; as bitsandbytes'
SGD8bit). The update is sgd_step_'s (dampening, Nesterov, L2 weight decay, maximize; a tensor
whose step counter is 0 starts its buffer as the gradient), with the same master modes, in-kernel
unscale (grad_scale), skip on found_inf > 0 (nothing changes, step counters included), fused
clipping and stochastic-rounding streams. See csrc/include/mpfused/quant8_math.h for the
encoding."""
from mpfused.ops.registry import define_op
from mpfused.reference import sgd8bit as ref

sgd8bit_step_ = define_op(
    "sgd8bit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] absmaxs, Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor qmap, "
    "int block_size, float lr, Tensor? lr_tensor, float momentum, float dampening, "
    "float weight_decay, bool nesterov, bool maximize, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.sgd8bit_step_,
    triton="mpfused.triton_kernels.sgd8bit:sgd8bit_step_",
)

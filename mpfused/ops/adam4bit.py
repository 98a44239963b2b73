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
from mpfused.ops.registry import define_op
from mpfused.reference import adam4bit as ref

adam4bit_step_ = define_op(
    "adam4bit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] absmax1s, Tensor(e!)[] absmax2s, "
    "Tensor(f!)[] masters, Tensor(g!)[] steps, Tensor qmap1, Tensor qmap2, int block_size, "
    "float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
    "bool maximize, bool decoupled, int master_mode, Tensor? grad_scale=None, "
    "Tensor? found_inf=None, Tensor? norm_sq=None, float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.adam4bit_step_,
    triton="mpfused.triton_kernels.adam8bit:adam4bit_step_",
)

"""Multi-tensor Adam/AdamW step with optional fp32 master weights (or bf16 remainders, or
stochastic rounding), in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes,
step counters included) and fused clipping (norm_sq of the unscaled grads + max_grad_norm).

Stochastic rounding (master_mode 3) draws element j of params[i] from the stream of
(seed, step, param_ids[i], elem_offsets[i] + j) (csrc/include/mpfused/adam_math.h::random16):
param_ids should be unique per param and stable (the optimizers pass the param's index in
their flat param order, the ids of torch's state_dict), elem_offsets the position of the
tensor's first element in the whole param (a shard's global offset). Empty lists: each tensor's
position in the call, offset 0."""
from mpfused.ops.registry import define_op
from mpfused.reference import adam as ref

adam_step_ = define_op(
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] masters, "
    "Tensor(f!)[] steps, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
    "float weight_decay, bool amsgrad, bool maximize, bool decoupled, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.adam_step_,
    triton="mpfused.triton_kernels.adam:adam_step_",
)

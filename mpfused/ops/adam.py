"""Multi-tensor Adam/AdamW step with optional fp32 master weights (or bf16 remainders, or
stochastic rounding), in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes,
step counters included) and fused clipping (norm_sq of the unscaled grads + max_grad_norm)."""
from mpfused.ops.registry import define_op
from mpfused.reference import adam as ref

adam_step_ = define_op(
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] masters, "
    "Tensor(f!)[] steps, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
    "float weight_decay, bool amsgrad, bool maximize, bool decoupled, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0) -> ()",
    reference=ref.adam_step_,
    triton="mpfused.triton_kernels.adam:adam_step_",
)

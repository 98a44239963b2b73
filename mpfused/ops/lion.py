"""Multi-tensor Lion step (Chen et al. 2023; decoupled weight decay, maximize) with the master
modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing changes, step counters
included), fused clipping and stochastic-rounding streams of adam_step_. ``exp_avgs``: one fp32
moment per param (csrc/include/mpfused/lion_math.h)."""
from mpfused.ops.registry import define_op
from mpfused.reference import lion as ref

lion_step_ = define_op(
    "lion_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] masters, Tensor(d!)[] steps, float lr, Tensor? lr_tensor, float beta1, "
    "float beta2, float weight_decay, bool maximize, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.lion_step_,
    triton="mpfused.triton_kernels.lion:lion_step_",
)

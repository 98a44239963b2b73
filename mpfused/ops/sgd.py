"""Multi-tensor SGD step (torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay,
maximize) with the master modes, in-kernel unscale (grad_scale), skip on found_inf > 0 (nothing
changes, step counters included), fused clipping and stochastic-rounding streams of adam_step_.

``momentum_buffers`` is empty when momentum == 0 and holds one fp32 buffer per param otherwise.
A tensor whose step counter is 0 takes its first step: its buffer becomes the (unscaled, clipped,
decayed) gradient itself, as torch clones it (csrc/include/mpfused/sgd_math.h)."""
from mpfused.ops.registry import define_op
from mpfused.reference import sgd as ref

sgd_step_ = define_op(
    "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] masters, Tensor(d!)[] steps, float lr, Tensor? lr_tensor, float momentum, "
    "float dampening, float weight_decay, bool nesterov, bool maximize, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.sgd_step_,
    triton="mpfused.triton_kernels.sgd:sgd_step_",
)

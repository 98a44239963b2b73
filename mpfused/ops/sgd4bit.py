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
Native kernel: CPU only; on CUDA the router serves the Triton kernel."""
from mpfused.ops.registry import define_op
from mpfused.reference import sgd4bit as ref

sgd4bit_step_ = define_op(
    "sgd4bit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] absmaxs, Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor qmap, *, "
    "int block_size, float lr, Tensor? lr_tensor, float momentum, float dampening, "
    "float weight_decay, bool nesterov, bool maximize, int master_mode, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? norm_sq=None, "
    "float max_grad_norm=0.0, int seed=0, int[] param_ids=[], int[] elem_offsets=[]) -> ()",
    reference=ref.sgd4bit_step_,
    triton="mpfused.triton_kernels.sgd8bit:sgd4bit_step_",
)

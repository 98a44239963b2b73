"""Loss-scaling ops: multi-tensor non-finite check (+ unscale, + sum of squares) and the scale
update. found_inf is a 0-dim float32 tensor on the grads' device, set to 1 (never cleared); the
rule everywhere is "skip when found_inf > 0". norm_sq / norm_sq_per_tensor are accumulated into."""
from mpfused.ops.registry import define_op
from mpfused.reference import amp as ref

_CHECK_ARGS = ("Tensor(b!) found_inf, Tensor inv_scale, Tensor(c!)? norm_sq=None, "
               "Tensor(d!)? norm_sq_per_tensor=None) -> ()")

unscale_grads_ = define_op(
    f"unscale_grads_(Tensor(a!)[] grads, {_CHECK_ARGS}",
    reference=ref.unscale_grads_,
    triton="mpfused.triton_kernels.amp:unscale_grads_",
)

check_grads = define_op(
    f"check_grads(Tensor[] grads, {_CHECK_ARGS}",
    reference=ref.check_grads,
    triton="mpfused.triton_kernels.amp:check_grads",
)

update_scale_ = define_op(
    "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
    "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
    "int hysteresis, float min_scale, float max_scale, bool consecutive_hysteresis=False) -> ()",
    reference=ref.update_scale_,
    triton="mpfused.triton_kernels.amp:update_scale_",
)

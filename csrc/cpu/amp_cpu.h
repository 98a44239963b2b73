// CPU kernels for loss scaling (raw pointers, no torch).
#pragma once
#include "mpfused/amp_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cpu {

// Multi-tensor non-finite check, optional in-place unscale and optional sum of squares of the
// unscaled values, over tensors of mixed dtypes (fp32/fp16/bf16) in one call.
// found_inf is set to 1 when any element is inf/NaN and never cleared; norm_sq (scalar) and
// norm_sq_per_tensor ([size]) are accumulated into (+=) when not null.
void amp_check(const TensorLists<1>& grads, float inv_scale, bool write_back, float* found_inf,
               float* norm_sq, float* norm_sq_per_tensor, int num_threads);

}  // namespace mpfused::cpu

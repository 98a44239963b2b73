// CUDA kernels for loss scaling (raw pointers + cudaStream_t, no torch). Every scalar operand
// (inv_scale, found_inf, norm_sq, scale, trackers) is a device pointer: nothing is read on the
// host, so the calls never synchronize and can be captured in a CUDA graph.
#pragma once
#include <cuda_runtime.h>

#include "mpfused/amp_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::cuda {

// Bytes of device workspace amp_check needs: one double per chunk when a sum of squares is
// requested, plus one 24-byte segment descriptor per tensor when per-tensor sums are. 0 otherwise.
int64_t amp_check_workspace_bytes(const TensorLists<1>& grads, bool norm, bool per_tensor);

// Multi-tensor non-finite check, optional in-place unscale (write_back) and optional sum of
// squares of the unscaled values, over tensors of mixed dtypes (fp32/fp16/bf16) in one launch
// (more only past the kernel-parameter limit; see multi_tensor_apply.cuh).
//   inv_scale: device float, read in the kernel.
//   found_inf: device float, set to 1.f (plain store) when any element is inf/NaN; never cleared.
//   norm_sq:   null or a device float; the total sum of squares is added to it.
//   norm_sq_per_tensor: null, or a HOST array of grads.size DEVICE pointers; the sum of squares of
//              tensor i is added to *norm_sq_per_tensor[i] (the bindings point these into the
//              caller's tensor, skipping dropped empty tensors without any index copy).
//   workspace: amp_check_workspace_bytes(...) bytes of device memory (8-byte aligned), or null
//              when that is 0. Scratch only: no initialization needed.
// Sums are deterministic: one partial per chunk, combined in a fixed order by a second kernel.
cudaError_t amp_check(const TensorLists<1>& grads, const float* inv_scale, bool write_back,
                      float* found_inf, float* norm_sq, float* const* norm_sq_per_tensor,
                      void* workspace, cudaStream_t stream);

// One update_scale (amp_math.h) in a <<<1,1>>> kernel; found_inf is read on the device.
cudaError_t update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                         const float* found_inf, const ScaleUpdateParams& params,
                         cudaStream_t stream);

}  // namespace mpfused::cuda

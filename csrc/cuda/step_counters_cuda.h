// CUDA step counters of the step ops (raw pointers + cudaStream_t, no torch).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace mpfused::cuda {

// steps: host array of n device pointers. Adds 1 to every counter unless found_inf (device,
// may be null) is > 0. Stream-ordered after the step kernel: no host sync.
cudaError_t increment_steps(float* const* steps, int64_t n, const float* found_inf,
                            cudaStream_t stream);

}  // namespace mpfused::cuda

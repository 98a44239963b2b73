// CUDA step counters: one launch per 500 (4 KB parameters) or 4,000 (32 KB) counters adds 1 to
// each unless found_inf > 0. Shared by the step ops whose kernels read the counters (Adam, 8-bit
// Adam, SGD, Lion): a kernel cannot advance them itself, a tensor's chunks are run by several
// blocks.
#include "step_counters_cuda.h"

#include "multi_tensor_apply.cuh"

namespace mpfused::cuda {
namespace {

// Step counters travel by value in the kernel parameters (like torch's state_steps_addresses):
// no pointer table in device memory, nothing to copy, graph-capturable. 500 per 4 KB launch,
// 4,000 per launch with the 32 KB parameter space; blocks of 500 threads.
constexpr int kStepsPerBlock = 500;
template <int N>
struct StepTable {
  float* ptr[N];
};
static_assert(sizeof(StepTable<kStepsPerBlock>) + 64 <= kMaxParamBytes, "kernel parameter limit");
static_assert(sizeof(StepTable<8 * kStepsPerBlock>) + 64 <= kMaxParamBytesLarge,
              "kernel parameter limit");

template <int N>
__global__ void __launch_bounds__(kStepsPerBlock)
    increment_steps_kernel(MPF_PARAM_TABLE(StepTable<N>) table, int32_t n,
                           const float* found_inf) {
  if (found_inf != nullptr && *found_inf > 0.f) return;
  const int i = int(blockIdx.x) * kStepsPerBlock + int(threadIdx.x);
  if (i < n) *table.ptr[i] += 1.f;
}

template <int N>
cudaError_t increment_steps_with(float* const* steps, int64_t n, const float* found_inf,
                                 cudaStream_t stream) {
  for (int64_t base = 0; base < n; base += N) {
    const int32_t k = int32_t(n - base < N ? n - base : N);
    StepTable<N> table{};
    for (int32_t i = 0; i < k; ++i) table.ptr[i] = steps[base + i];
    MPF_LAUNCH(dim3(unsigned((k + kStepsPerBlock - 1) / kStepsPerBlock)), kStepsPerBlock, stream,
               increment_steps_kernel<N>)(table, k, found_inf);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t increment_steps(float* const* steps, int64_t n, const float* found_inf,
                            cudaStream_t stream) {
#if MPF_MTA_LARGE_PARAMS == 2
  if (large_kernel_params())
    return increment_steps_with<8 * kStepsPerBlock>(steps, n, found_inf, stream);
  return increment_steps_with<kStepsPerBlock>(steps, n, found_inf, stream);
#elif MPF_MTA_LARGE_PARAMS == 1
  return increment_steps_with<8 * kStepsPerBlock>(steps, n, found_inf, stream);
#else
  return increment_steps_with<kStepsPerBlock>(steps, n, found_inf, stream);
#endif
}

}  // namespace mpfused::cuda

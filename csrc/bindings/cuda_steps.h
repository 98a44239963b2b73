// Step counters and stream operands of the CUDA step bindings (Adam, 8-bit Adam, SGD, Lion): one
// launch advances every counter.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <optional>
#include <vector>

#include "../cuda/step_counters_cuda.h"
#include "common.h"

namespace mpfused::bind {

// Every counter advances (empty params included, as on the CPU), unless found_inf > 0: read on
// the device, so no sync and capturable.
inline void advance_steps_cuda(at::TensorList steps, const std::optional<at::Tensor>& found_inf,
                               cudaStream_t stream) {
  std::vector<float*> all_steps;
  all_steps.reserve(steps.size());
  for (const at::Tensor& s : steps) all_steps.push_back(s.data_ptr<float>());
  C10_CUDA_CHECK(cuda::increment_steps(all_steps.data(), int64_t(all_steps.size()),
                                       found_inf ? found_inf->data_ptr<float>() : nullptr,
                                       stream));
}

// The kStream / kQ8Stream operand: each packed tensor's sr_stream, carried as a pointer-sized value
// in the launch metadata (common.h::sr_streams).
inline std::vector<void*> stream_operand(at::IntArrayRef param_ids, at::IntArrayRef elem_offsets,
                                         size_t n, const std::vector<int64_t>& index) {
  const std::vector<uint64_t> streams = sr_streams(param_ids, elem_offsets, n, index);
  std::vector<void*> out(streams.size());
  for (size_t j = 0; j < out.size(); ++j) out[j] = reinterpret_cast<void*>(uintptr_t(streams[j]));
  return out;
}

}  // namespace mpfused::bind

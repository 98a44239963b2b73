// Argument checks of the step ops with block-wise 8-bit state (every backend).
#pragma once
#include "common.h"

namespace mpfused::bind {

// Metadata of a quantization map of adam8bit_step_ (every backend): 256 contiguous float32 on
// `dev`. Its values (sorted, +0) are checked where they can be read without a sync: on the host by
// the CPU binding, on the device by the CUDA kernel.
inline void check_qmap(const at::Tensor& map, const char* what, const at::Device& dev) {
  TORCH_CHECK(map.scalar_type() == at::kFloat && map.numel() == 256 && map.dim() == 1 &&
                  map.is_contiguous(),
              "mpfused: ", what, " must be a contiguous float32 tensor of 256 entries, got ",
              map.sizes(), " ", map.scalar_type());
  TORCH_CHECK(map.device() == dev, "mpfused: ", what, " must be on ", dev,
              " (the params' device), got ", map.device());
}

// Arguments of adam8bit_step_ (every backend): lengths, dtypes, devices, block size, absmax
// sizes, masters, step counters, scalars. Returns the params' device.
inline at::Device check_adam8bit_args(at::TensorList params, at::TensorList grads,
                                      at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                      at::TensorList absmax1s, at::TensorList absmax2s,
                                      at::TensorList masters, at::TensorList steps,
                                      int64_t block_size, int64_t master_mode,
                                      const std::optional<at::Tensor>& grad_scale,
                                      const std::optional<at::Tensor>& found_inf,
                                      const std::optional<at::Tensor>& norm_sq) {
  const at::Device dev = params[0].device();
  const size_t n = params.size();
  check_same_device(params, dev, "params");
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  absmax1s.size() == n && absmax2s.size() == n && steps.size() == n,
              "mpfused: params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s and steps must "
              "have the same length");
  TORCH_CHECK(block_size >= 64 && block_size <= 4096 && (block_size & (block_size - 1)) == 0,
              "mpfused: block_size must be a power of two in [64, 4096], got ", block_size);
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(grads[i].scalar_type() == params[i].scalar_type(), "mpfused: grads[", i,
                "] must have its param's dtype ", params[i].scalar_type(), ", got ",
                grads[i].scalar_type());
  check_dtypes(exp_avgs, at::kByte, "exp_avgs (8-bit codes)");
  check_dtypes(exp_avg_sqs, at::kByte, "exp_avg_sqs (8-bit codes)");
  check_dtypes(absmax1s, at::kFloat, "absmax1s");
  check_dtypes(absmax2s, at::kFloat, "absmax2s");
  for (const at::TensorList* list : {&exp_avgs, &exp_avg_sqs, &absmax1s, &absmax2s})
    check_same_device(*list, dev, "8-bit state");
  for (size_t i = 0; i < n; ++i) {
    const int64_t blocks = (params[i].numel() + block_size - 1) / block_size;
    TORCH_CHECK(absmax1s[i].numel() == blocks && absmax2s[i].numel() == blocks &&
                    absmax1s[i].is_contiguous() && absmax2s[i].is_contiguous(),
                "mpfused: absmax1s[", i, "] and absmax2s[", i, "] must be contiguous with "
                "ceil(numel / block_size) = ", blocks, " entries, got ", absmax1s[i].numel(),
                " and ", absmax2s[i].numel());
  }
  if (master_mode == kFp32Master) check_dtypes(masters, at::kFloat, "masters");
  if (master_mode == kRemainder) check_dtypes(masters, at::kShort, "masters (remainders)");
  const bool has_master = master_mode == kFp32Master || master_mode == kRemainder;
  if (has_master)
    for (size_t i = 0; i < n; ++i)
      TORCH_CHECK(masters.size() == n || params[i].scalar_type() == at::kFloat ||
                      (master_mode == kRemainder && params[i].scalar_type() == at::kHalf) ||
                      params[i].numel() == 0,
                  "mpfused: master_mode ", master_mode, " needs one master per param (params[",
                  i, "] is ", params[i].scalar_type(), ")");
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat &&
                    steps[i].device() == dev,
                "mpfused: steps[", i, "] must be a 1-element float32 tensor on ", dev);
  if (grad_scale) check_scalar_f32(*grad_scale, "grad_scale", dev);
  if (found_inf) check_scalar_f32(*found_inf, "found_inf", dev);
  if (norm_sq) check_scalar_f32(*norm_sq, "norm_sq", dev);
  return dev;
}

}  // namespace mpfused::bind

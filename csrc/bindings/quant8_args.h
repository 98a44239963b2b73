// Argument checks of the step ops with block-wise 8-bit state (every backend), and the CPU
// bindings' checks of a map's values.
#pragma once
#include <initializer_list>

#include "common.h"

namespace mpfused::bind {

// Metadata of a quantization map of an 8-bit step op (every backend): 256 contiguous float32 on
// `dev`. Its values (sorted, +0) are checked where they can be read without a sync: on the host by
// the CPU binding, on the device by the CUDA kernel.
// 4-bit ops: `entries` = 16.
inline void check_qmap(const at::Tensor& map, const char* what, const at::Device& dev,
                       int64_t entries = 256) {
  TORCH_CHECK(map.scalar_type() == at::kFloat && map.numel() == entries && map.dim() == 1 &&
                  map.is_contiguous(),
              "mpfused: ", what, " must be a contiguous float32 tensor of ", entries,
              " entries, got ", map.sizes(), " ", map.scalar_type());
  TORCH_CHECK(map.device() == dev, "mpfused: ", what, " must be on ", dev,
              " (the params' device), got ", map.device());
}

// One block-wise 8-bit state of a step op: its code and absmax lists, named as in the schema.
struct Quant8StateArg {
  at::TensorList codes, absmaxs;
  const char* codes_name;
  const char* absmax_name;
};

// Arguments of every step op with block-wise 8-bit state (every backend): lengths, dtypes,
// devices, block size, absmax sizes, masters, step counters, scalars. Returns the params' device.
inline at::Device check_quant8_args(at::TensorList params, at::TensorList grads,
                                    std::initializer_list<Quant8StateArg> states,
                                    at::TensorList masters, at::TensorList steps,
                                    int64_t block_size, int64_t master_mode,
                                    const std::optional<at::Tensor>& grad_scale,
                                    const std::optional<at::Tensor>& found_inf,
                                    const std::optional<at::Tensor>& norm_sq,
                                    int code_bits = 8) {
  const at::Device dev = params[0].device();
  const size_t n = params.size();
  check_same_device(params, dev, "params");
  auto check_length = [n](at::TensorList list, const char* what) {
    TORCH_CHECK(list.size() == n, "mpfused: ", what, " must have the same length as params (",
                n, "), got ", list.size());
  };
  check_length(grads, "grads");
  for (const Quant8StateArg& s : states) {
    check_length(s.codes, s.codes_name);
    check_length(s.absmaxs, s.absmax_name);
  }
  check_length(steps, "steps");
  TORCH_CHECK(block_size >= 64 && block_size <= 4096 && (block_size & (block_size - 1)) == 0,
              "mpfused: block_size must be a power of two in [64, 4096], got ", block_size);
  check_grad_dtypes(params, grads);
  for (const Quant8StateArg& s : states) {
    check_dtypes(s.codes, at::kByte, s.codes_name);
    check_dtypes(s.absmaxs, at::kFloat, s.absmax_name);
    check_same_device(s.codes, dev, s.codes_name);
    check_same_device(s.absmaxs, dev, s.absmax_name);
  }
  for (const Quant8StateArg& s : states)
    for (size_t i = 0; i < n; ++i) {
      if (code_bits == 4) {  // two codes per byte: always used as they lie
        TORCH_CHECK(s.codes[i].numel() == (params[i].numel() + 1) / 2 &&
                        s.codes[i].is_contiguous(),
                    "mpfused: ", s.codes_name, "[", i, "] must be contiguous with ceil(numel / 2) = ",
                    (params[i].numel() + 1) / 2, " bytes (two 4-bit codes each), got ",
                    s.codes[i].numel());
      } else {
        TORCH_CHECK(s.codes[i].numel() == params[i].numel(), "mpfused: ", s.codes_name, "[", i,
                    "] must have its param's ", params[i].numel(), " elements, got ",
                    s.codes[i].numel());
      }
      const int64_t blocks = (params[i].numel() + block_size - 1) / block_size;
      TORCH_CHECK(s.absmaxs[i].numel() == blocks && s.absmaxs[i].is_contiguous(), "mpfused: ",
                  s.absmax_name, "[", i, "] must be contiguous with ceil(numel / block_size) = ",
                  blocks, " entries, got ", s.absmaxs[i].numel());
    }
  check_masters(params, masters, master_mode);
  check_steps_and_scalars(steps, dev, grad_scale, found_inf, norm_sq);
  return dev;
}

// Arguments of adam8bit_step_ (every backend): its two states through check_quant8_args.
inline at::Device check_adam8bit_args(at::TensorList params, at::TensorList grads,
                                      at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                      at::TensorList absmax1s, at::TensorList absmax2s,
                                      at::TensorList masters, at::TensorList steps,
                                      int64_t block_size, int64_t master_mode,
                                      const std::optional<at::Tensor>& grad_scale,
                                      const std::optional<at::Tensor>& found_inf,
                                      const std::optional<at::Tensor>& norm_sq,
                                      int code_bits = 8) {
  const bool four = code_bits == 4;
  return check_quant8_args(
      params, grads,
      {{exp_avgs, absmax1s, four ? "exp_avgs (4-bit codes)" : "exp_avgs (8-bit codes)", "absmax1s"},
       {exp_avg_sqs, absmax2s, four ? "exp_avg_sqs (4-bit codes)" : "exp_avg_sqs (8-bit codes)",
        "absmax2s"}},
      masters, steps, block_size, master_mode, grad_scale, found_inf, norm_sq, code_bits);
}

// ---- 8-bit maps on the CPU --------------------------------------------------------------------
// The values of a map the CPU bindings read on the host (metadata: check_qmap): strictly
// increasing.
inline void check_qmap_values(const at::Tensor& map, const char* what) {
  const float* q = map.data_ptr<float>();
  for (int64_t i = 0; i + 1 < map.numel(); ++i)
    TORCH_CHECK(q[i] < q[i + 1], "mpfused: ", what, " must be strictly increasing (sorted)");
}

// The code of +0 in a signed map (the sign rule steps below it), checked sorted on the host.
inline int32_t cpu_signed_map_zero_code(const at::Tensor& map, const char* what) {
  check_qmap_values(map, what);
  const float* q = map.data_ptr<float>();
  int32_t zero_code = -1;
  for (int i = 0; i < 256; ++i)
    if (q[i] == 0.f && !std::signbit(q[i])) zero_code = i;
  TORCH_CHECK(zero_code > 0, "mpfused: ", what, " must hold +0.0 above its lowest entry");
  return zero_code;
}

}  // namespace mpfused::bind

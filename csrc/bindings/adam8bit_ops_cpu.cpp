// CPU registration of the multi-tensor Adam/AdamW step with block-wise 8-bit moments.
#include <ATen/Parallel.h>

#include "../cpu/adam8bit_cpu.h"
#include "common.h"

namespace mpfused::bind {
namespace {

void check_map(const at::Tensor& map, const char* what) {
  TORCH_CHECK(map.scalar_type() == at::kFloat && map.numel() == 256 && map.dim() == 1 &&
                  map.is_contiguous() && map.device().is_cpu(),
              "mpfused: ", what, " must be a contiguous float32 CPU tensor of 256 entries");
  const float* q = map.data_ptr<float>();
  for (int i = 0; i + 1 < 256; ++i)
    TORCH_CHECK(q[i] < q[i + 1], "mpfused: ", what, " must be strictly increasing (sorted)");
}

// Arguments of adam8bit_step_: lengths, dtypes, devices, masters, step counters, scalars.
void check_adam8bit_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList absmax1s,
                         at::TensorList absmax2s, at::TensorList masters, at::TensorList steps,
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
}

void adam8bit_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList absmax1s,
                       at::TensorList absmax2s, at::TensorList masters, at::TensorList steps,
                       const at::Tensor& qmap1, const at::Tensor& qmap2, int64_t block_size,
                       double lr, const std::optional<at::Tensor>& lr_tensor, double beta1,
                       double beta2, double eps, double weight_decay, bool maximize,
                       bool decoupled, int64_t master_mode,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                       int64_t seed) {
  if (params.empty()) return;
  check_adam8bit_args(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps,
                      block_size, master_mode, grad_scale, found_inf, norm_sq);
  check_map(qmap1, "qmap1 (signed map)");
  check_map(qmap2, "qmap2 (unsigned map)");
  const float* q1 = qmap1.data_ptr<float>();
  int64_t zero_code = -1;
  for (int i = 0; i < 256; ++i)
    if (q1[i] == 0.f && !std::signbit(q1[i])) zero_code = i;
  TORCH_CHECK(zero_code > 0, "mpfused: qmap1 must hold +0.0 above its lowest entry");
  // Skip on found_inf > 0: nothing is touched, step counters included. CPU tensors: no sync.
  if (found_inf && found_inf->item<float>() > 0.f) return;

  float grad_mult = grad_scale ? 1.f / grad_scale->item<float>() : 1.f;
  if (norm_sq && max_grad_norm > 0) {
    const double norm = std::sqrt(double(norm_sq->item<float>()));
    grad_mult *= float(std::min(1.0, max_grad_norm / (norm + 1e-6)));
  }
  const bool has_master = master_mode == kFp32Master || master_mode == kRemainder;
  // Codes follow the logical (row-major) order, so every operand is used contiguous.
  PackedLists<5> packed({params, grads, exp_avgs, exp_avg_sqs,
                         has_master ? masters : at::TensorList()},
                        {true, false, true, true, true}, "params", /*require_logical_order=*/true);
  std::vector<void*> am1(packed.index.size()), am2(packed.index.size());
  std::vector<double> t(packed.index.size());
  for (size_t j = 0; j < t.size(); ++j) {
    const int64_t i = packed.index[j];
    am1[j] = absmax1s[i].data_ptr();
    am2[j] = absmax2s[i].data_ptr();
    t[j] = steps[i].item<double>() + 1.0;
  }
  TensorLists<7> lists{};
  const TensorLists<5> v = packed.view();
  for (int k = 0; k < 5; ++k) lists.data[k] = v.data[k];
  lists.data[cpu::kQAbsmax1] = am1.data();
  lists.data[cpu::kQAbsmax2] = am2.data();
  lists.numel = v.numel;
  lists.dtype = v.dtype;
  lists.size = v.size;
  cpu::Adam8bitConfig cfg{float(lr_tensor ? lr_tensor->item<double>() : lr), beta1, beta2,
                          float(eps), float(weight_decay), grad_mult, maximize,
                          decoupled, int32_t(master_mode), uint64_t(seed), block_size, q1,
                          qmap2.data_ptr<float>(), int32_t(zero_code)};
  cpu::adam8bit_step(lists, t.data(), cfg, at::get_num_threads());
  packed.finish();
  for (const at::Tensor& s : steps) s.add_(1);
}

}  // namespace

TORCH_LIBRARY_IMPL(mpfused, CPU, m) { m.impl("adam8bit_step_", &adam8bit_step_cpu); }

}  // namespace mpfused::bind

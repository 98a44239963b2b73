// CPU registration of the multi-tensor Adam/AdamW step with block-wise 8-bit moments.
#include <ATen/Parallel.h>

#include "../cpu/adam8bit_cpu.h"
#include "common.h"
#include "cpu_steps.h"
#include "op_signatures.h"
#include "quant8_args.h"

namespace mpfused::bind {
namespace {

// BITS = 8: adam8bit_step_; 4: adam4bit_step_ (same schema; 16-entry maps, packed codes, no
// sign rule).
template <int BITS>
void adam_quant_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList absmax1s,
                       at::TensorList absmax2s, at::TensorList masters, at::TensorList steps,
                       const at::Tensor& qmap1, const at::Tensor& qmap2, int64_t block_size,
                       double lr, const std::optional<at::Tensor>& lr_tensor, double beta1,
                       double beta2, double eps, double weight_decay, bool maximize,
                       bool decoupled, int64_t master_mode,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                       int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const at::Device dev =
      check_adam8bit_args(params, grads, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters,
                          steps, block_size, master_mode, grad_scale, found_inf, norm_sq, BITS);
  check_qmap(qmap1, "qmap1 (signed map)", dev, int64_t(1) << BITS);
  check_qmap(qmap2, "qmap2 (unsigned map)", dev, int64_t(1) << BITS);
  int32_t zero_code = -1;  // 4-bit: nearest code, no sign rule (Li et al., torchao)
  if constexpr (BITS == 8) zero_code = cpu_signed_map_zero_code(qmap1, "qmap1 (signed map)");
  else check_qmap_values(qmap1, "qmap1 (signed map)");
  check_qmap_values(qmap2, "qmap2 (unsigned map)");
  // Skip on found_inf > 0: nothing is touched, step counters included. CPU tensors: no sync.
  const std::optional<float> grad_mult = cpu_grad_mult(grad_scale, found_inf, norm_sq, max_grad_norm);
  if (!grad_mult) return;
  const bool has_master = mode_has_masters(master_mode);
  // Codes follow the logical (row-major) order, so every operand is used contiguous. 4-bit codes
  // (checked contiguous, half the size) are taken as they lie, like the absmax.
  const at::TensorList no_list;
  PackedLists<5> packed({params, grads, BITS == 8 ? exp_avgs : no_list,
                         BITS == 8 ? exp_avg_sqs : no_list, has_master ? masters : no_list},
                        {true, false, true, true, true}, "params", /*require_logical_order=*/true);
  std::vector<void*> am1(packed.index.size()), am2(packed.index.size());
  for (size_t j = 0; j < am1.size(); ++j) {
    am1[j] = absmax1s[packed.index[j]].data_ptr();
    am2[j] = absmax2s[packed.index[j]].data_ptr();
    if constexpr (BITS == 4) {
      packed.ptrs[cpu::kQExpAvg][j] = exp_avgs[packed.index[j]].data_ptr();
      packed.ptrs[cpu::kQExpAvgSq][j] = exp_avg_sqs[packed.index[j]].data_ptr();
    }
  }
  const std::vector<double> t = cpu_next_steps(steps, packed.index);
  TensorLists<7> lists{};
  const TensorLists<5> v = packed.view();
  for (int k = 0; k < 5; ++k) lists.data[k] = v.data[k];
  lists.data[cpu::kQAbsmax1] = am1.data();
  lists.data[cpu::kQAbsmax2] = am2.data();
  lists.numel = v.numel;
  lists.dtype = v.dtype;
  lists.size = v.size;
  const std::vector<uint64_t> streams =
      sr_streams(param_ids, elem_offsets, params.size(), packed.index);
  cpu::Adam8bitConfig cfg{host_lr(lr, lr_tensor), beta1, beta2, float(eps), weight_decay,
                          *grad_mult, maximize, decoupled, int32_t(master_mode),
                          uint64_t(seed), streams.data(), block_size, qmap1.data_ptr<float>(),
                          qmap2.data_ptr<float>(), zero_code, BITS};
  cpu::adam8bit_step(lists, t.data(), cfg, at::get_num_threads());
  packed.finish();
  cpu_advance_steps(steps);
}

}  // namespace

static_assert(std::is_same_v<decltype(adam_quant_step_cpu<8>), Adam8bitStepFn>,
              "adam_quant_step_cpu must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CPU, m) {
  m.impl("adam8bit_step_", &adam_quant_step_cpu<8>);
  m.impl("adam4bit_step_", &adam_quant_step_cpu<4>);
}

}  // namespace mpfused::bind

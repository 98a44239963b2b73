// CPU registration of the multi-tensor Lion steps with a block-wise 8-bit (lion8bit_step_) or 4-bit
// (lion4bit_step_: same schema, 16-entry map, packed codes, no sign rule) moment.
#include <ATen/Parallel.h>

#include "common.h"
#include "cpu_steps.h"
#include "one_state8bit_lists.h"
#include "op_signatures.h"
#include "quant8_args.h"

namespace mpfused::bind {
namespace {

template <int BITS>
void lion_quant_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList absmaxs, at::TensorList masters, at::TensorList steps,
                         const at::Tensor& qmap, int64_t block_size, double lr,
                         const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                         double weight_decay, bool maximize, int64_t master_mode,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                         int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const char* codes_name = BITS == 8 ? "exp_avgs (8-bit codes)" : "exp_avgs (4-bit codes)";
  const at::Device dev =
      check_quant8_args(params, grads, {{exp_avgs, absmaxs, codes_name, "absmaxs"}}, masters,
                        steps, block_size, master_mode, grad_scale, found_inf, norm_sq, BITS);
  const int32_t zero_code = one_state_qmap_zero_code<BITS>(qmap, dev);  // 4-bit: -1, no sign rule
  // Skip on found_inf > 0: nothing is touched, step counters included. CPU tensors: no sync.
  const std::optional<float> grad_mult = cpu_grad_mult(grad_scale, found_inf, norm_sq, max_grad_norm);
  if (!grad_mult) return;
  OneState8bitCpuLists l(params, grads, exp_avgs, absmaxs, masters, steps, master_mode,
                         param_ids, elem_offsets, BITS);
  const cpu::Lion8bitConfig cfg{
      state8bit_config(l, qmap, zero_code, block_size, lr, lr_tensor, weight_decay, *grad_mult,
                       maximize, master_mode, seed, BITS),
      beta1, beta2};
  cpu::lion8bit_step(l.lists, l.t.data(), cfg, at::get_num_threads());
  l.finish();
  cpu_advance_steps(steps);
}

}  // namespace

static_assert(std::is_same_v<decltype(lion_quant_step_cpu<8>), Lion8bitStepFn>,
              "lion_quant_step_cpu must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CPU, m) {
  m.impl("lion8bit_step_", &lion_quant_step_cpu<8>);
  m.impl("lion4bit_step_", &lion_quant_step_cpu<4>);  // the same schema (4-bit codes)
}

}  // namespace mpfused::bind

// CPU registration of the multi-tensor SGD steps with a block-wise 8-bit (sgd8bit_step_) or 4-bit
// (sgd4bit_step_: same schema, 16-entry map, packed codes, no sign rule) momentum buffer.
#include <ATen/Parallel.h>

#include "common.h"
#include "cpu_steps.h"
#include "one_state8bit_lists.h"
#include "op_signatures.h"
#include "quant8_args.h"

namespace mpfused::bind {
namespace {

template <int BITS>
void sgd_quant_step_cpu(at::TensorList params, at::TensorList grads,
                        at::TensorList momentum_buffers, at::TensorList absmaxs,
                        at::TensorList masters, at::TensorList steps, const at::Tensor& qmap,
                        int64_t block_size, double lr, const std::optional<at::Tensor>& lr_tensor,
                        double momentum, double dampening, double weight_decay, bool nesterov,
                        bool maximize, int64_t master_mode,
                        const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                        int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const char* codes_name =
      BITS == 8 ? "momentum_buffers (8-bit codes)" : "momentum_buffers (4-bit codes)";
  const at::Device dev = check_quant8_args(
      params, grads, {{momentum_buffers, absmaxs, codes_name, "absmaxs"}}, masters, steps,
      block_size, master_mode, grad_scale, found_inf, norm_sq, BITS);
  // the 8-bit state is the buffer: plain SGD has none (bitsandbytes' SGD8bit refuses it too)
  TORCH_CHECK(momentum > 0, "mpfused: ", BITS == 8 ? "sgd8bit_step_" : "sgd4bit_step_",
              ": momentum must be > 0, got ", momentum);
  const int32_t zero_code = one_state_qmap_zero_code<BITS>(qmap, dev);  // 4-bit: -1, no sign rule
  // Skip on found_inf > 0: nothing is touched, step counters included. CPU tensors: no sync.
  const std::optional<float> grad_mult = cpu_grad_mult(grad_scale, found_inf, norm_sq, max_grad_norm);
  if (!grad_mult) return;
  OneState8bitCpuLists l(params, grads, momentum_buffers, absmaxs, masters, steps, master_mode,
                         param_ids, elem_offsets, BITS);
  const cpu::Sgd8bitConfig cfg{
      state8bit_config(l, qmap, zero_code, block_size, lr, lr_tensor, weight_decay, *grad_mult,
                       maximize, master_mode, seed, BITS),
      momentum, dampening, nesterov};
  cpu::sgd8bit_step(l.lists, l.t.data(), cfg, at::get_num_threads());
  l.finish();
  cpu_advance_steps(steps);
}

}  // namespace

static_assert(std::is_same_v<decltype(sgd_quant_step_cpu<8>), Sgd8bitStepFn>,
              "sgd_quant_step_cpu must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CPU, m) {
  m.impl("sgd8bit_step_", &sgd_quant_step_cpu<8>);
  m.impl("sgd4bit_step_", &sgd_quant_step_cpu<4>);  // the same schema (4-bit codes)
}

}  // namespace mpfused::bind

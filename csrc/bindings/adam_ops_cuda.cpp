// CUDA registration of the multi-tensor Adam/AdamW step. Same checks as the CPU binding; the
// step counters, grad_scale, found_inf, norm_sq and (optionally) lr are read by the kernel on the
// device, and the counters are incremented by a second launch unless found_inf > 0: no host sync
// on any path (capturable).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../cuda/adam_cuda.h"
#include "common.h"
#include "op_signatures.h"
#include "cuda_steps.h"

namespace mpfused::bind {
namespace {

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                    at::TensorList masters, at::TensorList steps, double lr,
                    const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize, bool decoupled,
                    int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed,
                    at::IntArrayRef param_ids, at::IntArrayRef elem_offsets) {
  if (params.empty()) return;
  const at::Device dev =
      check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps,
                      amsgrad, master_mode, grad_scale, found_inf, norm_sq);
  TORCH_CHECK(dev.is_cuda(), "mpfused: params must be CUDA tensors here, got ", dev);

  const c10::cuda::CUDAGuard guard(dev);
  // lr: a CUDA tensor is read by the kernel (cast to float32 on the device if needed); a CPU
  // tensor is read here (a host read, not a device sync).
  const LrArg lr_arg = resolve_lr(lr, lr_tensor, dev);

  const bool has_master = master_mode == kFp32Master || master_mode == kRemainder;
  // Stochastic rounding draws per logical element index (as the reference): such tensors must
  // be visited in logical order, so non-contiguous ones are staged.
  PackedLists<6> packed({params, grads, exp_avgs, exp_avg_sqs,
                         amsgrad ? max_exp_avg_sqs : at::TensorList(),
                         has_master ? masters : at::TensorList()},
                        {true, false, true, true, true, true}, "params",
                        /*require_logical_order=*/master_mode == kStochastic);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!packed.numel.empty()) {
    // Operand kStep: the counter of each packed param (same positions as the other operands).
    std::vector<void*> step_ptrs;
    step_ptrs.reserve(packed.index.size());
    for (const int64_t i : packed.index) step_ptrs.push_back(steps[i].data_ptr());
    TensorLists<cuda::kAdamDepth> lists;
    for (int k = 0; k < 6; ++k) lists.data[k] = packed.ptrs[k].data();
    lists.data[cuda::kStep] = step_ptrs.data();
    const std::vector<void*> streams = stream_operand(param_ids, elem_offsets, params.size(),
                                                      packed.index);
    lists.data[cuda::kStream] = streams.data();
    lists.numel = packed.numel.data();
    lists.dtype = packed.dtype.data();
    lists.size = int64_t(packed.numel.size());
    cuda::AdamConfig cfg{};
    fill_adam_config(cfg, lr_arg, beta1, beta2, eps, weight_decay, grad_scale, found_inf, norm_sq,
                     max_grad_norm, maximize, decoupled, master_mode, seed);
    cfg.amsgrad = amsgrad;
    C10_CUDA_CHECK(cuda::adam_step(lists, cfg, stream));
    packed.finish();  // staged copies hold the original values on a skipped step: no-op writes
  }
  advance_steps_cuda(steps, found_inf, stream);
}

}  // namespace

static_assert(std::is_same_v<decltype(adam_step_cuda), AdamStepFn>,
              "adam_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) { m.impl("adam_step_", &adam_step_cuda); }

}  // namespace mpfused::bind

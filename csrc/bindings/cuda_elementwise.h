// The torch side of a CUDA elementwise step (cuda::adam_step, sgd_step, lion_step: the operands of
// elementwise_step.h), written once: device guard, lr, packing, the step and stream operands, the
// device scalars of StepCommon, the launch, then the step counters. Every scalar the kernel
// needs is read on the device, so no path syncs with the host (capturable).
#pragma once
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <optional>
#include <vector>

#include "../cuda/elementwise_step.h"
#include "common.h"
#include "cuda_steps.h"

namespace mpfused::bind {

// Runs one step on the checked arguments (dev: the check's device). `states`: the op's K fp32
// state lists in operand order; an empty one is absent (null pointers: SGD without momentum).
// launch(const TensorLists<kEwFixed + K>&, const cuda::StepCommon&, cudaStream_t) -> cudaError_t
// fills the op's config around `common` and calls its kernel.
template <int K, typename Launch>
void run_elementwise_cuda(const at::Device& dev, at::TensorList params, at::TensorList grads,
                          const std::array<at::TensorList, K>& states, at::TensorList masters,
                          at::TensorList steps, double lr,
                          const std::optional<at::Tensor>& lr_tensor, bool maximize,
                          int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf,
                          const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                          int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets,
                          Launch&& launch) {
  TORCH_CHECK(dev.is_cuda(), "mpfused: params must be CUDA tensors here, got ", dev);
  const c10::cuda::CUDAGuard guard(dev);
  // lr: a CUDA tensor is read by the kernel (cast to float32 on the device if needed); a CPU
  // tensor is read here (a host read, not a device sync).
  const LrArg lr_arg = resolve_lr(lr, lr_tensor, dev);

  const bool has_master = mode_has_masters(master_mode);
  // PackedLists order: param, grad, master, then the states. Stochastic rounding draws per
  // logical element index (as the reference): such tensors are visited in logical order, so
  // non-contiguous ones are staged.
  std::array<at::TensorList, 3 + K> lists{params, grads,
                                          has_master ? masters : at::TensorList()};
  std::array<bool, 3 + K> mutated{true, false, true};
  for (int k = 0; k < K; ++k) {
    lists[3 + k] = states[k];
    mutated[3 + k] = true;
  }
  PackedLists<3 + K> packed(lists, mutated, "params",
                            /*require_logical_order=*/master_mode == kStochastic);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!packed.numel.empty()) {
    // Operand kEwStep: the counter of each packed param (same positions as the other operands).
    std::vector<void*> step_ptrs;
    step_ptrs.reserve(packed.index.size());
    for (const int64_t i : packed.index) step_ptrs.push_back(steps[i].data_ptr());
    const std::vector<void*> streams =
        stream_operand(param_ids, elem_offsets, params.size(), packed.index);
    TensorLists<cuda::kEwFixed + K> t{};
    t.data[cuda::kEwParam] = packed.ptrs[0].data();
    t.data[cuda::kEwGrad] = packed.ptrs[1].data();
    t.data[cuda::kEwMaster] = packed.ptrs[2].data();
    t.data[cuda::kEwStep] = step_ptrs.data();
    t.data[cuda::kEwStream] = streams.data();
    for (int k = 0; k < K; ++k) t.data[cuda::kEwState + k] = packed.ptrs[3 + k].data();
    t.numel = packed.numel.data();
    t.dtype = packed.dtype.data();
    t.size = int64_t(packed.numel.size());
    cuda::StepCommon common{};
    common.lr = lr_arg.value;
    common.lr_ptr =
        lr_arg.device_tensor.defined() ? lr_arg.device_tensor.data_ptr<float>() : nullptr;
    common.grad_scale = grad_scale ? grad_scale->data_ptr<float>() : nullptr;
    common.found_inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
    common.norm_sq = norm_sq ? norm_sq->data_ptr<float>() : nullptr;
    common.max_grad_norm = max_grad_norm;
    common.maximize = maximize;
    common.master_mode = int32_t(master_mode);
    common.seed = uint64_t(seed);
    C10_CUDA_CHECK(launch(t, common, stream));
    packed.finish();  // staged copies hold the original values on a skipped step: no-op writes
  }
  advance_steps_cuda(steps, found_inf, stream);
}

}  // namespace mpfused::bind

// The torch side of a CUDA one-state 8-bit or 4-bit step (cuda::sgd8bit_step, lion8bit_step: the
// operands of one_state8bit_cuda.h), written once: device guard, lr, packing, the absmax / step /
// stream operands, the device scalars, the per-step workspace, the launch, then the step
// counters. The map's values are checked by the kernel on the device, not here: no path syncs
// with the host (capturable). The workspace is a byte tensor from torch's caching allocator on
// the current stream (a CUDA graph capture's private pool while capturing), freed when the call
// returns: stream order keeps it alive for the launches.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <vector>

#include "../cuda/one_state8bit_cuda.h"
#include "common.h"
#include "cuda_steps.h"

namespace mpfused::bind {

// Runs one step on the checked arguments (dev: the check's device) with BITS-bit codes (8 | 4).
// launch(const TensorLists<kOneState8bitDepth>&, const cuda::State8bitCommon& q, workspace,
// cudaStream_t) -> cudaError_t fills the op's config around q and calls its kernel;
// workspace(bytes) returns a byte tensor on the device for it (keep it until the launch call
// returns).
template <int BITS, typename Launch>
void run_one_state8bit_cuda(const at::Device& dev, at::TensorList params, at::TensorList grads,
                            at::TensorList codes, at::TensorList absmaxs, at::TensorList masters,
                            at::TensorList steps, const at::Tensor& qmap, int64_t block_size,
                            double lr, const std::optional<at::Tensor>& lr_tensor, bool maximize,
                            int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& found_inf,
                            const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                            int64_t seed, at::IntArrayRef param_ids,
                            at::IntArrayRef elem_offsets, Launch&& launch) {
  TORCH_CHECK(dev.is_cuda(), "mpfused: params must be CUDA tensors here, got ", dev);
  const c10::cuda::CUDAGuard guard(dev);
  // lr: a CUDA tensor is read by the kernel (cast to float32 on the device if needed); a CPU
  // tensor is read here (a host read, not a device sync).
  const LrArg lr_arg = resolve_lr(lr, lr_tensor, dev);

  const bool has_master = mode_has_masters(master_mode);
  // Codes follow the logical (row-major) order, so every operand is used contiguous: the others
  // are staged (device copies, written back by finish()). 4-bit codes (checked contiguous, half
  // the size) are taken as they lie, like the absmax.
  const at::TensorList no_list;
  PackedLists<4> packed({params, grads, BITS == 8 ? codes : no_list,
                         has_master ? masters : no_list},
                        {true, false, true, true}, "params", /*require_logical_order=*/true);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!packed.numel.empty()) {
    // The absmax operand and the step counter of each packed param (same positions).
    std::vector<void*> am, step_ptrs;
    am.reserve(packed.index.size());
    step_ptrs.reserve(packed.index.size());
    for (size_t j = 0; j < packed.index.size(); ++j) {
      const int64_t i = packed.index[j];
      am.push_back(absmaxs[i].data_ptr());
      step_ptrs.push_back(steps[i].data_ptr());
      if constexpr (BITS == 4) packed.ptrs[cuda::kS8State][j] = codes[i].data_ptr();
    }
    const std::vector<void*> streams =
        stream_operand(param_ids, elem_offsets, params.size(), packed.index);
    TensorLists<cuda::kOneState8bitDepth> lists{};
    for (int k = 0; k < 4; ++k) lists.data[k] = packed.ptrs[k].data();
    lists.data[cuda::kS8Absmax] = am.data();
    lists.data[cuda::kS8Step] = step_ptrs.data();
    lists.data[cuda::kS8Stream] = streams.data();
    lists.numel = packed.numel.data();
    lists.dtype = packed.dtype.data();
    lists.size = int64_t(packed.numel.size());
    cuda::State8bitCommon q{};
    cuda::StepCommon& common = q.common;
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
    q.block_size = block_size;
    q.map = qmap.data_ptr<float>();
    q.code_bits = BITS;
    auto workspace = [&](size_t bytes) {
      return at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).device(dev));
    };
    C10_CUDA_CHECK(launch(lists, q, workspace, stream));
    packed.finish();  // staged copies hold the original values on a skipped step: no-op writes
  }
  advance_steps_cuda(steps, found_inf, stream);
}

}  // namespace mpfused::bind

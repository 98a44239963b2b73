// CUDA registration of the multi-tensor Adam/AdamW step with block-wise 8-bit moments
// (adam8bit_step_) and 4-bit ones (adam4bit_step_: the same kernel specialized on the code width,
// as on the CPU). Same checks as the CPU binding (common.h, quant8_args.h), except the map
// values: the step counters, lr (optionally), grad_scale, found_inf, norm_sq and both
// quantization maps are read by the kernels on the device
// (which check the maps themselves, see cuda/adam8bit_cuda.h), and the counters are incremented by
// a last launch unless found_inf > 0: no host sync on any path (capturable). The kernels' per-step
// workspace is a byte tensor from torch's caching allocator on the current stream (a CUDA graph
// capture's private pool while capturing), freed when the call returns: stream order keeps it
// alive for the launches.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../cuda/adam8bit_cuda.h"
#include "common.h"
#include "op_signatures.h"
#include "quant8_args.h"
#include "cuda_steps.h"

namespace mpfused::bind {
namespace {

// BITS = 8: adam8bit_step_; 4: adam4bit_step_ (same schema; 16-entry maps, packed codes, no
// sign rule).
template <int BITS>
void adam_quant_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
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
  TORCH_CHECK(dev.is_cuda(), "mpfused: params must be CUDA tensors here, got ", dev);
  check_qmap(qmap1, "qmap1 (signed map)", dev, int64_t(1) << BITS);
  check_qmap(qmap2, "qmap2 (unsigned map)", dev, int64_t(1) << BITS);

  const c10::cuda::CUDAGuard guard(dev);
  // lr: a CUDA tensor is read by the kernel (cast to float32 on the device if needed); a CPU
  // tensor is read here (a host read, not a device sync). As adam_step_'s CUDA binding.
  const LrArg lr_arg = resolve_lr(lr, lr_tensor, dev);

  const bool has_master = mode_has_masters(master_mode);
  // Codes follow the logical (row-major) order, so every operand is used contiguous: the others
  // are staged (device copies, written back by finish()). 4-bit codes (checked contiguous, half
  // the size) are taken as they lie, like the absmax.
  const at::TensorList no_list;
  PackedLists<5> packed({params, grads, BITS == 8 ? exp_avgs : no_list,
                         BITS == 8 ? exp_avg_sqs : no_list, has_master ? masters : no_list},
                        {true, false, true, true, true}, "params", /*require_logical_order=*/true);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (!packed.numel.empty()) {
    // The absmax operands and the step counter of each packed param (same positions).
    std::vector<void*> am1, am2, step_ptrs;
    am1.reserve(packed.index.size());
    am2.reserve(packed.index.size());
    step_ptrs.reserve(packed.index.size());
    for (size_t j = 0; j < packed.index.size(); ++j) {
      const int64_t i = packed.index[j];
      am1.push_back(absmax1s[i].data_ptr());
      am2.push_back(absmax2s[i].data_ptr());
      step_ptrs.push_back(steps[i].data_ptr());
      if constexpr (BITS == 4) {
        packed.ptrs[cuda::kQ8ExpAvg][j] = exp_avgs[i].data_ptr();
        packed.ptrs[cuda::kQ8ExpAvgSq][j] = exp_avg_sqs[i].data_ptr();
      }
    }
    TensorLists<cuda::kAdam8bitDepth> lists;
    for (int k = 0; k < 5; ++k) lists.data[k] = packed.ptrs[k].data();
    lists.data[cuda::kQ8Absmax1] = am1.data();
    lists.data[cuda::kQ8Absmax2] = am2.data();
    lists.data[cuda::kQ8Step] = step_ptrs.data();
    const std::vector<void*> streams = stream_operand(param_ids, elem_offsets, params.size(),
                                                      packed.index);
    lists.data[cuda::kQ8Stream] = streams.data();
    lists.numel = packed.numel.data();
    lists.dtype = packed.dtype.data();
    lists.size = int64_t(packed.numel.size());
    cuda::Adam8bitConfig cfg{};
    fill_adam_config(cfg, lr_arg, beta1, beta2, eps, weight_decay, grad_scale, found_inf, norm_sq,
                     max_grad_norm, maximize, decoupled, master_mode, seed);
    cfg.block_size = block_size;
    cfg.map1 = qmap1.data_ptr<float>();
    cfg.map2 = qmap2.data_ptr<float>();
    cfg.code_bits = BITS;
    const at::Tensor workspace =
        at::empty({int64_t(cuda::adam8bit_workspace_bytes(lists.size))},
                  at::TensorOptions().dtype(at::kByte).device(dev));
    C10_CUDA_CHECK(cuda::adam8bit_step(lists, cfg, workspace.data_ptr(), stream));
    packed.finish();  // staged copies hold the original values on a skipped step: no-op writes
  }
  advance_steps_cuda(steps, found_inf, stream);
}

}  // namespace

static_assert(std::is_same_v<decltype(adam_quant_step_cuda<8>), Adam8bitStepFn>,
              "adam_quant_step_cuda must keep the C++ signature BoundLists calls the op with");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) {
  m.impl("adam8bit_step_", &adam_quant_step_cuda<8>);
  m.impl("adam4bit_step_", &adam_quant_step_cuda<4>);
}

}  // namespace mpfused::bind

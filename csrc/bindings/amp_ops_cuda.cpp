// CUDA registrations of the loss-scaling ops (schemas are defined once, in mpfused/ops/). Same
// checks as the CPU bindings; kernels run on the current stream of the grads' device and every
// scalar (inv_scale, found_inf, norm_sq, scale, trackers) stays on the device: no host sync on
// any path, so the ops work under torch.cuda.set_sync_debug_mode("error") and in CUDA graphs.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../cuda/amp_cuda.h"
#include "common.h"
#include "op_signatures.h"

namespace mpfused::bind {
namespace {

void amp_check_impl(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                    const std::optional<at::Tensor>& norm_sq,
                    const std::optional<at::Tensor>& norm_sq_per_tensor, bool write_back) {
  if (grads.empty()) return;
  const at::Device dev = check_amp_args(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor);
  TORCH_CHECK(dev.is_cuda(), "mpfused: grads must be CUDA tensors here, got ", dev);
  const c10::cuda::CUDAGuard guard(dev);
  PackedLists<1> packed({grads}, {write_back}, "grads");
  if (packed.numel.empty()) return;  // only empty tensors: nothing to check or add
  // Per-tensor outputs as device pointers into the caller's tensor, one per packed (non-empty)
  // grad: the kernel adds to them directly, no index tensor to upload.
  std::vector<float*> per;
  if (norm_sq_per_tensor) {
    float* base = norm_sq_per_tensor->data_ptr<float>();
    per.reserve(packed.index.size());
    for (const int64_t i : packed.index) per.push_back(base + i);
  }
  const TensorLists<1> view = packed.view();
  const bool norm = norm_sq.has_value() || norm_sq_per_tensor.has_value();
  const int64_t ws_bytes = cuda::amp_check_workspace_bytes(view, norm, !per.empty());
  // Scratch from the caching allocator: stream-ordered reuse, private pool under graph capture.
  at::Tensor workspace;
  if (ws_bytes > 0) workspace = at::empty({ws_bytes}, found_inf.options().dtype(at::kByte));
  C10_CUDA_CHECK(cuda::amp_check(view, inv_scale.data_ptr<float>(), write_back,
                                 found_inf.data_ptr<float>(),
                                 norm_sq ? norm_sq->data_ptr<float>() : nullptr,
                                 per.empty() ? nullptr : per.data(),
                                 workspace.defined() ? workspace.data_ptr() : nullptr,
                                 at::cuda::getCurrentCUDAStream()));
  packed.finish();
}

void unscale_grads_cuda(at::TensorList grads, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale, const std::optional<at::Tensor>& norm_sq,
                        const std::optional<at::Tensor>& norm_sq_per_tensor) {
  amp_check_impl(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, true);
}

void check_grads_cuda(at::TensorList grads, const at::Tensor& found_inf,
                      const at::Tensor& inv_scale, const std::optional<at::Tensor>& norm_sq,
                      const std::optional<at::Tensor>& norm_sq_per_tensor) {
  amp_check_impl(grads, found_inf, inv_scale, norm_sq, norm_sq_per_tensor, false);
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis, double min_scale, double max_scale,
                       bool consecutive_hysteresis) {
  check_update_scale_args(scale, growth_tracker, hysteresis_tracker, found_inf);
  const at::Device dev = scale.device();
  const c10::cuda::CUDAGuard guard(dev);
  C10_CUDA_CHECK(cuda::update_scale(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(),
      ScaleUpdateParams{growth_factor, backoff_factor, growth_interval, int32_t(hysteresis),
                        float(min_scale), float(max_scale), consecutive_hysteresis},
      at::cuda::getCurrentCUDAStream()));
}

}  // namespace

static_assert(std::is_same_v<decltype(check_grads_cuda), CheckGradsFn>,
              "check_grads: the signature BoundLists calls (op_signatures.h)");

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) {
  m.impl("unscale_grads_", &unscale_grads_cuda);
  m.impl("check_grads", &check_grads_cuda);
  m.impl("update_scale_", &update_scale_cuda);
}

}  // namespace mpfused::bind

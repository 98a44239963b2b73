// CUDA registration of the multi-tensor Adam/AdamW step. Same checks as the CPU binding; the
// step counters, grad_scale, found_inf, norm_sq and (optionally) lr are read by the kernel on the
// device, and the counters are incremented by a second launch unless found_inf > 0: no host sync
// on any path (capturable).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../cuda/adam_cuda.h"
#include "common.h"

namespace mpfused::bind {
namespace {

void check_same_device(at::TensorList list, const at::Device& dev, const char* what) {
  for (size_t i = 0; i < list.size(); ++i)
    TORCH_CHECK(list[i].device() == dev, "mpfused: ", what, "[", i, "] is on ", list[i].device(),
                " but params[0] is on ", dev, "; all tensors must be on one device");
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                    at::TensorList masters, at::TensorList steps, double lr,
                    const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize, bool decoupled,
                    int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed) {
  if (params.empty()) return;
  const at::Device dev = params[0].device();
  TORCH_CHECK(dev.is_cuda(), "mpfused: params must be CUDA tensors here, got ", dev);
  // PackedLists checks each tensor's operands against its param; params against each other here.
  check_same_device(params, dev, "params");
  // Before indexing grads[i] below; PackedLists would treat an empty moment list as absent.
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                  exp_avg_sqs.size() == params.size(),
              "mpfused: params, grads, exp_avgs and exp_avg_sqs must have the same length (",
              params.size(), ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(),
              ")");
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK(grads[i].scalar_type() == params[i].scalar_type(), "mpfused: grads[", i,
                "] must have its param's dtype ", params[i].scalar_type(), ", got ",
                grads[i].scalar_type());
  check_dtypes(exp_avgs, at::kFloat, "exp_avgs");
  check_dtypes(exp_avg_sqs, at::kFloat, "exp_avg_sqs");
  check_dtypes(max_exp_avg_sqs, at::kFloat, "max_exp_avg_sqs");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == params.size(),
              "mpfused: amsgrad needs one max_exp_avg_sq per param");
  if (master_mode == kFp32Master) check_dtypes(masters, at::kFloat, "masters");
  if (master_mode == kRemainder) check_dtypes(masters, at::kShort, "masters (remainders)");
  TORCH_CHECK(steps.size() == params.size(), "mpfused: one step tensor per param is required");
  // The kernel reads each counter through a float pointer on the device (capturable steps).
  for (size_t i = 0; i < steps.size(); ++i)
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat &&
                    steps[i].device() == dev,
                "mpfused: steps[", i, "] must be a 1-element float32 tensor on ", dev, ", got ",
                steps[i].sizes(), " ", steps[i].scalar_type(), " on ", steps[i].device());
  if (grad_scale) check_scalar_f32(*grad_scale, "grad_scale", dev);
  if (found_inf) check_scalar_f32(*found_inf, "found_inf", dev);
  if (norm_sq) check_scalar_f32(*norm_sq, "norm_sq", dev);

  const c10::cuda::CUDAGuard guard(dev);
  // lr: a CUDA tensor is read by the kernel (cast to float32 on the device if needed); a CPU
  // tensor is read here (a host read, not a device sync).
  float lr_value = float(lr);
  at::Tensor lr_dev;
  if (lr_tensor) {
    TORCH_CHECK(lr_tensor->numel() == 1, "mpfused: lr_tensor must have one element, got ",
                lr_tensor->sizes());
    if (lr_tensor->device().is_cpu()) {
      lr_value = float(lr_tensor->item<double>());
    } else {
      TORCH_CHECK(lr_tensor->device() == dev, "mpfused: lr_tensor must be on ", dev,
                  " (the params' device) or on the CPU, got ", lr_tensor->device());
      lr_dev = lr_tensor->scalar_type() == at::kFloat ? *lr_tensor : lr_tensor->to(at::kFloat);
    }
  }

  const bool has_master = master_mode == kFp32Master || master_mode == kRemainder;
  // A 16-bit param whose mode needs the master must have one (pick_kernel's dispatch): without
  // this check a missing masters list would be a null pointer in the kernel.
  if (has_master && masters.empty())
    for (size_t i = 0; i < params.size(); ++i)
      TORCH_CHECK(params[i].scalar_type() == at::kFloat ||
                      (master_mode == kRemainder && params[i].scalar_type() == at::kHalf) ||
                      params[i].numel() == 0,
                  "mpfused: master_mode ", master_mode, " needs one master per param (params[",
                  i, "] is ", params[i].scalar_type(), ")");
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
    lists.numel = packed.numel.data();
    lists.dtype = packed.dtype.data();
    lists.size = int64_t(packed.numel.size());
    cuda::AdamConfig cfg{};
    cfg.lr = lr_value;
    cfg.lr_ptr = lr_dev.defined() ? lr_dev.data_ptr<float>() : nullptr;
    cfg.beta1 = float(beta1);
    cfg.beta2 = float(beta2);
    cfg.eps = float(eps);
    cfg.weight_decay = float(weight_decay);
    cfg.grad_scale = grad_scale ? grad_scale->data_ptr<float>() : nullptr;
    cfg.found_inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
    cfg.norm_sq = norm_sq ? norm_sq->data_ptr<float>() : nullptr;
    cfg.max_grad_norm = max_grad_norm;
    cfg.amsgrad = amsgrad;
    cfg.maximize = maximize;
    cfg.decoupled = decoupled;
    cfg.master_mode = int32_t(master_mode);
    cfg.seed = uint64_t(seed);
    C10_CUDA_CHECK(cuda::adam_step(lists, cfg, stream));
    packed.finish();  // staged copies hold the original values on a skipped step: no-op writes
  }
  // Every counter advances (empty params included, as on the CPU), unless found_inf > 0.
  std::vector<float*> all_steps;
  all_steps.reserve(steps.size());
  for (const at::Tensor& s : steps) all_steps.push_back(s.data_ptr<float>());
  C10_CUDA_CHECK(cuda::increment_steps(all_steps.data(), int64_t(all_steps.size()),
                                       found_inf ? found_inf->data_ptr<float>() : nullptr,
                                       stream));
}

}  // namespace

TORCH_LIBRARY_IMPL(mpfused, CUDA, m) { m.impl("adam_step_", &adam_step_cuda); }

}  // namespace mpfused::bind

// The thin torch layer shared by all bindings: argument checks with clear messages, dtype mapping,
// and packing of at::Tensor lists into the torch-free TensorLists the kernels take.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <vector>

#include "mpfused/adam_math.h"
#include "mpfused/tensor_list.h"

namespace mpfused::bind {

inline int32_t dtype_code(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default:
      TORCH_CHECK(false, "mpfused: ", what, " must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

// Every tensor of `list` has dtype `want` (or, when `like` is given, the dtype of like[i]).
inline void check_dtypes(at::TensorList list, at::ScalarType want, const char* what) {
  for (size_t i = 0; i < list.size(); ++i)
    TORCH_CHECK(list[i].scalar_type() == want, "mpfused: ", what, "[", i, "] must be ", want,
                ", got ", list[i].scalar_type());
}

inline void check_scalar_f32(const at::Tensor& t, const char* what, const at::Device& dev) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat,
              "mpfused: ", what, " must be a 1-element float32 tensor, got ", t.sizes(), " ",
              t.scalar_type());
  TORCH_CHECK(t.device() == dev, "mpfused: ", what, " must be on ", dev, " (the grads' device), got ",
              t.device());
}

// Every tensor of `list` on `dev` (a multi-tensor kernel runs on one device).
inline void check_same_device(at::TensorList list, const at::Device& dev, const char* what) {
  for (size_t i = 0; i < list.size(); ++i)
    TORCH_CHECK(list[i].device() == dev, "mpfused: ", what, "[", i, "] is on ", list[i].device(),
                " but ", what, "[0] is on ", dev, "; all tensors must be on one device");
}

// Arguments of unscale_grads_/check_grads (every backend): returns the grads' device.
inline at::Device check_amp_args(at::TensorList grads, const at::Tensor& found_inf,
                                 const at::Tensor& inv_scale,
                                 const std::optional<at::Tensor>& norm_sq,
                                 const std::optional<at::Tensor>& norm_sq_per_tensor) {
  const at::Device dev = grads[0].device();
  check_same_device(grads, dev, "grads");
  check_scalar_f32(found_inf, "found_inf", dev);
  check_scalar_f32(inv_scale, "inv_scale", dev);
  if (norm_sq) check_scalar_f32(*norm_sq, "norm_sq", dev);
  if (norm_sq_per_tensor)
    TORCH_CHECK(norm_sq_per_tensor->numel() == int64_t(grads.size()) &&
                    norm_sq_per_tensor->scalar_type() == at::kFloat &&
                    norm_sq_per_tensor->is_contiguous() && norm_sq_per_tensor->device() == dev,
                "mpfused: norm_sq_per_tensor must be a contiguous float32 tensor of len(grads) "
                "on the grads' device ", dev);
  return dev;
}

// ---- shared checks of the step ops -------------------------------------------------------------
// grads[i] has the dtype of params[i] (the kernels read both through one element type).
inline void check_grad_dtypes(at::TensorList params, at::TensorList grads) {
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK(grads[i].scalar_type() == params[i].scalar_type(), "mpfused: grads[", i,
                "] must have its param's dtype ", params[i].scalar_type(), ", got ",
                grads[i].scalar_type());
}

// Whether master_mode reads a masters list (MasterStore<MODE>::kStored).
inline bool mode_has_masters(int64_t master_mode) {
  return master_mode == kFp32Master || master_mode == kRemainder || master_mode == kRemainder8;
}

// Masters of master_mode: fp32 masters, int16 remainders or int8 corrections (remainder8, bf16
// or fp32 params only), one per param whose mode needs it (a missing one would be a null pointer
// in the kernel).
inline void check_masters(at::TensorList params, at::TensorList masters, int64_t master_mode) {
  TORCH_CHECK(master_mode >= kNoMaster && master_mode <= kRemainder8,
              "mpfused: master_mode must be 0 (none), 1 (fp32), 2 (remainder), 3 (stochastic) or "
              "4 (remainder8), got ", master_mode);
  if (master_mode == kFp32Master) check_dtypes(masters, at::kFloat, "masters");
  if (master_mode == kRemainder) check_dtypes(masters, at::kShort, "masters (remainders)");
  if (master_mode == kRemainder8) {
    check_dtypes(masters, at::kChar, "masters (remainder8 corrections)");
    for (size_t i = 0; i < params.size(); ++i)
      TORCH_CHECK(params[i].scalar_type() != at::kHalf, "mpfused: master_mode 4 (remainder8) "
                  "needs bfloat16 (or float32) params: params[", i, "] is float16, which is not "
                  "the top half of an fp32 word");
  }
  if (!mode_has_masters(master_mode)) return;
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK(masters.size() == params.size() || params[i].scalar_type() == at::kFloat ||
                    (master_mode == kRemainder && params[i].scalar_type() == at::kHalf) ||
                    params[i].numel() == 0,
                "mpfused: master_mode ", master_mode, " needs one master per param (params[",
                i, "] is ", params[i].scalar_type(), ")");
}

// Step counters (1-element float32 on the params' device) and the optional AMP scalars.
inline void check_steps_and_scalars(at::TensorList steps, const at::Device& dev,
                                    const std::optional<at::Tensor>& grad_scale,
                                    const std::optional<at::Tensor>& found_inf,
                                    const std::optional<at::Tensor>& norm_sq) {
  for (size_t i = 0; i < steps.size(); ++i)
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat &&
                    steps[i].device() == dev,
                "mpfused: steps[", i, "] must be a 1-element float32 tensor on ", dev, ", got ",
                steps[i].sizes(), " ", steps[i].scalar_type(), " on ", steps[i].device());
  if (grad_scale) check_scalar_f32(*grad_scale, "grad_scale", dev);
  if (found_inf) check_scalar_f32(*found_inf, "found_inf", dev);
  if (norm_sq) check_scalar_f32(*norm_sq, "norm_sq", dev);
}

// Arguments of adam_step_ (every backend): lengths, dtypes, devices, step counters, scalars.
// Returns the params' device.
inline at::Device check_adam_args(at::TensorList params, at::TensorList grads,
                                  at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                  at::TensorList max_exp_avg_sqs, at::TensorList masters,
                                  at::TensorList steps, bool amsgrad, int64_t master_mode,
                                  const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& norm_sq) {
  const at::Device dev = params[0].device();
  check_same_device(params, dev, "params");
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                  exp_avg_sqs.size() == params.size() && steps.size() == params.size(),
              "mpfused: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length (",
              params.size(), ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(),
              ", ", steps.size(), ")");
  check_grad_dtypes(params, grads);
  check_dtypes(exp_avgs, at::kFloat, "exp_avgs");
  check_dtypes(exp_avg_sqs, at::kFloat, "exp_avg_sqs");
  check_dtypes(max_exp_avg_sqs, at::kFloat, "max_exp_avg_sqs");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == params.size(),
              "mpfused: amsgrad needs one max_exp_avg_sq per param");
  check_masters(params, masters, master_mode);
  check_steps_and_scalars(steps, dev, grad_scale, found_inf, norm_sq);
  return dev;
}

// Arguments of sgd_step_ (every backend): as adam_step_'s; momentum != 0 needs one fp32 buffer
// per param (momentum == 0: the buffers are not read). Returns the params' device.
inline at::Device check_sgd_args(at::TensorList params, at::TensorList grads,
                                 at::TensorList momentum_buffers, at::TensorList masters,
                                 at::TensorList steps, double momentum, int64_t master_mode,
                                 const std::optional<at::Tensor>& grad_scale,
                                 const std::optional<at::Tensor>& found_inf,
                                 const std::optional<at::Tensor>& norm_sq) {
  const at::Device dev = params[0].device();
  check_same_device(params, dev, "params");
  TORCH_CHECK(grads.size() == params.size() && steps.size() == params.size(),
              "mpfused: params, grads and steps must have the same length (", params.size(),
              ", ", grads.size(), ", ", steps.size(), ")");
  check_grad_dtypes(params, grads);
  if (momentum != 0) {
    TORCH_CHECK(momentum_buffers.size() == params.size(), "mpfused: momentum != 0 needs one "
                "momentum buffer per param (", params.size(), "), got ", momentum_buffers.size());
    check_dtypes(momentum_buffers, at::kFloat, "momentum_buffers");
  }
  check_masters(params, masters, master_mode);
  check_steps_and_scalars(steps, dev, grad_scale, found_inf, norm_sq);
  return dev;
}

// Arguments of lion_step_ (every backend): as adam_step_'s, one fp32 exp_avg per param. Returns
// the params' device.
inline at::Device check_lion_args(at::TensorList params, at::TensorList grads,
                                  at::TensorList exp_avgs, at::TensorList masters,
                                  at::TensorList steps, int64_t master_mode,
                                  const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& norm_sq) {
  const at::Device dev = params[0].device();
  check_same_device(params, dev, "params");
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                  steps.size() == params.size(),
              "mpfused: params, grads, exp_avgs and steps must have the same length (",
              params.size(), ", ", grads.size(), ", ", exp_avgs.size(), ", ", steps.size(), ")");
  check_grad_dtypes(params, grads);
  check_dtypes(exp_avgs, at::kFloat, "exp_avgs");
  check_masters(params, masters, master_mode);
  check_steps_and_scalars(steps, dev, grad_scale, found_inf, norm_sq);
  return dev;
}

// The learning rate a kernel reads: a tensor on the params' device stays there (read by the
// kernel: capturable); a CPU tensor or a float is a host value (a host read, not a device sync).
// A float lr stays double (adam_scalars derives lr * weight_decay and the step size in double);
// a tensor lr is read as its float32 value on every backend (device kernels read float32).
struct LrArg {
  double value;
  at::Tensor device_tensor;  // undefined unless the kernel reads lr on the device
};

inline double host_lr(double lr, const std::optional<at::Tensor>& lr_tensor) {
  return lr_tensor ? double(float(lr_tensor->item<double>())) : lr;
}

inline LrArg resolve_lr(double lr, const std::optional<at::Tensor>& lr_tensor,
                        const at::Device& dev) {
  LrArg out{lr, at::Tensor()};
  if (!lr_tensor) return out;
  TORCH_CHECK(lr_tensor->numel() == 1, "mpfused: lr_tensor must have one element, got ",
              lr_tensor->sizes());
  if (lr_tensor->device().is_cpu()) {
    out.value = host_lr(lr, lr_tensor);
  } else {
    TORCH_CHECK(lr_tensor->device() == dev, "mpfused: lr_tensor must be on ", dev,
                " (the params' device) or on the CPU, got ", lr_tensor->device());
    out.device_tensor =
        lr_tensor->scalar_type() == at::kFloat ? *lr_tensor : lr_tensor->to(at::kFloat);
  }
  return out;
}

// The stochastic-rounding stream of each packed tensor (adam_math.h::sr_stream). param_ids and
// elem_offsets have one entry per tensor of the caller's lists, or none: the tensor's position
// in the call, offset 0. `index`: the packed tensors' positions in the caller's lists.
inline std::vector<uint64_t> sr_streams(at::IntArrayRef param_ids, at::IntArrayRef elem_offsets,
                                        size_t n, const std::vector<int64_t>& index) {
  TORCH_CHECK(param_ids.empty() || param_ids.size() == n, "mpfused: param_ids must be empty or "
              "have one entry per param (", n, "), got ", param_ids.size());
  TORCH_CHECK(elem_offsets.empty() || elem_offsets.size() == n, "mpfused: elem_offsets must be "
              "empty or have one entry per param (", n, "), got ", elem_offsets.size());
  std::vector<uint64_t> out(index.size());
  for (size_t j = 0; j < index.size(); ++j) {
    const int64_t i = index[j];
    const int64_t id = param_ids.empty() ? i : param_ids[i];
    const int64_t off = elem_offsets.empty() ? 0 : elem_offsets[i];
    TORCH_CHECK(id >= 0 && off >= 0, "mpfused: param_ids and elem_offsets must be >= 0, got ",
                id, " and ", off, " for params[", i, "]");
    out[j] = sr_stream(uint64_t(id), uint64_t(off));
  }
  return out;
}

// The scalars and device pointers of cuda::Adam8bitConfig from the op's arguments (fp32-state
// Adam fills cuda::StepCommon through run_elementwise_cuda instead).
template <typename Config>
void fill_adam_config(Config& cfg, const LrArg& lr_arg, double beta1, double beta2, double eps,
                      double weight_decay, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                      bool maximize, bool decoupled, int64_t master_mode, int64_t seed) {
  cfg.lr = lr_arg.value;
  cfg.lr_ptr = lr_arg.device_tensor.defined() ? lr_arg.device_tensor.data_ptr<float>() : nullptr;
  cfg.beta1 = beta1;
  cfg.beta2 = beta2;
  cfg.eps = float(eps);
  cfg.weight_decay = weight_decay;
  cfg.grad_scale = grad_scale ? grad_scale->data_ptr<float>() : nullptr;
  cfg.found_inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
  cfg.norm_sq = norm_sq ? norm_sq->data_ptr<float>() : nullptr;
  cfg.max_grad_norm = max_grad_norm;
  cfg.maximize = maximize;
  cfg.decoupled = decoupled;
  cfg.master_mode = int32_t(master_mode);
  cfg.seed = uint64_t(seed);
}

// Arguments of update_scale_ (every backend).
inline void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                    const at::Tensor& hysteresis_tracker,
                                    const at::Tensor& found_inf) {
  const at::Device dev = scale.device();
  check_scalar_f32(scale, "scale", dev);
  check_scalar_f32(found_inf, "found_inf", dev);
  TORCH_CHECK(growth_tracker.numel() == 1 && growth_tracker.scalar_type() == at::kInt &&
                  hysteresis_tracker.numel() == 1 && hysteresis_tracker.scalar_type() == at::kInt,
              "mpfused: growth_tracker and hysteresis_tracker must be 1-element int32 tensors");
  TORCH_CHECK(growth_tracker.device() == dev && hysteresis_tracker.device() == dev,
              "mpfused: growth_tracker and hysteresis_tracker must be on ", dev,
              " (the scale's device)");
}

// Packs DEPTH parallel tensor lists (operand k of tensor i is lists[k][i]). Elementwise kernels
// are order-agnostic, so a tensor whose operands are all dense with identical strides is used in
// place; any other tensor is staged through contiguous copies, written back by finish() for the
// operands marked mutable. Empty tensors are dropped: they never take a kernel slot. An operand
// list that is empty is absent (optional operands): its pointers are null.
template <int DEPTH>
struct PackedLists {
  std::array<std::vector<void*>, DEPTH> ptrs;
  std::vector<int64_t> numel;
  std::vector<int32_t> dtype;
  std::vector<int64_t> index;  // position of each packed tensor in the caller's lists
  std::vector<std::pair<at::Tensor, at::Tensor>> writeback;  // (original, staged copy)
  std::vector<at::Tensor> staged_inputs;  // read-only staged copies, alive until the kernel ran

  PackedLists(const std::array<at::TensorList, DEPTH>& lists, std::array<bool, DEPTH> mutated,
              const char* what, bool require_logical_order = false) {
    const size_t n = lists[0].size();
    std::array<bool, DEPTH> present;
    for (int k = 0; k < DEPTH; ++k) present[k] = k == 0 || !lists[k].empty();
    for (int k = 1; k < DEPTH; ++k)
      TORCH_CHECK(!present[k] || lists[k].size() == n, "mpfused: ", what, ": tensor lists differ in length (",
                  n, " vs ", lists[k].size(), ")");
    // Per tensor only TensorImpl reads, no Tensor copies (refcount atomics): with 10,000 small
    // tensors this loop is a large part of a step's host time.
    for (auto& p : ptrs) p.reserve(n);
    numel.reserve(n);
    dtype.reserve(n);
    index.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const at::TensorImpl* t0 = lists[0][i].unsafeGetTensorImpl();
      const int64_t n0 = t0->numel();
      bool direct = true;
      for (int k = 0; k < DEPTH; ++k) {
        if (!present[k]) continue;
        const at::TensorImpl* t = lists[k][i].unsafeGetTensorImpl();
        TORCH_CHECK(t->layout() == at::kStrided, "mpfused: ", what, "[", i,
                    "] must be a dense (strided) tensor; sparse tensors are not supported");
        TORCH_CHECK(t->numel() == n0, "mpfused: ", what, "[", i,
                    "]: operands differ in size (", t0->sizes(), " vs ", t->sizes(), ")");
        TORCH_CHECK(t->device() == t0->device(), "mpfused: ", what, "[", i,
                    "]: operands on different devices (", t0->device(), " vs ", t->device(), ")");
        direct = direct && (require_logical_order ? t->is_contiguous()
                                                  : t->is_non_overlapping_and_dense() &&
                                                        (k == 0 || t->strides() == t0->strides()));
      }
      if (n0 == 0) continue;
      dtype.push_back(dtype_code(lists[0][i], what));
      numel.push_back(n0);
      index.push_back(int64_t(i));
      for (int k = 0; k < DEPTH; ++k) {
        if (!present[k]) {
          ptrs[k].push_back(nullptr);
          continue;
        }
        const at::Tensor& t = lists[k][i];
        if (direct) {
          ptrs[k].push_back(t.data_ptr());
          continue;
        }
        at::Tensor staged = t.contiguous();
        if (mutated[k] && !staged.is_same(t)) writeback.emplace_back(t, staged);
        else if (!staged.is_same(t)) staged_inputs.push_back(staged);
        ptrs[k].push_back(staged.data_ptr());
      }
    }
  }

  TensorLists<DEPTH> view() const {
    TensorLists<DEPTH> v{};
    for (int k = 0; k < DEPTH; ++k) v.data[k] = ptrs[k].data();
    v.numel = numel.data();
    v.dtype = dtype.data();
    v.size = int64_t(numel.size());
    return v;
  }

  void finish() {
    for (auto& [orig, staged] : writeback) orig.copy_(staged);
  }
};

}  // namespace mpfused::bind

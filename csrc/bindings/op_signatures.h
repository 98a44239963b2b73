// The C++ signatures of the multi-tensor step ops (and of check_grads), as their schemas (mpfused/ops/*.py) map to
// C++: every backend's kernel has exactly this type (static_assert beside each registration),
// so BoundLists can call the ops unboxed through the dispatcher.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace mpfused::bind {

// check_grads (the read-only non-finite check of the loss-scaling ops): BoundLists' released_*
// methods call it before the step (gradient release, mpfused/optim/release.py).
using CheckGradsFn = void(at::TensorList grads, const at::Tensor& found_inf,
                          const at::Tensor& inv_scale, const std::optional<at::Tensor>& norm_sq,
                          const std::optional<at::Tensor>& norm_sq_per_tensor);

using AdamStepFn = void(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                        at::TensorList masters, at::TensorList steps, double lr,
                        const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                        double eps, double weight_decay, bool amsgrad, bool maximize,
                        bool decoupled, int64_t master_mode,
                        const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                        int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets);

using Adam8bitStepFn = void(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList absmax1s,
                            at::TensorList absmax2s, at::TensorList masters,
                            at::TensorList steps, const at::Tensor& qmap1,
                            const at::Tensor& qmap2, int64_t block_size, double lr,
                            const std::optional<at::Tensor>& lr_tensor, double beta1,
                            double beta2, double eps, double weight_decay, bool maximize,
                            bool decoupled, int64_t master_mode,
                            const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& found_inf,
                            const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                            int64_t seed, at::IntArrayRef param_ids,
                            at::IntArrayRef elem_offsets);

using SgdStepFn = void(at::TensorList params, at::TensorList grads,
                       at::TensorList momentum_buffers, at::TensorList masters,
                       at::TensorList steps, double lr, const std::optional<at::Tensor>& lr_tensor,
                       double momentum, double dampening, double weight_decay, bool nesterov,
                       bool maximize, int64_t master_mode,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                       int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets);

using LionStepFn = void(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList masters, at::TensorList steps, double lr,
                        const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                        double weight_decay, bool maximize, int64_t master_mode,
                        const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                        int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets);
using Sgd8bitStepFn = void(at::TensorList params, at::TensorList grads,
                           at::TensorList momentum_buffers, at::TensorList absmaxs,
                           at::TensorList masters, at::TensorList steps, const at::Tensor& qmap,
                           int64_t block_size, double lr,
                           const std::optional<at::Tensor>& lr_tensor, double momentum,
                           double dampening, double weight_decay, bool nesterov, bool maximize,
                           int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                           const std::optional<at::Tensor>& found_inf,
                           const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                           int64_t seed, at::IntArrayRef param_ids, at::IntArrayRef elem_offsets);

using Lion8bitStepFn = void(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList absmaxs, at::TensorList masters, at::TensorList steps,
                            const at::Tensor& qmap, int64_t block_size, double lr,
                            const std::optional<at::Tensor>& lr_tensor, double beta1,
                            double beta2, double weight_decay, bool maximize,
                            int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& found_inf,
                            const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                            int64_t seed, at::IntArrayRef param_ids,
                            at::IntArrayRef elem_offsets);

}  // namespace mpfused::bind

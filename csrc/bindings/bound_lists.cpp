// BoundLists (torch.classes.mpfused.BoundLists): the operand lists of an optimizer bucket other
// than its grads, converted from Python once, on the bucket's first step. A step then converts only
// its grads: with 10,000 small tensors, turning the op's Python tensor lists into C++ ones costs
// ~145 ns per tensor, 70% of a plain op call. The methods call the declared ops (adam_step_,
// adam8bit_step_, sgd_step_, lion_step_) unboxed through the dispatcher, so the kernel serving
// them is whichever native kernel serves the op on the lists' device; nothing here is device
// specific. Each step method has a released_ twin for gradient release: the release bucket's
// non-finite check and the step in one call (release_check below).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "op_signatures.h"

namespace mpfused::bind {
namespace {

struct BoundLists : torch::CustomClassHolder {
  std::vector<at::Tensor> tensors;  // the lists one after another
  std::vector<int64_t> starts;      // list k is tensors[starts[k], starts[k + 1])
  std::vector<int64_t> param_ids, elem_offsets;  // the ops' stochastic-rounding keys, bound too

  BoundLists(at::TensorList flat, at::IntArrayRef lengths, at::IntArrayRef param_ids,
             at::IntArrayRef elem_offsets)
      : tensors(flat.vec()), param_ids(param_ids.vec()), elem_offsets(elem_offsets.vec()) {
    starts.push_back(0);
    for (int64_t n : lengths) {
      TORCH_CHECK(n >= 0, "mpfused: BoundLists lengths must be non-negative, got ", n);
      starts.push_back(starts.back() + n);
    }
    TORCH_CHECK(starts.back() == int64_t(tensors.size()), "mpfused: BoundLists lengths sum to ",
                starts.back(), " but ", tensors.size(), " tensors were given");
  }

  at::TensorList list(size_t k) const {
    return at::TensorList(tensors.data() + starts[k], size_t(starts[k + 1] - starts[k]));
  }

  void expect_lists(size_t want, const char* op, const char* names) const {
    TORCH_CHECK(starts.size() == want + 1, "mpfused: BoundLists.", op, " needs the ", want,
                " lists (", names, "), got ", starts.size() - 1);
  }

  void adam_step_(at::TensorList grads, double lr, const std::optional<at::Tensor>& lr_tensor,
                  double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
                  bool maximize, bool decoupled, int64_t master_mode,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed) {
    expect_lists(6, "adam_step_",
                 "params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::adam_step_", "")
                               .typed<AdamStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), list(4), list(5), lr, lr_tensor, beta1,
            beta2, eps, weight_decay, amsgrad, maximize, decoupled, master_mode, grad_scale,
            found_inf, norm_sq, max_grad_norm, seed, param_ids, elem_offsets);
  }

  void adam8bit_step_(at::TensorList grads, const at::Tensor& qmap1, const at::Tensor& qmap2,
                      int64_t block_size, double lr, const std::optional<at::Tensor>& lr_tensor,
                      double beta1, double beta2, double eps, double weight_decay, bool maximize,
                      bool decoupled, int64_t master_mode,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                      int64_t seed) {
    expect_lists(7, "adam8bit_step_",
                 "params, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::adam8bit_step_", "")
                               .typed<Adam8bitStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), list(4), list(5), list(6), qmap1, qmap2,
            block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize, decoupled,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, seed, param_ids,
            elem_offsets);
  }

  // adam4bit_step_: the same schema as adam8bit_step_ (4-bit codes, 16-entry maps).
  void adam4bit_step_(at::TensorList grads, const at::Tensor& qmap1, const at::Tensor& qmap2,
                      int64_t block_size, double lr, const std::optional<at::Tensor>& lr_tensor,
                      double beta1, double beta2, double eps, double weight_decay, bool maximize,
                      bool decoupled, int64_t master_mode,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                      int64_t seed) {
    expect_lists(7, "adam4bit_step_",
                 "params, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::adam4bit_step_", "")
                               .typed<Adam8bitStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), list(4), list(5), list(6), qmap1, qmap2,
            block_size, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize, decoupled,
            master_mode, grad_scale, found_inf, norm_sq, max_grad_norm, seed, param_ids,
            elem_offsets);
  }

  void sgd_step_(at::TensorList grads, double lr, const std::optional<at::Tensor>& lr_tensor,
                 double momentum, double dampening, double weight_decay, bool nesterov,
                 bool maximize, int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed) {
    expect_lists(4, "sgd_step_", "params, momentum_buffers, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::sgd_step_", "")
                               .typed<SgdStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), lr, lr_tensor, momentum, dampening,
            weight_decay, nesterov, maximize, master_mode, grad_scale, found_inf, norm_sq,
            max_grad_norm, seed, param_ids, elem_offsets);
  }

  void lion_step_(at::TensorList grads, double lr, const std::optional<at::Tensor>& lr_tensor,
                  double beta1, double beta2, double weight_decay, bool maximize,
                  int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& norm_sq, double max_grad_norm, int64_t seed) {
    expect_lists(4, "lion_step_", "params, exp_avgs, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::lion_step_", "")
                               .typed<LionStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), lr, lr_tensor, beta1, beta2,
            weight_decay, maximize, master_mode, grad_scale, found_inf, norm_sq, max_grad_norm,
            seed, param_ids, elem_offsets);
  }
  void sgd8bit_step_(at::TensorList grads, const at::Tensor& qmap, int64_t block_size, double lr,
                     const std::optional<at::Tensor>& lr_tensor, double momentum,
                     double dampening, double weight_decay, bool nesterov, bool maximize,
                     int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                     int64_t seed) {
    expect_lists(5, "sgd8bit_step_", "params, momentum_buffers, absmaxs, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::sgd8bit_step_", "")
                               .typed<Sgd8bitStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), list(4), qmap, block_size, lr, lr_tensor,
            momentum, dampening, weight_decay, nesterov, maximize, master_mode, grad_scale,
            found_inf, norm_sq, max_grad_norm, seed, param_ids, elem_offsets);
  }

  void lion8bit_step_(at::TensorList grads, const at::Tensor& qmap, int64_t block_size, double lr,
                      const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                      double weight_decay, bool maximize, int64_t master_mode,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                      int64_t seed) {
    expect_lists(5, "lion8bit_step_", "params, exp_avgs, absmaxs, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::lion8bit_step_", "")
                               .typed<Lion8bitStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), list(4), qmap, block_size, lr, lr_tensor,
            beta1, beta2, weight_decay, maximize, master_mode, grad_scale, found_inf, norm_sq,
            max_grad_norm, seed, param_ids, elem_offsets);
  }

  // sgd4bit_step_ / lion4bit_step_: the schemas of sgd8bit_step_ / lion8bit_step_ (4-bit codes,
  // a 16-entry map).
  void sgd4bit_step_(at::TensorList grads, const at::Tensor& qmap, int64_t block_size, double lr,
                     const std::optional<at::Tensor>& lr_tensor, double momentum,
                     double dampening, double weight_decay, bool nesterov, bool maximize,
                     int64_t master_mode, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                     int64_t seed) {
    expect_lists(5, "sgd4bit_step_", "params, momentum_buffers, absmaxs, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::sgd4bit_step_", "")
                               .typed<Sgd8bitStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), list(4), qmap, block_size, lr, lr_tensor,
            momentum, dampening, weight_decay, nesterov, maximize, master_mode, grad_scale,
            found_inf, norm_sq, max_grad_norm, seed, param_ids, elem_offsets);
  }

  void lion4bit_step_(at::TensorList grads, const at::Tensor& qmap, int64_t block_size, double lr,
                      const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                      double weight_decay, bool maximize, int64_t master_mode,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& norm_sq, double max_grad_norm,
                      int64_t seed) {
    expect_lists(5, "lion4bit_step_", "params, exp_avgs, absmaxs, masters, steps");
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mpfused::lion4bit_step_", "")
                               .typed<Lion8bitStepFn>();
    op.call(list(0), grads, list(1), list(2), list(3), list(4), qmap, block_size, lr, lr_tensor,
            beta1, beta2, weight_decay, maximize, master_mode, grad_scale, found_inf, norm_sq,
            max_grad_norm, seed, param_ids, elem_offsets);
  }
};

// Gradient release (mpfused/optim/release.py), the part of a release bucket's update that
// precedes its step: `found` (the bucket's own flag, reused from bucket to bucket) is cleared,
// check_grads writes whether any of `check_grads` (all the release bucket's grads, of every
// planner bucket it splits into) is non-finite after unscaling by `inv_scale`, and the flag is
// folded into the backward's: found_total = max(found_total, found), skipped += (found > 0).
// The step that follows reads `found` as its found_inf, so a bucket with a non-finite grad
// changes nothing. The same as release.py's two-op path (check op, then step op), flag for flag.
void release_check(at::TensorList check_grads, const at::Tensor& found,
                   const at::Tensor& inv_scale, const at::Tensor& found_total,
                   const at::Tensor& skipped) {
  static const auto check = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("mpfused::check_grads", "")
                                .typed<CheckGradsFn>();
  const bool host = found.is_cpu() && found_total.is_cpu() && skipped.is_cpu();
  if (host) {  // three 0-dim tensors: no ATen calls for them (each is ~1-2 us)
    TORCH_CHECK(found.scalar_type() == at::kFloat && found_total.scalar_type() == at::kFloat &&
                    skipped.scalar_type() == at::kInt && found.numel() == 1 &&
                    found_total.numel() == 1 && skipped.numel() == 1,
                "mpfused: BoundLists.released_*: found / found_total must be 1-element float32, "
                "skipped a 1-element int32 tensor");
    *found.data_ptr<float>() = 0.f;
  } else {
    found.zero_();
  }
  check.call(check_grads, found, inv_scale, std::nullopt, std::nullopt);
  if (host) {
    const float f = *found.data_ptr<float>();
    float& total = *found_total.data_ptr<float>();
    if (f > 0) {
      total = total > f ? total : f;  // torch.maximum of two flags in {0, 1}
      *skipped.data_ptr<int32_t>() += 1;
    }
  } else {
    at::maximum_out(const_cast<at::Tensor&>(found_total), found_total, found);
    const_cast<at::Tensor&>(skipped).add_(found.gt(0).to(skipped.device()));
  }
}

// BoundLists.released_<op>(check_grads, found, inv_scale, found_total, skipped, grads, <the
// op's other arguments>): release_check, then the step, in one call from Python (the step's
// found_inf argument is `found`).
template <class Method>
struct Released;

template <class... A>
struct Released<void (BoundLists::*)(at::TensorList, A...)> {
  template <void (BoundLists::*M)(at::TensorList, A...)>
  static auto method() {
    return [](const c10::intrusive_ptr<BoundLists>& self, at::TensorList check_grads,
              const at::Tensor& found, const at::Tensor& inv_scale, const at::Tensor& found_total,
              const at::Tensor& skipped, at::TensorList grads, A... args) {
      release_check(check_grads, found, inv_scale, found_total, skipped);
      ((*self).*M)(grads, args...);
    };
  }
};

template <auto M>
auto released() {
  return Released<decltype(M)>::template method<M>();
}

}  // namespace

// A fragment: the namespace's op schemas are defined from Python (mpfused/ops/registry.py).
TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.class_<BoundLists>("BoundLists")
      .def(torch::init<at::TensorList, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef>())
      .def("adam_step_", &BoundLists::adam_step_)
      .def("released_adam_step_", released<&BoundLists::adam_step_>())
      .def("adam8bit_step_", &BoundLists::adam8bit_step_)
      .def("released_adam8bit_step_", released<&BoundLists::adam8bit_step_>())
      .def("adam4bit_step_", &BoundLists::adam4bit_step_)
      .def("released_adam4bit_step_", released<&BoundLists::adam4bit_step_>())
      .def("sgd_step_", &BoundLists::sgd_step_)
      .def("released_sgd_step_", released<&BoundLists::sgd_step_>())
      .def("lion_step_", &BoundLists::lion_step_)
      .def("released_lion_step_", released<&BoundLists::lion_step_>())
      .def("sgd8bit_step_", &BoundLists::sgd8bit_step_)
      .def("released_sgd8bit_step_", released<&BoundLists::sgd8bit_step_>())
      .def("lion8bit_step_", &BoundLists::lion8bit_step_)
      .def("released_lion8bit_step_", released<&BoundLists::lion8bit_step_>())
      .def("sgd4bit_step_", &BoundLists::sgd4bit_step_)
      .def("released_sgd4bit_step_", released<&BoundLists::sgd4bit_step_>())
      .def("lion4bit_step_", &BoundLists::lion4bit_step_)
      .def("released_lion4bit_step_", released<&BoundLists::lion4bit_step_>());
}

}  // namespace mpfused::bind

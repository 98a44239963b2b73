// The ADInplaceOrView kernels of the mutating ops: each bumps the version counter of every
// tensor its schema marks written (Tensor(a!), Tensor(a!)[]), then redispatches below. Why: an
// in-place op in torch does this (the ADInplaceOrView kernels of _fused_adamw_, add_, ...), so
// autograd refuses a backward through a graph that saved a tensor since changed in place
// ("modified by an inplace operation"): a param saved by the forward and stepped before the
// backward, or released by gradient release while an op still needs it. Without it the backward
// silently used the new values. One place for every backend the dispatcher picks (native,
// Triton, reference); a call with an explicit backend= (tests, debugging) bypasses the
// dispatcher and bumps nothing. Skipped under inference mode (no ADInplaceOrView key), as torch.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "op_signatures.h"

namespace mpfused::bind {
namespace {

inline void bump(const at::Tensor& t) {
  if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}
inline void bump_if(bool written, at::TensorList list) {
  if (written)
    for (const at::Tensor& t : list) bump(t);
}
inline void bump_if(bool written, const at::Tensor& t) {
  if (written) bump(t);
}
inline void bump_if(bool written, const std::optional<at::Tensor>& t) {
  if (written && t) bump(*t);
}
template <class T>
inline void bump_if(bool, const T&) {}  // not a tensor

// The op `Name` of C++ signature Fn: its handle and which arguments its schema writes, looked up
// on its first call (the schemas are defined from Python, after this library's registration).
template <class Fn, const char* Name>
struct WrittenArgs {
  static const WrittenArgs& get() {
    static const WrittenArgs self;
    return self;
  }
  WrittenArgs()
      : op(c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").template typed<Fn>()) {
    for (const c10::Argument& a : op.schema().arguments())
      written.push_back(a.alias_info() != nullptr && a.alias_info()->isWrite());
  }
  c10::TypedOperatorHandle<Fn> op;
  std::vector<bool> written;
};

template <class Fn, const char* Name>
struct BumpThenRedispatch;

template <class... A, const char* Name>
struct BumpThenRedispatch<void(A...), Name> {
  static void call(c10::DispatchKeySet ks, A... args) {
    const auto& w = WrittenArgs<void(A...), Name>::get();
    size_t i = 0;
    (bump_if(w.written[i++], args), ...);
    w.op.redispatch(ks & c10::after_ADInplaceOrView_keyset, args...);
  }
};

using UnscaleGradsFn = CheckGradsFn;  // unscale_grads_ has check_grads' arguments
using UpdateScaleFn = void(const at::Tensor& scale, const at::Tensor& growth_tracker,
                           const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                           double growth_factor, double backoff_factor, int64_t growth_interval,
                           int64_t hysteresis, double min_scale, double max_scale,
                           bool consecutive_hysteresis);

constexpr char kAdam[] = "mpfused::adam_step_", kAdam8[] = "mpfused::adam8bit_step_",
               kAdam4[] = "mpfused::adam4bit_step_", kSgd[] = "mpfused::sgd_step_",
               kSgd8[] = "mpfused::sgd8bit_step_", kSgd4[] = "mpfused::sgd4bit_step_",
               kLion[] = "mpfused::lion_step_", kLion8[] = "mpfused::lion8bit_step_",
               kLion4[] = "mpfused::lion4bit_step_", kUnscale[] = "mpfused::unscale_grads_",
               kCheck[] = "mpfused::check_grads", kUpdate[] = "mpfused::update_scale_";

template <class Fn, const char* Name>
void define(torch::Library& m) {
  m.impl(Name + sizeof("mpfused::") - 1, TORCH_FN((BumpThenRedispatch<Fn, Name>::call)));
}

}  // namespace

TORCH_LIBRARY_IMPL(mpfused, ADInplaceOrView, m) {
  define<AdamStepFn, kAdam>(m);
  define<Adam8bitStepFn, kAdam8>(m);
  define<Adam8bitStepFn, kAdam4>(m);
  define<SgdStepFn, kSgd>(m);
  define<Sgd8bitStepFn, kSgd8>(m);
  define<Sgd8bitStepFn, kSgd4>(m);
  define<LionStepFn, kLion>(m);
  define<Lion8bitStepFn, kLion8>(m);
  define<Lion8bitStepFn, kLion4>(m);
  define<UnscaleGradsFn, kUnscale>(m);
  define<CheckGradsFn, kCheck>(m);
  define<UpdateScaleFn, kUpdate>(m);
}

}  // namespace mpfused::bind

// BoundLists (torch.classes.mpfused.BoundLists): the operand lists of an optimizer bucket other
// than its grads, converted from Python once, on the bucket's first step. A step then converts only
// its grads: with 10,000 small tensors, turning the op's Python tensor lists into C++ ones costs
// ~145 ns per tensor, 70% of a plain op call. The methods call the declared step ops unboxed
// through the dispatcher, so the kernel serving them is whichever native kernel serves the op on
// the lists' device; nothing here is device specific. Each step method has a released_ twin for
// gradient release: the release bucket's non-finite check and the step in one call
// (release_check below). Both are made by one template from the op's C++ signature
// (StepMethods): a new step op is one line of the registration at the end. Gradient release's
// plain path arms each release bucket's released_ call once (arm_released_<op>, an ArmedStep
// holding the scalars and the bucket's params): a release is then one call without arguments
// that takes the grads from the params, checks, steps and frees them (ArmedStep.run).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "armed_step.h"
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

  void expect_lists(size_t want, const std::string& op, const char* names) const {
    TORCH_CHECK(starts.size() == want + 1, "mpfused: BoundLists.", op, " needs the ", want,
                " lists (", names, "), got ", starts.size() - 1);
  }

  // op(list 0, grads, list 1, ..., list N-1, rest..., param_ids, elem_offsets): the layout of
  // every step op (op_signatures.h), N the bound lists.
  template <class Fn, size_t... K, class... R>
  void call(const c10::TypedOperatorHandle<Fn>& op, at::TensorList grads,
            std::index_sequence<K...>, const R&... rest) const {
    op.call(list(0), grads, list(K + 1)..., rest..., param_ids, elem_offsets);
  }
};

// A step op's handle, looked up on first use (the schemas are defined from Python, after this
// library's static registration).
template <class Fn>
struct LazyOp {
  explicit LazyOp(std::string name) : name(std::move(name)) {}
  const c10::TypedOperatorHandle<Fn>& get() {
    std::call_once(once, [this] {
      handle.emplace(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")
                         .template typed<Fn>());
    });
    return *handle;
  }
  std::string name;
  std::once_flag once;
  std::optional<c10::TypedOperatorHandle<Fn>> handle;
};

template <class... A>
constexpr size_t leading_lists() {  // how many of the arguments A come first and are lists
  constexpr bool is_list[] = {std::is_same_v<A, at::TensorList>..., false};
  size_t n = 0;
  while (is_list[n]) ++n;
  return n;
}

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

template <class T>
bool assign_double(T&, double) {  // not a double argument
  return false;
}
inline bool assign_double(double& x, double value) {
  x = value;
  return true;
}
template <class Held, size_t... K>
bool set_double_at(Held& held, int64_t index, double value, std::index_sequence<K...>) {
  bool done = false;
  ((K == size_t(index) ? (done = assign_double(std::get<K>(held), value)) : false), ...);
  return done;
}

// The two methods of a step op whose C++ signature is Fn (op_signatures.h): `<op>(grads, <the
// op's arguments after its lists, but param_ids / elem_offsets>)` calls the op with the bound
// lists; `released_<op>(check_grads, found, inv_scale, found_total, skipped, grads, ...)` runs
// release_check first (the step's found_inf argument is `found`), in one call from Python. Every
// op's methods are this one template; an op is one line of the registration below.
template <class Fn>
struct StepMethods;

template <class... A>
struct StepMethods<void(A...)> {
  using Fn = void(A...);
  using Args = std::tuple<A...>;
  static constexpr size_t kLists = leading_lists<A...>();  // params, grads, the state lists
  static constexpr size_t kBound = kLists - 1;             // all but the grads
  static constexpr size_t kRest = sizeof...(A) - kLists - 2;
  static_assert(kLists >= 2, "a step op starts with its params and grads lists");
  static_assert(std::is_same_v<std::tuple_element_t<sizeof...(A) - 2, Args>, at::IntArrayRef> &&
                    std::is_same_v<std::tuple_element_t<sizeof...(A) - 1, Args>, at::IntArrayRef>,
                "a step op ends with param_ids and elem_offsets (bound with the lists)");
  template <size_t I>
  using Rest = std::tuple_element_t<kLists + I, Args>;

  static void define(torch::class_<BoundLists>& cls, const std::string& name,
                     const char* list_names) {
    define(cls, name, list_names, std::make_index_sequence<kRest>{});
  }

  template <size_t... I>
  static void define(torch::class_<BoundLists>& cls, const std::string& name,
                     const char* list_names, std::index_sequence<I...>) {
    auto op = std::make_shared<LazyOp<Fn>>("mpfused::" + name);
    auto step = [op, name, list_names](const BoundLists& self, at::TensorList grads,
                                       Rest<I>... rest) {
      self.expect_lists(kBound, name, list_names);
      self.call(op->get(), grads, std::make_index_sequence<kBound - 1>{}, rest...);
    };
    cls.def(name, [step](const c10::intrusive_ptr<BoundLists>& self, at::TensorList grads,
                         Rest<I>... rest) { step(*self, grads, rest...); });
    cls.def("released_" + name,
            [step](const c10::intrusive_ptr<BoundLists>& self, at::TensorList check_grads,
                   const at::Tensor& found, const at::Tensor& inv_scale,
                   const at::Tensor& found_total, const at::Tensor& skipped,
                   at::TensorList grads, Rest<I>... rest) {
              release_check(check_grads, found, inv_scale, found_total, skipped);
              step(*self, grads, rest...);
            });
    // arm_released_<op>(params, flags, <the step's arguments after the grads>) -> ArmedStep: the
    // arguments are copied into it (none is a list or an array: nothing dangles).
    static_assert(((!std::is_same_v<Rest<I>, at::TensorList> &&
                    !std::is_same_v<Rest<I>, at::IntArrayRef>) && ...),
                  "an armed step holds its arguments: views of lists would dangle");
    cls.def("arm_released_" + name,
            [step](const c10::intrusive_ptr<BoundLists>& self, at::TensorList params,
                   const c10::intrusive_ptr<ReleaseFlags>& flags, Rest<I>... rest) {
              using Held = std::tuple<std::decay_t<Rest<I>>...>;
              auto held = std::make_shared<Held>(rest...);
              auto armed = c10::make_intrusive<ArmedStep>();
              armed->params = params.vec();
              armed->flags = flags;
              armed->check_and_step = [step, self, held](at::TensorList grads,
                                                         const ReleaseFlags& f) {
                release_check(grads, f.found, f.inv_scale, f.found_total, f.skipped);
                step(*self, grads, std::get<I>(*held)...);
              };
              armed->set_double = [held](int64_t index, double value) {
                return index >= 0 && set_double_at(*held, index, value,
                                                   std::make_index_sequence<kRest>{});
              };
              return armed;
            });
  }
};

}  // namespace

// A fragment: the namespace's op schemas are defined from Python (mpfused/ops/registry.py).
TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.class_<ReleaseFlags>("ReleaseFlags")
      .def(torch::init<>())
      .def("set", &ReleaseFlags::set);
  // address(): the step's address, for the native release hook (release_hook.cpp), which runs
  // it while the caller holds this object.
  m.class_<ArmedStep>("ArmedStep")
      .def("run", &ArmedStep::run)
      .def("set", &ArmedStep::set)
      .def("address", [](const c10::intrusive_ptr<ArmedStep>& self) {
        return reinterpret_cast<int64_t>(self.get());
      });
  auto cls = m.class_<BoundLists>("BoundLists");
  cls.def(torch::init<at::TensorList, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef>());
  StepMethods<AdamStepFn>::define(
      cls, "adam_step_", "params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps");
  // adam4bit_step_ has adam8bit_step_'s schema (4-bit codes, 16-entry maps), sgd4bit_step_ /
  // lion4bit_step_ those of sgd8bit_step_ / lion8bit_step_ (4-bit codes, a 16-entry map).
  for (const char* name : {"adam8bit_step_", "adam4bit_step_"})
    StepMethods<Adam8bitStepFn>::define(
        cls, name, "params, exp_avgs, exp_avg_sqs, absmax1s, absmax2s, masters, steps");
  StepMethods<SgdStepFn>::define(cls, "sgd_step_", "params, momentum_buffers, masters, steps");
  StepMethods<LionStepFn>::define(cls, "lion_step_", "params, exp_avgs, masters, steps");
  for (const char* name : {"sgd8bit_step_", "sgd4bit_step_"})
    StepMethods<Sgd8bitStepFn>::define(cls, name,
                                       "params, momentum_buffers, absmaxs, masters, steps");
  for (const char* name : {"lion8bit_step_", "lion4bit_step_"})
    StepMethods<Lion8bitStepFn>::define(cls, name, "params, exp_avgs, absmaxs, masters, steps");
}

}  // namespace mpfused::bind

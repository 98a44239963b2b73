// The armed release of one gradient-release bucket (csrc/bindings/bound_lists.cpp makes it:
// BoundLists.arm_released_<op>) and the flags its check writes; shared with the release worker
// (release_worker.cpp), which runs armed releases off the backward's thread.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <functional>
#include <vector>

namespace mpfused::bind {

// The flags one backward's release checks write (release_check's found, inv_scale, found_total,
// skipped), shared by every ArmedStep of an optimizer: set once per backward, as they are new
// tensors each backward (mpfused/optim/_release_update.py: at the opt.step() before it,
// _make_flags_ahead, or at its start, _prepare_calls).
struct ReleaseFlags : torch::CustomClassHolder {
  at::Tensor found, inv_scale, found_total, skipped;
  void set(const at::Tensor& found_, const at::Tensor& inv_scale_, const at::Tensor& found_total_,
           const at::Tensor& skipped_) {
    found = found_, inv_scale = inv_scale_, found_total = found_total_, skipped = skipped_;
  }
};

// One release bucket's whole update, armed (BoundLists.arm_released_<op>): its params, the flags
// and the step's scalars are held, so a release converts nothing from Python. Why: a release
// runs inside the backward, between autograd ops that evict the interpreter's and the
// converters' code and data; each layer of Python and each converted argument costs there
// several times what it costs hot (benchmarks/results/release-armed-calls-*.txt).
struct ArmedStep : torch::CustomClassHolder {
  std::vector<at::Tensor> params;
  c10::intrusive_ptr<ReleaseFlags> flags;
  std::function<void(at::TensorList grads, const ReleaseFlags& flags)> check_and_step;
  // Argument `index` (of those after the grads) set to `value` if it is a double: an LR
  // scheduler's new lr each step without arming again (~2 us against ~13 us, hot).
  std::function<bool(int64_t index, double value)> set_double;

  bool set(int64_t index, double value) { return set_double(index, value); }

  // The params' grads into `grads`; false if one has none (a later hook set it to None: the
  // caller's general path steps the others).
  bool take_grads(std::vector<at::Tensor>& grads) const {
    grads.reserve(params.size());
    for (const at::Tensor& p : params) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) return false;
      grads.push_back(g);
    }
    TORCH_CHECK(flags->found.defined(), "mpfused: an armed step ran before its flags were set");
    return true;
  }

  void free_grads() const {
    for (const at::Tensor& p : params) p.mutable_grad().reset();  // p.grad = None
  }

  // The release: false (nothing done) if a param has no grad; else check, step, then the grads
  // set to None.
  bool run() const {
    std::vector<at::Tensor> grads;
    if (!take_grads(grads)) return false;
    check_and_step(grads, *flags);
    free_grads();
    return true;
  }
};

// ReleaseWorker::submit (release_worker.cpp) by the worker's address, for the native release
// hook (release_hook.cpp).
bool submit_to_worker(void* worker, const ArmedStep* armed);

}  // namespace mpfused::bind

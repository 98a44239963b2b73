// The thin torch layer shared by all bindings: argument checks with clear messages, dtype mapping,
// and packing of at::Tensor lists into the torch-free TensorLists the kernels take.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <vector>

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
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t0 = lists[0][i];
      bool direct = true;
      for (int k = 0; k < DEPTH; ++k) {
        if (!present[k]) continue;
        const at::Tensor& t = lists[k][i];
        TORCH_CHECK(t.layout() == at::kStrided, "mpfused: ", what, "[", i,
                    "] must be a dense (strided) tensor; sparse tensors are not supported");
        TORCH_CHECK(t.numel() == t0.numel(), "mpfused: ", what, "[", i,
                    "]: operands differ in size (", t0.sizes(), " vs ", t.sizes(), ")");
        TORCH_CHECK(t.device() == t0.device(), "mpfused: ", what, "[", i,
                    "]: operands on different devices (", t0.device(), " vs ", t.device(), ")");
        direct = direct && (require_logical_order ? t.is_contiguous()
                                                  : t.is_non_overlapping_and_dense() &&
                                                        t.strides() == t0.strides());
      }
      if (t0.numel() == 0) continue;
      dtype.push_back(dtype_code(t0, what));
      numel.push_back(t0.numel());
      index.push_back(int64_t(i));
      for (int k = 0; k < DEPTH; ++k) {
        if (!present[k]) {
          ptrs[k].push_back(nullptr);
          continue;
        }
        at::Tensor t = lists[k][i];
        if (!direct) {
          at::Tensor staged = t.contiguous();
          if (mutated[k] && !staged.is_same(t)) writeback.emplace_back(t, staged);
          else if (!staged.is_same(t)) staged_inputs.push_back(staged);
          t = staged;
        }
        ptrs[k].push_back(t.data_ptr());
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

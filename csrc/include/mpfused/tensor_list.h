// Torch-free description of a list of tensors handed to a multi-tensor kernel: raw pointers,
// element counts (64-bit) and per-tensor storage dtype. The bindings fill it from at::Tensor lists.
#pragma once
#include "mpfused/dtype.h"

namespace mpfused {

template <int DEPTH>
struct TensorLists {
  void* const* data[DEPTH];  // data[k][i]: the k-th operand of tensor i
  const int64_t* numel;      // numel[i], shared by every operand of tensor i
  const int32_t* dtype;      // dtype[i] (DType) of operand 0; the other operands' types are fixed by the op
  int64_t size;              // number of tensors
};

}  // namespace mpfused

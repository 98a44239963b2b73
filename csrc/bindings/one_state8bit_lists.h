// What the CPU bindings of the one-state 8-bit and 4-bit steps (sgd8bit_step_, lion8bit_step_,
// sgd4bit_step_, lion4bit_step_) share: the signed map and the packing of their lists into the
// kernel's operands, this step's counts and the stochastic-rounding streams.
#pragma once
#include "../cpu/one_state8bit_cpu.h"
#include "common.h"
#include "cpu_steps.h"
#include "quant8_args.h"

namespace mpfused::bind {

// Operands of one step, checked beforehand (check_quant8_args, check_qmap). Codes follow the
// logical (row-major) order, so every operand is used contiguous; staged copies are written
// back by finish(). 4-bit codes (checked contiguous, half the size) are taken as they lie, like
// the absmax.
struct OneState8bitCpuLists {
  PackedLists<4> packed;
  std::vector<void*> absmax;
  std::vector<double> t;          // this step's count of each packed tensor
  std::vector<uint64_t> streams;  // sr_stream of each packed tensor
  TensorLists<5> lists{};

  OneState8bitCpuLists(at::TensorList params, at::TensorList grads, at::TensorList codes,
                       at::TensorList absmaxs, at::TensorList masters, at::TensorList steps,
                       int64_t master_mode, at::IntArrayRef param_ids,
                       at::IntArrayRef elem_offsets, int code_bits = 8)
      : packed({params, grads, code_bits == 8 ? codes : at::TensorList(),
                mode_has_masters(master_mode) ? masters : at::TensorList()},
               {true, false, true, true}, "params", /*require_logical_order=*/true),
        absmax(packed.index.size()),
        t(cpu_next_steps(steps, packed.index)),
        streams(sr_streams(param_ids, elem_offsets, params.size(), packed.index)) {
    for (size_t j = 0; j < absmax.size(); ++j) {
      absmax[j] = absmaxs[packed.index[j]].data_ptr();
      if (code_bits == 4) packed.ptrs[cpu::kSState][j] = codes[packed.index[j]].data_ptr();
    }
    const TensorLists<4> v = packed.view();
    for (int k = 0; k < 4; ++k) lists.data[k] = v.data[k];
    lists.data[cpu::kSAbsmax] = absmax.data();
    lists.numel = v.numel;
    lists.dtype = v.dtype;
    lists.size = v.size;
  }

  void finish() { packed.finish(); }
};

// The signed map of a one-state step of BITS-bit codes (2^BITS entries, sorted, on `dev`) and the
// code of its +0 for the sign rule: 8-bit only; 4-bit: -1, nearest code (Li et al., torchao).
template <int BITS>
int32_t one_state_qmap_zero_code(const at::Tensor& qmap, const at::Device& dev) {
  check_qmap(qmap, "qmap (signed map)", dev, int64_t(1) << BITS);
  if constexpr (BITS == 8) return cpu_signed_map_zero_code(qmap, "qmap (signed map)");
  check_qmap_values(qmap, "qmap (signed map)");
  return -1;
}

// The part of the kernel's config every one-state op fills the same way.
inline cpu::State8bitConfig state8bit_config(const OneState8bitCpuLists& l, const at::Tensor& qmap,
                                             int32_t zero_code, int64_t block_size, double lr,
                                             const std::optional<at::Tensor>& lr_tensor,
                                             double weight_decay, float grad_mult, bool maximize,
                                             int64_t master_mode, int64_t seed,
                                             int code_bits = 8) {
  return cpu::State8bitConfig{host_lr(lr, lr_tensor), weight_decay, grad_mult, maximize,
                              int32_t(master_mode), uint64_t(seed), l.streams.data(),
                              block_size, qmap.data_ptr<float>(), zero_code, code_bits};
}

}  // namespace mpfused::bind

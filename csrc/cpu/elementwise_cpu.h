// The CPU multi-tensor engine of elementwise optimizers (Adam, SGD, Lion): chunking, OpenMP,
// per-ISA clones, the master modes and the per-dtype kernel choice, written once; an algorithm
// plugs in as a policy (its per-tensor scalars and its element function).
#pragma once
#include <stdint.h>
#include <vector>

#include "mpfused/adam_math.h"  // MasterMode, load_weight / store_weight, step_seed
#include "mpfused/tensor_list.h"
#include "parallel.h"
#include "step_scalars.h"

namespace mpfused::cpu {

// A policy P provides
//   using Config;   the op's hyperparameters plus grad_mult, master_mode, seed and streams
//                   (streams[i]: packed tensor i's sr_stream)
//   using Scalars;  the fp32 constants of one tensor's update
//   static constexpr int K;  its fp32 state operands (momentum buffers, moments)
//   static Scalars scalars(const Config&, double t);  t: the tensor's step, already incremented
//   static void element(float& w, float g, float* state, const Scalars&);  state: K values
// Operands of the TensorLists<DEPTH>: 0 param, 1 grad, 2 .. 2+K-1 state, DEPTH-1 master (fp32
// masters, int16 remainders or int8 corrections: MasterStore). DEPTH is the op's layout; a variant with fewer states (SGD
// without momentum) leaves the other slots unread (null).
template <typename P, int DEPTH, typename T, int MODE>
MPF_CPU_MULTIVERSION void elementwise_chunk(void* const* ops, int64_t begin, int64_t n,
                                            const typename P::Scalars& s, uint64_t seed,
                                            uint64_t stream) {
  constexpr int K = P::K;
  static_assert(K <= DEPTH - 3, "the policy's state operands do not fit the op's layout");
  static_assert(K <= 3, "the engine carries up to 3 state operands (Adam with AMSGrad's)");
  T* __restrict p = static_cast<T*>(ops[0]) + begin;
  const T* __restrict g = static_cast<const T*>(ops[1]) + begin;
  float* __restrict s0 = K > 0 ? static_cast<float*>(ops[2]) + begin : nullptr;
  float* __restrict s1 = K > 1 ? static_cast<float*>(ops[3]) + begin : nullptr;
  float* __restrict s2 = K > 2 ? static_cast<float*>(ops[4]) + begin : nullptr;
  master_t<MODE>* __restrict mst = master_operand<MODE>(ops[DEPTH - 1], begin);
  // A tensor's operands are distinct tensors (the schema's aliasing): no dependence between
  // iterations. ivdep, not omp simd: omp simd privatizes x[] per lane, and GCC 12 then left SGD
  // with momentum scalar (several times slower in cache).
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float w = load_weight<T, MODE>(p, mst, i);
    float x[K > 0 ? K : 1] = {};  // no zero-length arrays
    if constexpr (K > 0) x[0] = s0[i];
    if constexpr (K > 1) x[1] = s1[i];
    if constexpr (K > 2) x[2] = s2[i];
    P::element(w, to_f32(g[i]), x, s);
    if constexpr (K > 0) s0[i] = x[0];
    if constexpr (K > 1) s1[i] = x[1];
    if constexpr (K > 2) s2[i] = x[2];
    store_weight<T, MODE>(w, p, mst, i, seed, stream, begin + i);
  }
}

template <typename P>
using ElementwiseChunkFn = void (*)(void* const*, int64_t, int64_t, const typename P::Scalars&,
                                    uint64_t, uint64_t);

// The kernel of a tensor: its storage type and effective master mode (dispatch_master_mode).
template <typename P, int DEPTH>
ElementwiseChunkFn<P> pick_elementwise_chunk(int32_t dtype, int mode) {
  return dispatch_master_mode(dtype, mode, [](auto tag, auto m) -> ElementwiseChunkFn<P> {
    return &elementwise_chunk<P, DEPTH, decltype(tag), decltype(m)::value>;
  });
}

// One step of policy P over every tensor of `t`. step[i]: tensor i's step t (already
// incremented). Scalars and seeds: step_scalars.h (reused while the step repeats).
template <typename P, int DEPTH>
void elementwise_step(const TensorLists<DEPTH>& t, const double* step,
                      const typename P::Config& c, int num_threads) {
  const size_t n = size_t(t.size);
  const StepScalars<typename P::Scalars> ss = step_scalars<typename P::Scalars>(
      step, t.size, c.seed, [&c](double s) { return P::scalars(c, s); });
  const std::vector<typename P::Scalars>& scalars = ss.scalars;
  const std::vector<uint64_t>& seeds = ss.seeds;
  std::vector<ElementwiseChunkFn<P>> kernels(n);
  for (size_t i = 0; i < n; ++i)
    kernels[i] = pick_elementwise_chunk<P, DEPTH>(t.dtype[i], c.master_mode);
  // 64-element cuts: whole cache lines of every operand
  for_each_slice(make_slices(t.numel, t.size, num_threads, 64), num_threads, [&](const Chunk& ch) {
    void* ops[DEPTH];
    for (int d = 0; d < DEPTH; ++d) ops[d] = t.data[d][ch.tensor];
    kernels[ch.tensor](ops, ch.begin, ch.end - ch.begin, scalars[ch.tensor], seeds[ch.tensor],
                       c.streams[ch.tensor]);
  });
}

}  // namespace mpfused::cpu

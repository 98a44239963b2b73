// Generic CUDA multi-tensor elementwise optimizer step: the kernel structure, with the algorithm
// left to a policy, that Adam/AdamW, SGD and Lion (and any update that reads and writes only its
// own element) share:
//   * thread 0 of each block computes the tensor's scalars once (grad_mult exactly as the CPU
//     bindings form it), shared through shared memory;
//   * found_inf > 0: every block leaves before touching anything (counters are advanced by
//     increment_steps, which skips too);
//   * 4-wide vectors when every operand of the chunk is aligned for them, else a scalar loop with
//     P::ilp(mode) elements in flight per thread (misaligned views, tails);
//   * master modes per dtype as cpu::pick_elementwise_chunk: fp32 params are their own master,
//     fp16 keeps an fp32 master or none, bf16 takes every mode.
//
// A policy P supplies
//   using Config;   a struct with `StepCommon common` (elementwise_step.h) and its hyperparameters
//   using Scalars;  the per-tensor scalars of the shared per-element header
//   static constexpr int kStates;  K, the fp32 state operands (kEwState, kEwState + 1, ...)
//   static constexpr int ilp(int mode);  elements in flight per thread in the scalar loop, per
//                                  effective master mode (the widest operand sets take fewer)
//   __device__ static Scalars scalars(const Config&, double lr, float grad_mult, double t);
//   __device__ static void element(float& w, float g, float (&state)[Slots<K>], const Scalars&);
// The per-element math stays in csrc/include/mpfused/*.h, shared with the CPU kernels.
#pragma once
#include "elementwise_step.h"
#include "multi_tensor_apply.cuh"
#include "mpfused/adam_math.h"  // MasterMode, load_weight / store_weight, step_seed

namespace mpfused::cuda::ew {

// K state operands, at least one array slot (a zero-length array is not C++).
template <int K>
constexpr int Slots = K > 0 ? K : 1;

// V elements of T with the alignment of the whole vector: one 8- or 16-byte access.
template <typename T, int V>
struct alignas(sizeof(T) * V) VecN {
  T v[V];
};

__device__ __forceinline__ bool is_aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

template <typename T, int V>
__device__ __forceinline__ VecN<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const VecN<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const VecN<T, V>& x) {
  *reinterpret_cast<VecN<T, V>*>(p) = x;
}

// The CPU bindings' grad_mult (common.h::cpu_grad_mult): float reciprocal, clip coefficient in
// double, then float.
__device__ __forceinline__ float grad_mult(const StepCommon& k) {
  float m = k.grad_scale != nullptr ? 1.f / *k.grad_scale : 1.f;
  if (k.norm_sq != nullptr && k.max_grad_norm > 0) {
    const double norm = sqrt(double(*k.norm_sq));
    const double coef = k.max_grad_norm / (norm + 1e-6);
    m *= float(coef < 1.0 ? coef : 1.0);  // std::min(1.0, coef): NaN gives 1
  }
  return m;
}

// One element: the CPU kernels' loop body. `index`: the element's position in its tensor.
template <typename P, typename T, int MODE>
__device__ __forceinline__ void one(T& p, T g, float (&st)[Slots<P::kStates>], master_t<MODE>& m,
                                    const typename P::Scalars& s, uint64_t seed,
                                    uint64_t stream, int64_t index) {
  float w = load_weight<T, MODE>(p, m);
  P::element(w, to_f32(g), st, s);
  store_weight<T, MODE>(w, p, m, seed, stream, index);
}

// One chunk of one tensor (T, MODE: the effective storage type and master mode).
template <typename P, typename T, int MODE>
__device__ __forceinline__ void range(const MtaChunk<kEwFixed + P::kStates>& c,
                                      const typename P::Scalars& s, uint64_t seed) {
  constexpr int K = P::kStates, KS = Slots<K>;
  T* p = static_cast<T*>(c.ptr[kEwParam]) + c.begin;
  const T* g = static_cast<const T*>(c.ptr[kEwGrad]) + c.begin;
  float* st[KS] = {};
#pragma unroll
  for (int k = 0; k < K; ++k) st[k] = static_cast<float*>(c.ptr[kEwState + k]) + c.begin;
  using M = master_t<MODE>;
  constexpr bool kHasM = MasterStore<MODE>::kStored;
  M* mst = master_operand<MODE>(c.ptr[kEwMaster], c.begin);
  const uint64_t stream = reinterpret_cast<uint64_t>(c.ptr[kEwStream]);

  // 4-element vectors (16 B for the fp32 operands, 8 B for 16-bit ones, 4 B for int8 ones) when
  // every operand used is aligned for them.
  constexpr int V = 4;
  bool vec = is_aligned(p, V * sizeof(T)) && is_aligned(g, V * sizeof(T)) &&
             (!kHasM || is_aligned(mst, V * sizeof(M)));
#pragma unroll
  for (int k = 0; k < K; ++k) vec = vec && is_aligned(st[k], 16);
  const int64_t nv = vec ? c.n / V : 0;
  for (int64_t j = threadIdx.x; j < nv; j += kBlockSize) {
    const int64_t i = j * V;
    VecN<T, V> pv = load_vec<T, V>(p + i);
    const VecN<T, V> gv = load_vec<T, V>(g + i);
    VecN<float, V> sv[KS] = {};
    VecN<M, V> mv{};
#pragma unroll
    for (int k = 0; k < K; ++k) sv[k] = load_vec<float, V>(st[k] + i);
    if constexpr (kHasM) mv = load_vec<M, V>(mst + i);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float se[KS] = {};
#pragma unroll
      for (int k = 0; k < K; ++k) se[k] = sv[k].v[e];
      one<P, T, MODE>(pv.v[e], gv.v[e], se, mv.v[e], s, seed, stream, c.begin + i + e);
#pragma unroll
      for (int k = 0; k < K; ++k) sv[k].v[e] = se[k];
    }
    store_vec<T, V>(p + i, pv);
#pragma unroll
    for (int k = 0; k < K; ++k) store_vec<float, V>(st[k] + i, sv[k]);
    if constexpr (kHasM) store_vec<M, V>(mst + i, mv);
  }
  // Tail, or the whole chunk when an operand is misaligned (offset views, e.g. DDP bucket
  // grads): kIlp elements 512 apart per thread, all loaded before any is computed, so a thread
  // keeps about as many loads in flight as the vector loop.
  constexpr int kIlp = P::ilp(MODE);
  static_assert(kIlp >= 1, "P::ilp: at least one element in flight");
  for (int64_t i0 = nv * V + threadIdx.x; i0 < c.n; i0 += int64_t(kBlockSize) * kIlp) {
    T pi[kIlp] = {}, gi[kIlp] = {};
    float si[kIlp][KS] = {};
    M mi[kIlp] = {};
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t i = i0 + int64_t(u) * kBlockSize;
      if (i < c.n) {
        pi[u] = p[i];
        gi[u] = g[i];
#pragma unroll
        for (int k = 0; k < K; ++k) si[u][k] = st[k][i];
        if constexpr (kHasM) mi[u] = mst[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t i = i0 + int64_t(u) * kBlockSize;
      if (i < c.n) {
        one<P, T, MODE>(pi[u], gi[u], si[u], mi[u], s, seed, stream, c.begin + i);
        p[i] = pi[u];
#pragma unroll
        for (int k = 0; k < K; ++k) st[k][i] = si[u][k];
        if constexpr (kHasM) mst[i] = mi[u];
      }
    }
  }
}

// MODE is the requested master mode; the effective one per dtype is
// cpu::pick_elementwise_chunk's.
template <typename P, int MODE>
struct Functor {
  // Two 512-thread blocks per SM (<= 64 registers): one block's thread-0 setup and tail
  // overlap the other's loads (tests/test_cuda_compile.py pins registers and spills).
  static constexpr int kMinBlocksPerSm = 2;
  typename P::Config cfg;

  __device__ __forceinline__ void operator()(const MtaChunk<kEwFixed + P::kStates>& c) const {
    const StepCommon& k = cfg.common;
    // Skipped step: every block leaves before touching anything (uniform branch).
    if (k.found_inf != nullptr && *k.found_inf > 0.f) return;
    __shared__ typename P::Scalars sh_scalars;
    __shared__ uint64_t sh_seed;
    if (threadIdx.x == 0) {
      const double t = double(*static_cast<const float*>(c.ptr[kEwStep])) + 1.0;
      const double lr = k.lr_ptr != nullptr ? double(*k.lr_ptr) : k.lr;
      sh_scalars = P::scalars(cfg, lr, grad_mult(k), t);
      sh_seed = step_seed(k.seed, t);
    }
    __syncthreads();
    const typename P::Scalars s = sh_scalars;
    const uint64_t seed = sh_seed;
    switch (c.dtype) {  // effective_master_mode: fp32 params are their own master
      case kFloat32:
        range<P, float, effective_master_mode<float>(MODE)>(c, s, seed);
        break;
      case kFloat16:
        range<P, f16_t, effective_master_mode<f16_t>(MODE)>(c, s, seed);
        break;
      default:
        range<P, bf16_t, effective_master_mode<bf16_t>(MODE)>(c, s, seed);
        break;
    }
  }
};

// The first N operands of `t`: the lists of a variant with fewer state operands.
template <int N, int D>
TensorLists<N> first_operands(const TensorLists<D>& t) {
  static_assert(N <= D, "first_operands: more operands than the lists have");
  TensorLists<N> out{};
  for (int k = 0; k < N; ++k) out.data[k] = t.data[k];
  out.numel = t.numel;
  out.dtype = t.dtype;
  out.size = t.size;
  return out;
}

// One step of policy P over `t` (operands: elementwise_step.h's order, kEwFixed + P::kStates).
template <typename P>
cudaError_t step(const TensorLists<kEwFixed + P::kStates>& t, const typename P::Config& cfg,
                 cudaStream_t stream) {
  constexpr int D = kEwFixed + P::kStates;
  // bf16's mode is the requested one (every mode exists for bf16; the Functor narrows it per
  // dtype).
  return dispatch_master_mode(kBFloat16, cfg.common.master_mode, [&](auto, auto m) {
    return multi_tensor_apply<D>(t, kChunkSize, stream, Functor<P, decltype(m)::value>{cfg});
  });
}

}  // namespace mpfused::cuda::ew

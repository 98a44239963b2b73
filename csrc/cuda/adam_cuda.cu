// CUDA multi-tensor Adam/AdamW step. The per-element work is cpu::adam_chunk's loop body (the
// shared adam_math.h functions); the dtype/mode dispatch is cpu::pick_kernel's, done per block on
// the tensor's dtype code so one launch serves mixed-dtype lists.
#include "adam_cuda.h"

#include "multi_tensor_apply.cuh"

namespace mpfused::cuda {
namespace {

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

// One element: cpu::adam_chunk's loop body. `index` is the element's position in its tensor and
// `stream` the tensor's sr_stream (the stochastic-rounding stream).
template <typename T, int MODE, bool AMS>
__device__ __forceinline__ void adam_one(T& p, T g, float& m, float& v, float& vmax,
                                         float& master, int16_t& rem, const AdamScalars& s,
                                         uint64_t seed, uint64_t stream, int64_t index) {
  float w = load_weight<T, MODE>(&p, &master, &rem, 0);
  float vm = AMS ? vmax : 0.f;
  adam_element<AMS>(w, to_f32(g), m, v, vm, s);
  if (AMS) vmax = vm;
  store_weight<T, MODE>(w, &p, &master, &rem, 0, seed, stream, index);
}

// One chunk of one tensor: 4-element vectors (16 B for the fp32 operands, 8 B for 16-bit ones)
// when every operand used is aligned for them, scalar loop (4 elements in flight per thread) for
// the tail or an unaligned chunk.
template <typename T, int MODE, bool AMS>
__device__ __forceinline__ void adam_range(const MtaChunk<kAdamDepth>& c, const AdamScalars& s,
                                           uint64_t seed) {
  T* p = static_cast<T*>(c.ptr[kParam]) + c.begin;
  const T* g = static_cast<const T*>(c.ptr[kGrad]) + c.begin;
  float* m = static_cast<float*>(c.ptr[kExpAvg]) + c.begin;
  float* v = static_cast<float*>(c.ptr[kExpAvgSq]) + c.begin;
  float* vmax = AMS ? static_cast<float*>(c.ptr[kMaxExpAvgSq]) + c.begin : nullptr;
  float* master = MODE == kFp32Master ? static_cast<float*>(c.ptr[kMaster]) + c.begin : nullptr;
  int16_t* rem = MODE == kRemainder ? static_cast<int16_t*>(c.ptr[kMaster]) + c.begin : nullptr;
  const uint64_t stream = reinterpret_cast<uint64_t>(c.ptr[kStream]);

  constexpr int V = 4;
  const bool vec = is_aligned(p, V * sizeof(T)) && is_aligned(g, V * sizeof(T)) &&
                   is_aligned(m, 16) && is_aligned(v, 16) && (!AMS || is_aligned(vmax, 16)) &&
                   (MODE != kFp32Master || is_aligned(master, 16)) &&
                   (MODE != kRemainder || is_aligned(rem, 8));
  const int64_t nv = vec ? c.n / V : 0;
  for (int64_t j = threadIdx.x; j < nv; j += kBlockSize) {
    const int64_t i = j * V;
    VecN<T, V> pv = load_vec<T, V>(p + i);
    const VecN<T, V> gv = load_vec<T, V>(g + i);
    VecN<float, V> mv = load_vec<float, V>(m + i);
    VecN<float, V> vv = load_vec<float, V>(v + i);
    VecN<float, V> xv{};
    VecN<float, V> wv{};
    VecN<int16_t, V> rv{};
    if (AMS) xv = load_vec<float, V>(vmax + i);
    if (MODE == kFp32Master) wv = load_vec<float, V>(master + i);
    if (MODE == kRemainder) rv = load_vec<int16_t, V>(rem + i);
#pragma unroll
    for (int k = 0; k < V; ++k)
      adam_one<T, MODE, AMS>(pv.v[k], gv.v[k], mv.v[k], vv.v[k], xv.v[k], wv.v[k], rv.v[k], s,
                             seed, stream, c.begin + i + k);
    store_vec<T, V>(p + i, pv);
    store_vec<float, V>(m + i, mv);
    store_vec<float, V>(v + i, vv);
    if (AMS) store_vec<float, V>(vmax + i, xv);
    if (MODE == kFp32Master) store_vec<float, V>(master + i, wv);
    if (MODE == kRemainder) store_vec<int16_t, V>(rem + i, rv);
  }
  // Tail, or the whole chunk when an operand is misaligned (offset views, e.g. DDP bucket
  // grads): kIlp elements 512 apart per thread, all loaded before any is computed, so each thread
  // keeps about as many loads in flight as the vector loop (one at a time left memory idle).
  // amsgrad (one more operand) takes 3, which keeps it within 64 registers without spilling.
  constexpr int kIlp = AMS ? 3 : 4;
  for (int64_t i0 = nv * V + threadIdx.x; i0 < c.n; i0 += int64_t(kBlockSize) * kIlp) {
    T pi[kIlp] = {}, gi[kIlp] = {};
    float mi[kIlp] = {}, vi[kIlp] = {}, xi[kIlp] = {}, wi[kIlp] = {};
    int16_t ri[kIlp] = {};
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = i0 + int64_t(k) * kBlockSize;
      if (i < c.n) {
        pi[k] = p[i];
        gi[k] = g[i];
        mi[k] = m[i];
        vi[k] = v[i];
        if (AMS) xi[k] = vmax[i];
        if (MODE == kFp32Master) wi[k] = master[i];
        if (MODE == kRemainder) ri[k] = rem[i];
      }
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = i0 + int64_t(k) * kBlockSize;
      if (i < c.n) {
        adam_one<T, MODE, AMS>(pi[k], gi[k], mi[k], vi[k], xi[k], wi[k], ri[k], s, seed, stream,
                               c.begin + i);
        p[i] = pi[k];
        m[i] = mi[k];
        v[i] = vi[k];
        if (AMS) vmax[i] = xi[k];
        if (MODE == kFp32Master) master[i] = wi[k];
        if (MODE == kRemainder) rem[i] = ri[k];
      }
    }
  }
}

// MODE is the requested master mode; the effective one per dtype is cpu::pick_kernel's.
template <int MODE, bool AMS>
struct AdamFunctor {
  // Two 512-thread blocks per SM (<= 64 registers): one block's thread-0 setup and tail overlap
  // the other's loads. Left to itself ptxas takes 64-78 registers, one block (16 warps) per SM.
  // ptxas fits every mode in 64 with no spill (tests/test_cuda_compile.py pins both).
  static constexpr int kMinBlocksPerSm = 2;
  AdamConfig cfg;

  __device__ __forceinline__ void operator()(const MtaChunk<kAdamDepth>& c) const {
    // Skipped step: every block leaves before touching anything (uniform branch).
    if (cfg.found_inf != nullptr && *cfg.found_inf > 0.f) return;
    __shared__ AdamScalars sh_scalars;
    __shared__ uint64_t sh_seed;
    if (threadIdx.x == 0) {
      // cpu bindings' grad_mult: float reciprocal, clip coefficient in double then to float.
      float grad_mult = cfg.grad_scale != nullptr ? 1.f / *cfg.grad_scale : 1.f;
      if (cfg.norm_sq != nullptr && cfg.max_grad_norm > 0) {
        const double norm = sqrt(double(*cfg.norm_sq));
        const double coef = cfg.max_grad_norm / (norm + 1e-6);
        grad_mult *= float(coef < 1.0 ? coef : 1.0);  // std::min(1.0, coef): NaN gives 1
      }
      const double t = double(*static_cast<const float*>(c.ptr[kStep])) + 1.0;
      const double lr = cfg.lr_ptr != nullptr ? double(*cfg.lr_ptr) : cfg.lr;
      sh_scalars = adam_scalars(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                                cfg.decoupled, cfg.maximize, grad_mult, t);
      sh_seed = step_seed(cfg.seed, t);
    }
    __syncthreads();
    const AdamScalars s = sh_scalars;
    const uint64_t seed = sh_seed;
    switch (c.dtype) {
      case kFloat32:  // fp32 params are their own master
        adam_range<float, kNoMaster, AMS>(c, s, seed);
        break;
      case kFloat16:
        adam_range<f16_t, MODE == kFp32Master ? kFp32Master : kNoMaster, AMS>(c, s, seed);
        break;
      default:
        adam_range<bf16_t, MODE, AMS>(c, s, seed);
        break;
    }
  }
};

template <int MODE, bool AMS>
cudaError_t launch(const TensorLists<kAdamDepth>& t, const AdamConfig& cfg, cudaStream_t stream) {
  return multi_tensor_apply<kAdamDepth>(t, kChunkSize, stream, AdamFunctor<MODE, AMS>{cfg});
}

template <int MODE>
cudaError_t launch_ams(const TensorLists<kAdamDepth>& t, const AdamConfig& cfg,
                       cudaStream_t stream) {
  return cfg.amsgrad ? launch<MODE, true>(t, cfg, stream) : launch<MODE, false>(t, cfg, stream);
}

}  // namespace

cudaError_t adam_step(const TensorLists<kAdamDepth>& t, const AdamConfig& cfg,
                      cudaStream_t stream) {
  if (t.size == 0) return cudaSuccess;
  switch (cfg.master_mode) {
    case kFp32Master: return launch_ams<kFp32Master>(t, cfg, stream);
    case kRemainder: return launch_ams<kRemainder>(t, cfg, stream);
    case kStochastic: return launch_ams<kStochastic>(t, cfg, stream);
    default: return launch_ams<kNoMaster>(t, cfg, stream);
  }
}

}  // namespace mpfused::cuda

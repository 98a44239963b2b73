// CUDA loss-scaling kernels: multi-tensor check / unscale / sum of squares, and the scale update.
// Per-element math from amp_math.h / dtype.h (the same functions as the CPU kernels).
#include "amp_cuda.h"

#include <vector>

#include "multi_tensor_apply.cuh"

namespace mpfused::cuda {
namespace {

// Segment of the partials that belong to one tensor, written by the block that runs the tensor's
// first chunk: lets the finalize kernel find per-tensor ranges without any host->device copy.
struct NormSegment {
  int64_t first_chunk;
  int64_t nchunks;
  float* dst;
};
static_assert(sizeof(NormSegment) == 24, "workspace layout");

int64_t count_chunks(const TensorLists<1>& g) {
  int64_t n = 0;
  for (int64_t i = 0; i < g.size; ++i) n += (g.numel[i] + kChunkSize - 1) / kChunkSize;
  return n;
}

// 16-byte vector of T, loaded/stored with one 128-bit access.
template <typename T>
union Pack16 {
  uint4 raw;
  T v[16 / sizeof(T)];
};

// Block sum with a fixed reduction tree (warp shuffles, then warps in order): deterministic.
// The result is valid in thread 0 only. All threads of the block must call it.
template <int THREADS>
__device__ __forceinline__ double block_sum(double v) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "block size");
  __shared__ double warp_sums[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < THREADS / 32; ++w) s += warp_sums[w];
  return s;
}

template <typename T, bool WRITE, bool NORM>
__device__ __forceinline__ void check_element(T& x, float inv, uint32_t& bad, float& acc) {
  const float u = unscale_element(to_f32(x), inv, bad);
  if (WRITE) x = from_f32<T>(u);
  if (NORM) acc += u * u;
}

// One chunk [x, x + n) of one tensor: 16-byte vectors when x is 16-byte aligned (always the case
// for torch allocations, and chunk starts keep it since kChunkSize * 4 B is a multiple of 16),
// 2 vectors in flight per thread; scalar loop (4 elements in flight) for the tail or an
// unaligned chunk.
template <typename T, bool WRITE, bool NORM>
__device__ __forceinline__ void check_range(T* x, int64_t n, float inv, uint32_t& bad,
                                            float& acc) {
  constexpr int V = 16 / sizeof(T);
  constexpr int ILP = 2;
  const int64_t nv = (reinterpret_cast<uintptr_t>(x) & 15) == 0 ? n / V : 0;
  uint4* xv = reinterpret_cast<uint4*>(x);
  for (int64_t j = threadIdx.x; j < nv; j += int64_t(kBlockSize) * ILP) {
    Pack16<T> r[ILP];
#pragma unroll
    for (int k = 0; k < ILP; ++k) {
      const int64_t jj = j + int64_t(k) * kBlockSize;
      if (jj < nv) r[k].raw = xv[jj];
    }
#pragma unroll
    for (int k = 0; k < ILP; ++k) {
      const int64_t jj = j + int64_t(k) * kBlockSize;
      if (jj < nv) {
#pragma unroll
        for (int e = 0; e < V; ++e) check_element<T, WRITE, NORM>(r[k].v[e], inv, bad, acc);
        if (WRITE) xv[jj] = r[k].raw;
      }
    }
  }
  // Tail, or the whole chunk when x is not 16-byte aligned (offset views, e.g. DDP bucket grads):
  // kIlp elements 512 apart per thread, all loaded before any is checked, so each thread keeps
  // several loads in flight (one at a time left the memory idle).
  constexpr int kIlp = 4;
  for (int64_t i0 = nv * V + threadIdx.x; i0 < n; i0 += int64_t(kBlockSize) * kIlp) {
    T r[kIlp] = {};
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = i0 + int64_t(k) * kBlockSize;
      if (i < n) r[k] = x[i];
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = i0 + int64_t(k) * kBlockSize;
      if (i < n) {
        check_element<T, WRITE, NORM>(r[k], inv, bad, acc);
        if (WRITE) x[i] = r[k];
      }
    }
  }
}

// DEPTH 1: grads only. DEPTH 2: operand 1 is the per-tensor output pointer (float*).
template <bool WRITE, bool NORM, int DEPTH>
struct CheckFunctor {
  const float* inv_scale;
  float* found_inf;
  double* partials;       // [chunks], NORM only
  NormSegment* segments;  // [tensors], DEPTH 2 only

  __device__ __forceinline__ void operator()(const MtaChunk<DEPTH>& c) const {
    const float inv = *inv_scale;
    uint32_t bad = 0;
    float acc = 0.f;
    // The dtype is uniform across the block: no divergence.
    switch (c.dtype) {
      case kFloat32:
        check_range<float, WRITE, NORM>(static_cast<float*>(c.ptr[0]) + c.begin, c.n, inv, bad, acc);
        break;
      case kFloat16:
        check_range<f16_t, WRITE, NORM>(static_cast<f16_t*>(c.ptr[0]) + c.begin, c.n, inv, bad, acc);
        break;
      default:
        check_range<bf16_t, WRITE, NORM>(static_cast<bf16_t*>(c.ptr[0]) + c.begin, c.n, inv, bad, acc);
        break;
    }
    // Racy plain store of 1.f from any block that saw a non-finite value: every writer writes
    // the same value, and nothing ever writes 0 (torch's semantics).
    if (__syncthreads_or(int(bad)) && threadIdx.x == 0) *found_inf = 1.f;
    if (NORM) {
      const double s = block_sum<kBlockSize>(double(acc));
      if (threadIdx.x == 0) {
        partials[c.chunk] = s;
        if (DEPTH == 2 && c.chunk_in_tensor == 0)
          segments[c.tensor] = NormSegment{c.chunk, (c.numel + c.chunk_size - 1) / c.chunk_size,
                                           static_cast<float*>(c.ptr[DEPTH - 1])};
      }
    }
  }
};

constexpr int kFinalizeThreads = 256;
constexpr int kSegmentsPerBlock = kFinalizeThreads / 32;  // one warp per tensor

// Block 0: total = sum of all partials (fixed per-thread stride + fixed tree) added to norm_sq.
// Blocks 1..: one warp per tensor sums its consecutive partials (fixed lane stride + fixed
// shuffle tree) and adds the result to that tensor's output. No atomics: each output has a
// single writer, and the sums do not depend on timing.
__global__ void __launch_bounds__(kFinalizeThreads)
    norm_finalize_kernel(const double* partials, int64_t nchunks, const NormSegment* segments,
                         int64_t nsegments, float* norm_sq) {
  if (blockIdx.x == 0) {
    if (norm_sq == nullptr) return;
    double s = 0;
    for (int64_t c = threadIdx.x; c < nchunks; c += kFinalizeThreads) s += partials[c];
    s = block_sum<kFinalizeThreads>(s);
    if (threadIdx.x == 0) *norm_sq += float(s);
    return;
  }
  const int64_t seg = int64_t(blockIdx.x - 1) * kSegmentsPerBlock + (threadIdx.x >> 5);
  if (seg >= nsegments) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const NormSegment sg = segments[seg];
  double s = 0;
  for (int64_t c = lane; c < sg.nchunks; c += 32) s += partials[sg.first_chunk + c];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if (lane == 0) *sg.dst += float(s);
}

template <bool WRITE, bool NORM, int DEPTH>
cudaError_t launch_check(const TensorLists<DEPTH>& lists, const float* inv_scale, float* found_inf,
                         double* partials, NormSegment* segments, cudaStream_t stream) {
  const CheckFunctor<WRITE, NORM, DEPTH> f{inv_scale, found_inf, partials, segments};
  return multi_tensor_apply<DEPTH>(lists, kChunkSize, stream, f);
}

template <bool WRITE>
cudaError_t launch_check_any(const TensorLists<1>& grads, const float* inv_scale,
                             float* found_inf, float* const* per_tensor, double* partials,
                             NormSegment* segments, cudaStream_t stream) {
  if (!partials) return launch_check<WRITE, false, 1>(grads, inv_scale, found_inf, nullptr, nullptr, stream);
  if (!per_tensor) return launch_check<WRITE, true, 1>(grads, inv_scale, found_inf, partials, nullptr, stream);
  TensorLists<2> lists;
  lists.data[0] = grads.data[0];
  lists.data[1] = reinterpret_cast<void* const*>(per_tensor);
  lists.numel = grads.numel;
  lists.dtype = grads.dtype;
  lists.size = grads.size;
  return launch_check<WRITE, true, 2>(lists, inv_scale, found_inf, partials, segments, stream);
}

// Per-tensor sums need every listed tensor to own a chunk (its segment is written by its first
// chunk): drop empty tensors here (the bindings already do; this keeps the raw API safe).
struct NonEmpty {
  std::vector<void*> grads;
  std::vector<float*> outs;
  std::vector<int64_t> numel;
  std::vector<int32_t> dtype;
  NonEmpty(const TensorLists<1>& g, float* const* per_tensor) {
    for (int64_t i = 0; i < g.size; ++i) {
      if (g.numel[i] == 0) continue;
      grads.push_back(g.data[0][i]);
      outs.push_back(per_tensor[i]);
      numel.push_back(g.numel[i]);
      dtype.push_back(g.dtype[i]);
    }
  }
  TensorLists<1> view() const {
    TensorLists<1> v;
    v.data[0] = grads.data();
    v.numel = numel.data();
    v.dtype = dtype.data();
    v.size = int64_t(numel.size());
    return v;
  }
};

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker,
                                    int32_t* hysteresis_tracker, const float* found_inf,
                                    ScaleUpdateParams p) {
  mpfused::update_scale(scale, growth_tracker, hysteresis_tracker, *found_inf, p);
}

}  // namespace

int64_t amp_check_workspace_bytes(const TensorLists<1>& grads, bool norm, bool per_tensor) {
  if (!norm && !per_tensor) return 0;
  return count_chunks(grads) * int64_t(sizeof(double)) +
         (per_tensor ? grads.size * int64_t(sizeof(NormSegment)) : 0);
}

cudaError_t amp_check(const TensorLists<1>& grads, const float* inv_scale, bool write_back,
                      float* found_inf, float* norm_sq, float* const* norm_sq_per_tensor,
                      void* workspace, cudaStream_t stream) {
  if (grads.size == 0) return cudaSuccess;
  const bool norm = norm_sq != nullptr || norm_sq_per_tensor != nullptr;
  bool has_empty = false;
  for (int64_t i = 0; i < grads.size && !has_empty; ++i) has_empty = grads.numel[i] == 0;
  if (norm_sq_per_tensor && has_empty) {
    const NonEmpty ne(grads, norm_sq_per_tensor);
    if (ne.numel.empty()) return cudaSuccess;
    return amp_check(ne.view(), inv_scale, write_back, found_inf, norm_sq, ne.outs.data(),
                     workspace, stream);
  }
  const int64_t nchunks = norm ? count_chunks(grads) : 0;
  double* partials = norm ? static_cast<double*>(workspace) : nullptr;
  NormSegment* segments =
      norm_sq_per_tensor ? reinterpret_cast<NormSegment*>(partials + nchunks) : nullptr;
  cudaError_t err =
      write_back ? launch_check_any<true>(grads, inv_scale, found_inf, norm_sq_per_tensor,
                                          partials, segments, stream)
                 : launch_check_any<false>(grads, inv_scale, found_inf, norm_sq_per_tensor,
                                           partials, segments, stream);
  if (err != cudaSuccess || !norm || nchunks == 0) return err;
  const int64_t nseg = segments ? grads.size : 0;
  const int64_t blocks = 1 + (nseg + kSegmentsPerBlock - 1) / kSegmentsPerBlock;
  MPF_LAUNCH(dim3(unsigned(blocks)), dim3(kFinalizeThreads), stream, norm_finalize_kernel)(
      partials, nchunks, segments, nseg, norm_sq);
  return cudaGetLastError();
}

cudaError_t update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                         const float* found_inf, const ScaleUpdateParams& params,
                         cudaStream_t stream) {
  MPF_LAUNCH(1, 1, stream, update_scale_kernel)(scale, growth_tracker, hysteresis_tracker,
                                               found_inf, params);
  return cudaGetLastError();
}

}  // namespace mpfused::cuda

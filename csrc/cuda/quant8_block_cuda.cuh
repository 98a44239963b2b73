// What the block-wise 8-bit CUDA kernels (adam8bit_cuda.cu, one_state8bit_cuda.cuh) share: the
// work split of a chunk into passes of 4-element vectors, the vector access helpers, the new
// absmax (block max of |state| per quantization block) and the requantization of a vector.
#pragma once
#include <stdint.h>

#include "mpfused/quant8_math.h"
#include "multi_tensor_apply.cuh"

namespace mpfused::cuda {
namespace q8 {

constexpr int kWarp = 32;
constexpr int kWarps = kBlockSize / kWarp;
constexpr int kVec = 4;                                  // consecutive elements per access
constexpr int64_t kPassElems = int64_t(kBlockSize) * kVec;  // 2048
constexpr int64_t kChunk = 4096;                         // multi_tensor_apply chunk size
constexpr int kPasses = int(kChunk / kPassElems);        // 2
constexpr int64_t kMinBlock = 64, kMaxBlock = 4096;
constexpr int kMaxQBlocks = int(kChunk / kMinBlock);     // quantization blocks per chunk (<= 64)
constexpr int64_t kWarpElems = int64_t(kWarp) * kVec;    // elements of one warp in one pass: 128
constexpr int kPartials = int(kChunk / kWarpElems);      // stage-A partials per chunk: 32

static_assert(kChunk % kMaxBlock == 0, "a chunk must hold whole quantization blocks");
static_assert(kChunk % kPassElems == 0, "a chunk is whole passes");
static_assert(kMinBlock % kVec == 0, "a vector never straddles two quantization blocks");
static_assert(kMinBlock / kVec >= 2 && kMinBlock / kVec <= 2 * kWarp, "stage-A segments");
static_assert(kPartials <= kWarp, "stage B runs on one warp");

template <typename T, int V>
struct alignas(sizeof(T) * V) VecN {
  T v[V];
};

__device__ __forceinline__ bool aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

__device__ __forceinline__ uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// kVec elements from p[e..]: one vector access when `vec` and the whole vector is in range,
// else element by element (the first cnt). Out-of-range entries are left as they are.
template <typename T>
__device__ __forceinline__ void load_n(const T* p, int e, int cnt, bool vec,
                                       T* out) {
  if (vec && cnt >= kVec) {
    const VecN<T, kVec> x = *reinterpret_cast<const VecN<T, kVec>*>(p + e);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = x.v[j];
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (j < cnt) out[j] = p[e + j];
  }
}

template <typename T>
__device__ __forceinline__ void store_n(T* p, int e, int cnt, bool vec,
                                        const T* in) {
  if (vec && cnt >= kVec) {
    VecN<T, kVec> x;
#pragma unroll
    for (int j = 0; j < kVec; ++j) x.v[j] = in[j];
    *reinterpret_cast<VecN<T, kVec>*>(p + e) = x;
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (j < cnt) p[e + j] = in[j];
  }
}

// ---- new absmax of S states at once --------------------------------------------------------
// Block max per quantization block, deterministic (a fixed butterfly, and max is exact): the
// maxima are reduced as the bit patterns of |x| (uint order = float order for non-negative
// floats; a NaN state gives a NaN absmax in any order).
//   stage A, per pass: a butterfly over the min(32, B / 4) lanes that cover one quantization
//            block (B <= 128: final) or the whole warp (128 elements);
//   stage B (B > 128): warp 0 reduces the 32 per-warp partials of the chunk in segments of
//            B / 128.
template <int S>
struct QMax {
  uint32_t part[S][kPartials];  // stage A partials (B > 128), |state| bits
  uint32_t am[S][kMaxQBlocks];  // new absmax bits per quantization block of the chunk
};

// Stage-A lanes of quantization block size B.
__device__ __forceinline__ int qmax_lanes(int B) { return B / kVec < kWarp ? B / kVec : kWarp; }

// Stage A of pass k, every lane in or out of range (out of range: x = 0). x[s]: the bits of
// max |state s| over the lane's vector, which starts at chunk element e; B = 1 << lb.
template <int S>
__device__ __forceinline__ void qmax_stage_a(QMax<S>& r, uint32_t (&x)[S], int B, int lb,
                                             int seg, int k, int e) {
  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
  for (int off = seg / 2; off > 0; off /= 2) {
#pragma unroll
    for (int s = 0; s < S; ++s) x[s] = umax(x[s], __shfl_xor_sync(0xffffffffu, x[s], off));
  }
  if (B <= int(kWarpElems)) {
    if (lane % seg == 0) {  // first lane of its quantization block: the block's max
#pragma unroll
      for (int s = 0; s < S; ++s) r.am[s][e >> lb] = x[s];
    }
  } else if (lane == 0) {  // partial of elements [128 i, 128 i + 128) of the chunk
#pragma unroll
    for (int s = 0; s < S; ++s) r.part[s][k * kWarps + warp] = x[s];
  }
}

// After the last pass: the barrier, then stage B (B > 128) and its barrier. On return r.am holds
// the max of every quantization block of the chunk.
template <int S>
__device__ __forceinline__ void qmax_finish(QMax<S>& r, int B) {
  __syncthreads();
  if (B > kWarpElems) {
    const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
    if (warp == 0) {
      const int seg = B / int(kWarpElems);
      uint32_t x[S];
#pragma unroll
      for (int s = 0; s < S; ++s) x[s] = r.part[s][lane];
      for (int off = seg / 2; off > 0; off /= 2) {
#pragma unroll
        for (int s = 0; s < S; ++s) x[s] = umax(x[s], __shfl_xor_sync(0xffffffffu, x[s], off));
      }
      if (lane % seg == 0) {
#pragma unroll
        for (int s = 0; s < S; ++s) r.am[s][lane / seg] = x[s];
      }
    }
    __syncthreads();
  }
}

// ---- requantize ------------------------------------------------------------------------------
// The codes of kVec parked fp32 states x scaled by r = quant8_inv_scale(absmax), searched in the
// thresholds `eyt` (Eytzinger order): the CPU's codes. SIGNED: bitsandbytes' sign rule of a
// signed map's state (zc: the map's +0 code).
template <bool SIGNED>
__device__ __forceinline__ void encode_n(const float* eyt, const VecN<float, kVec>& x, float r,
                                         int32_t zc, uint8_t* out) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int32_t q = quant8_encode_eytzinger(eyt, x.v[j] * r);
    out[j] = uint8_t(SIGNED ? quant8_keep_negative(q, x.v[j], zc) : q);
  }
}

}  // namespace q8
}  // namespace mpfused::cuda

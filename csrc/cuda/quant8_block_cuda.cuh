// What the block-wise 8-bit CUDA kernels (adam8bit_cuda.cu, one_state8bit_cuda.cuh) share: the
// work split of a chunk into passes of 4-element vectors, and the vector access helpers.
#pragma once
#include <stdint.h>

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

}  // namespace q8
}  // namespace mpfused::cuda

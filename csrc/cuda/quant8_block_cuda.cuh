// What the block-wise 8-bit CUDA kernels (adam8bit_cuda.cu, one_state8bit_cuda.cuh) share: the
// work split of a chunk into passes of 4-element vectors, the vector access helpers (8-bit and
// packed 4-bit codes), the new absmax (block max of |state| per quantization block) and the
// requantization of a vector.
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

// ---- codes of a vector ------------------------------------------------------------------------
// The codes of kVec elements from chunk element e (a multiple of kVec) of a BITS-bit state whose
// chunk starts at byte c: BITS = 8, a byte each (load_n / store_n); BITS = 4, two per byte in
// quant8_math.h's order (element 2k in the high nibble), kVec / 2 bytes at c + e / 2. Tails: the
// first cnt elements; an odd cnt (a tensor's odd end) stores its last byte with a zero low
// nibble, as the CPU kernel does.
template <int BITS>
struct Codes;
template <>
struct Codes<8> {
  uint8_t v[kVec];
  __device__ __forceinline__ int32_t operator[](int j) const { return v[j]; }
};
template <>
struct Codes<4> {  // kept packed in one register: byte k of the vector in bits 8k .. 8k + 7
  uint32_t w;
  __device__ __forceinline__ int32_t operator[](int j) const {
    return int32_t(w >> (8 * (j >> 1) + 4 * ((j & 1) ^ 1))) & 0xF;
  }
};
static_assert(kVec == 4, "Codes<4>: the codes of a vector are two bytes");

// `vec`: the 8-bit codes are one aligned 4-byte access. 4-bit codes are read as two bytes
// whatever the alignment (one 2-byte access where aligned would be no fewer transactions per
// warp, and its branch made ptxas 13.0 spill 76-124 B on sm_90 at the 64-register cap).
template <int BITS>
__device__ __forceinline__ Codes<BITS> load_codes(const uint8_t* c, int e, int cnt, bool vec) {
  static_assert(BITS == 8 || BITS == 4, "8-bit or 4-bit codes");
  Codes<BITS> out;
  if constexpr (BITS == 8) {
    load_n(c, e, cnt, vec, out.v);
  } else {
    out.w = uint32_t(c[e / 2]) | (cnt > 2 ? uint32_t(c[e / 2 + 1]) << 8 : 0u);
  }
  return out;
}

// `vec`: the codes are one aligned access of kVec * BITS / 8 bytes.
template <int BITS>
__device__ __forceinline__ void store_codes(uint8_t* c, int e, int cnt, bool vec,
                                            const uint8_t* in) {
  static_assert(BITS == 8 || BITS == 4, "8-bit or 4-bit codes");
  if constexpr (BITS == 8) {
    store_n(c, e, cnt, vec, in);
  } else if (vec && cnt >= kVec) {
    *reinterpret_cast<uint16_t*>(c + e / 2) =
        uint16_t(quant4_pack(in[0], in[1]) | (uint32_t(quant4_pack(in[2], in[3])) << 8));
  } else {
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j)
      if (2 * j < cnt) c[e / 2 + j] = quant4_pack(in[2 * j], 2 * j + 1 < cnt ? in[2 * j + 1] : 0);
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
// signed map's state (zc: the map's +0 code; 8-bit only). BITS = 4: thresholds of a 16-entry
// map padded with +inf, searched from node 16 (quant4_encode_eytzinger, the same code).
template <bool SIGNED, int BITS = 8>
__device__ __forceinline__ void encode_n(const float* eyt, const VecN<float, kVec>& x, float r,
                                         int32_t zc, uint8_t* out) {
  static_assert(BITS == 8 || !SIGNED, "4-bit codes have no sign rule");
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int32_t q = BITS == 8 ? quant8_encode_eytzinger(eyt, x.v[j] * r)
                                : quant4_encode_eytzinger(eyt, x.v[j] * r);
    out[j] = uint8_t(SIGNED ? quant8_keep_negative(q, x.v[j], zc) : q);
  }
}

}  // namespace q8
}  // namespace mpfused::cuda

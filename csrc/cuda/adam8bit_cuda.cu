// CUDA multi-tensor Adam/AdamW step with block-wise 8-bit or 4-bit moments (adam8bit_step_ and
// adam4bit_step_). The per-element work is cpu::adam8bit_chunk's (the shared adam_math.h /
// quant8_math.h functions, maps and thresholds in shared memory); the dtype/mode dispatch is
// dispatch_master_mode's (as the CPU kernel's), done per CUDA block on the tensor's dtype code
// (effective_master_mode) so one launch serves mixed-dtype lists.
//
// Code width BITS (8 | 4) is a specialization of the same kernel, as cpu::adam8bit_chunk's BITS:
// 4-bit maps have 16 entries (copied as such; their 15 thresholds padded with +inf to 255 by the
// prepare launch, searched from node 16: quant4_encode_eytzinger), two codes per byte (element 2k
// in the high nibble, quant8_block_cuda.cuh's load_codes / store_codes: two byte loads, a 2-byte
// store where aligned, an odd tensor end with a zero low nibble), codes of a chunk at begin / 2,
// no sign rule, and the maps' validity is a flag of the prepared workspace (sorted; 8-bit also
// +0 above the first entry).
//
// Work split. multi_tensor_apply cuts every tensor into chunks of q8::kChunk = 4096 elements, one
// CUDA block (kBlockSize = 512 threads) per chunk. 4096 is a multiple of every quantization block
// size (powers of two in [64, 4096]) and chunks start at multiples of 4096, so a chunk holds whole
// quantization blocks (the tensor's last one may be short) and no quantization block is shared
// by two CUDA blocks: the new absmax of a quantization block is a block-local reduction, with no
// atomics and no second pass. bitsandbytes runs one 256-thread block per 256-element
// quantization block; here one block runs 4096 / block_size of them and serves every block size
// with one kernel.
//
// Per call: a prepare launch (adam8bit_prepare.cuh) computes what does not change within the
// step into the caller's workspace: the 2 x 255 decision thresholds in Eytzinger order, the map
// checks and the +0 code of map 1, and each tensor's AdamScalars (fp64 pow) and seed.
// Per block:
//   setup     all threads copy both maps (4-bit: their 16 entries) and both threshold arrays to
//             shared memory (one float each per array, coalesced); thread 0 copies the tensor's
//             scalars, the +0 code and the validity flag. One barrier, no arithmetic.
//   update    two passes; in pass k thread t owns elements 2048 k + 4t .. +3 (coalesced 16/8/4-
//             byte accesses when aligned, element-wise otherwise and at the tail; 4 consecutive
//             elements are always in one quantization block): it dequantizes with the OLD
//             absmax, runs adam_element in fp32, stores the param (and master), parks the
//             updated fp32 moments in its own slots of shared memory and takes |m|, |v| maxima.
//   reduce    block max per quantization block, deterministic (quant8_block_cuda.cuh's QMax:
//             a fixed butterfly over the bit patterns of |x|, a NaN moment gives a NaN absmax).
//             Stage A, per pass: a butterfly over the min(32, block_size / 4) lanes that cover
//             one quantization block (block_size <= 128: final) or the whole warp (128
//             elements); stage B (block_size > 128): warp 0 reduces the 32 per-warp partials of
//             the chunk in segments of block_size / 128.
//   encode    the new absmax is stored, then each thread requantizes its own parked moments
//             (quant8_inv_scale, quant8_encode_eytzinger over the shared thresholds: the CPU's
//             codes, with ~3x fewer shared-memory bank conflicts than the sorted layout,
//             keep_negative for 8-bit m).
// One barrier in setup, one or two in the reduction. found_inf > 0: every block leaves first.
// Shared memory 37.7 KB (32 KB of parked moments); at most 64 registers (Adam8bitFunctor asks
// for two blocks per SM), so one block's setup and reduction overlap the other's memory traffic.
// Both widths (tests/test_cuda_compile.py pins the figures).
//
// tests/cuda_emulation/adam8bit_vs_cpu.cpp runs this file unchanged on the host (every block as
// 512 cooperative threads, tests/cuda_emulation/cuda_runtime.h) and compares it byte for byte
// with the CPU kernel.
#include "adam8bit_cuda.h"

#include <stddef.h>

#include "adam8bit_prepare.cuh"
#include "mpfused/quant8_math.h"
#include "multi_tensor_apply.cuh"
#include "quant8_block_cuda.cuh"

namespace mpfused::cuda {
namespace q8 {

static_assert(kBlockSize == 2 * kQuantCodes, "setup: one thread per map entry of both maps");

struct alignas(16) Shared {  // 16: the parked moments are accessed as 16-byte vectors
  float mst[kChunk];  // updated fp32 moments of the chunk until they are requantized
  float vst[kChunk];
  float map1[kQuantCodes];
  float map2[kQuantCodes];
  float eyt1[kQuantCodes];  // decision thresholds in Eytzinger order (quant8_encode_eytzinger)
  float eyt2[kQuantCodes];
  QMax<2> red;  // new absmax of m (0) and v (1): stage-A partials, block maxima
  AdamScalars scalars;
  uint64_t seed;
  int32_t zero_code;  // 8-bit: the +0 code of map 1 (the sign rule)
  int32_t valid;      // the maps passed the prepare launch's checks
};
// Bank of eyt[k] = k mod 32, as tests/test_quant8_eytzinger.py's conflict count assumes.
static_assert(offsetof(Shared, eyt1) % 128 == 0 && offsetof(Shared, eyt2) % 128 == 0,
              "Eytzinger thresholds start at bank 0");

// One chunk (whole quantization blocks) of one tensor, run by all kBlockSize threads of a block.
// T / MODE: the effective storage type and master mode (dispatch_master_mode's choice); BITS: the
// code width.
template <typename T, int MODE, int BITS>
__device__ __forceinline__ void run_chunk(Shared& sh, const MtaChunk<kAdam8bitDepth>& c,
                                          const Adam8bitConfig& cfg, const Workspace& ws) {
  const int tid = int(threadIdx.x);
  // Chunk-local indices fit in int (n <= kChunk); the block size is a power of two.
  const int n = int(c.n);
  const int B = int(cfg.block_size);
  int lb = 0;
  while ((1 << lb) < B) ++lb;
  const int nq = (n + B - 1) >> lb;  // quantization blocks in this chunk
  float* absmax1 = static_cast<float*>(c.ptr[kQ8Absmax1]) + (c.begin >> lb);
  float* absmax2 = static_cast<float*>(c.ptr[kQ8Absmax2]) + (c.begin >> lb);

  // ---- setup: copy what the prepare launch computed for this step ----------------------------
  constexpr int kCodes = 1 << BITS;  // map entries (only codes < kCodes are ever decoded)
  {
    const int i = tid % kQuantCodes;
    if (tid < kQuantCodes) {
      if (i < kCodes) sh.map1[i] = cfg.map1[i];
      sh.eyt1[i] = ws.maps->eyt[0][i];
    } else {
      if (i < kCodes) sh.map2[i] = cfg.map2[i];
      sh.eyt2[i] = ws.maps->eyt[1][i];
    }
  }
  if (tid == 0) {
    const PreparedTensor& pt = ws.tensors[c.tensor];
    sh.scalars = pt.s;
    sh.seed = pt.seed;
    sh.zero_code = ws.maps->zero_code;
    sh.valid = ws.maps->valid;
  }
  __syncthreads();
  const int32_t zc = sh.zero_code;
  if (sh.valid == 0) {  // a map is unusable (uniform): poison the absmax, write nothing else
    if (tid < nq) {
      absmax1[tid] = NAN;
      absmax2[tid] = NAN;
    }
    return;
  }
  const AdamScalars s = sh.scalars;
  const uint64_t seed = sh.seed;

  // ---- update ---------------------------------------------------------------------------------
  T* p = static_cast<T*>(c.ptr[kQ8Param]) + c.begin;
  const T* g = static_cast<const T*>(c.ptr[kQ8Grad]) + c.begin;
  // codes of the chunk: c.begin is a multiple of kChunk, so 4-bit ones start on a byte
  uint8_t* c1 = static_cast<uint8_t*>(c.ptr[kQ8ExpAvg]) + c.begin * BITS / 8;
  uint8_t* c2 = static_cast<uint8_t*>(c.ptr[kQ8ExpAvgSq]) + c.begin * BITS / 8;
  constexpr unsigned kCodeBytes = kVec * BITS / 8;  // of one vector
  using M = master_t<MODE>;
  constexpr bool kHasM = MasterStore<MODE>::kStored;
  M* mst = master_operand<MODE>(c.ptr[kQ8Master], c.begin);
  const bool vec = aligned(p, kVec * sizeof(T)) && aligned(g, kVec * sizeof(T)) &&
                   aligned(c1, kCodeBytes) && aligned(c2, kCodeBytes) &&
                   (!kHasM || aligned(mst, kVec * sizeof(M)));

  // Pass k: thread t owns elements e = 2048 k + 4t .. +3 (one quantization block). The updated
  // fp32 moments go to shared memory (the thread's own slots) until the absmax is known, so a
  // thread keeps nothing across passes but its pointers and scalars (register budget: two
  // 512-thread blocks per SM).
  const int seg = qmax_lanes(B);
#pragma unroll 1
  for (int k = 0; k < kPasses; ++k) {
    const int e = k * int(kPassElems) + tid * kVec;
    const int cnt = n - e;
    VecN<float, kVec> mv, vv;
    uint32_t x[2] = {0u, 0u};  // bits of max |m|, max |v| over the vector
    if (cnt > 0) {
      T pv[kVec], gv[kVec];
      M mv_[kVec] = {};
      load_n(p, e, cnt, vec, pv);
      load_n(g, e, cnt, vec, gv);
      const Codes<BITS> k1 = load_codes<BITS>(c1, e, cnt, vec);
      const Codes<BITS> k2 = load_codes<BITS>(c2, e, cnt, vec);
      if constexpr (kHasM) load_n(mst, e, cnt, vec, mv_);
      const float a1 = absmax1[e >> lb];  // the OLD absmax (overwritten after the barriers)
      const float a2 = absmax2[e >> lb];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        mv.v[j] = 0.f;
        vv.v[j] = 0.f;
        if (j >= cnt) continue;
        // cpu::adam8bit_chunk's loop body (load_weight / adam_element / store_weight).
        float w = load_weight<T, MODE>(pv[j], mv_[j]);
        float m = quant8_decode(sh.map1, k1[j], a1);
        float v = quant8_decode(sh.map2, k2[j], a2);
        float unused = 0.f;
        adam_element<false>(w, to_f32(gv[j]), m, v, unused, s);
        store_weight<T, MODE>(w, pv[j], mv_[j], seed, reinterpret_cast<uint64_t>(c.ptr[kQ8Stream]),
                              c.begin + (e + j));
        mv.v[j] = m;
        vv.v[j] = v;
        x[0] = umax(x[0], f32_bits(fabsf(m)));
        x[1] = umax(x[1], f32_bits(fabsf(v)));
      }
      store_n(p, e, cnt, vec, pv);
      if constexpr (kHasM) store_n(mst, e, cnt, vec, mv_);
      *reinterpret_cast<VecN<float, kVec>*>(sh.mst + e) = mv;
      *reinterpret_cast<VecN<float, kVec>*>(sh.vst + e) = vv;
    }
    qmax_stage_a(sh.red, x, B, lb, seg, k, e);
  }
  qmax_finish(sh.red, B);

  // ---- new absmax, requantize -------------------------------------------------------------------
  if (tid < nq) {  // every old-absmax read happened before the barriers above
    absmax1[tid] = bits_f32(sh.red.am[0][tid]);
    absmax2[tid] = bits_f32(sh.red.am[1][tid]);
  }
#pragma unroll 1
  for (int k = 0; k < kPasses; ++k) {
    const int e = k * int(kPassElems) + tid * kVec;
    const int cnt = n - e;
    if (cnt <= 0) break;
    const float r1 = quant8_inv_scale(bits_f32(sh.red.am[0][e >> lb]));
    const float r2 = quant8_inv_scale(bits_f32(sh.red.am[1][e >> lb]));
    const VecN<float, kVec> mv = *reinterpret_cast<const VecN<float, kVec>*>(sh.mst + e);
    const VecN<float, kVec> vv = *reinterpret_cast<const VecN<float, kVec>*>(sh.vst + e);
    uint8_t k1[kVec], k2[kVec];
    encode_n<BITS == 8, BITS>(sh.eyt1, mv, r1, zc, k1);  // the sign rule: 8-bit m only
    encode_n<false, BITS>(sh.eyt2, vv, r2, zc, k2);
    store_codes<BITS>(c1, e, cnt, vec, k1);
    store_codes<BITS>(c2, e, cnt, vec, k2);
  }
}

// The chunk of one block: skip test, then the dtype/mode dispatch (effective_master_mode). MODE
// is the requested master mode.
template <int MODE, int BITS>
__device__ __forceinline__ void run_block(Shared& sh, const MtaChunk<kAdam8bitDepth>& c,
                                          const Adam8bitConfig& cfg, const Workspace& ws) {
  // Skipped step: every block leaves before touching anything (uniform branch).
  if (cfg.found_inf != nullptr && *cfg.found_inf > 0.f) return;
  switch (c.dtype) {  // effective_master_mode: fp32 params are their own master
    case kFloat32:
      run_chunk<float, effective_master_mode<float>(MODE), BITS>(sh, c, cfg, ws);
      break;
    case kFloat16:
      run_chunk<f16_t, effective_master_mode<f16_t>(MODE), BITS>(sh, c, cfg, ws);
      break;
    default:
      run_chunk<bf16_t, effective_master_mode<bf16_t>(MODE), BITS>(sh, c, cfg, ws);
      break;
  }
}

}  // namespace q8

namespace {

template <int MODE, int BITS>
struct Adam8bitFunctor {
  // Two blocks per SM (64 registers): one block's setup and barrier-bound reduction overlap the
  // other's memory traffic. Left to itself ptxas (13.0, sm_90) takes 82-92 registers, one block
  // per SM; the cap costs the fp32-master mode 8 B of spill stores. Not yet measured on a GPU.
  static constexpr int kMinBlocksPerSm = 2;
  Adam8bitConfig cfg;
  void* workspace;  // written by q8::prepare earlier on the stream

  __device__ __forceinline__ void operator()(const MtaChunk<kAdam8bitDepth>& c) const {
    __shared__ q8::Shared sh;
    q8::run_block<MODE, BITS>(sh, c, cfg, q8::Workspace(workspace));
  }
};

template <int MODE, int BITS>
cudaError_t launch(const TensorLists<kAdam8bitDepth>& t, const Adam8bitConfig& cfg,
                   void* workspace, cudaStream_t stream) {
  const cudaError_t err = q8::prepare<BITS>(t, cfg, workspace, stream);
  if (err != cudaSuccess) return err;
  return multi_tensor_apply<kAdam8bitDepth>(t, q8::kChunk, stream,
                                            Adam8bitFunctor<MODE, BITS>{cfg, workspace});
}

}  // namespace

cudaError_t adam8bit_step(const TensorLists<kAdam8bitDepth>& t, const Adam8bitConfig& cfg,
                          void* workspace, cudaStream_t stream) {
  const int64_t b = cfg.block_size;
  if (b < q8::kMinBlock || b > q8::kMaxBlock || (b & (b - 1)) != 0) return cudaErrorInvalidValue;
  if (cfg.code_bits != 8 && cfg.code_bits != 4) return cudaErrorInvalidValue;
  if (workspace == nullptr || (reinterpret_cast<uintptr_t>(workspace) & 15) != 0)
    return cudaErrorInvalidValue;
  if (t.size == 0) return cudaSuccess;
  // bf16 has every mode: the kernel narrows it per dtype (effective_master_mode)
  return dispatch_master_mode(kBFloat16, cfg.master_mode, [&](auto, auto m) {
    constexpr int kMode = decltype(m)::value;
    return cfg.code_bits == 4 ? launch<kMode, 4>(t, cfg, workspace, stream)
                              : launch<kMode, 8>(t, cfg, workspace, stream);
  });
}

size_t adam8bit_workspace_bytes(int64_t ntensors) { return q8::workspace_bytes(ntensors); }

}  // namespace mpfused::cuda

// The CUDA kernel of every step with one block-wise 8-bit or 4-bit state (one_state8bit_cuda.h:
// SGD's momentum, Lion's moment), generic over the algorithm's per-element update, as
// cpu::state8bit_chunk (one_state8bit_kernel.h) is on the CPU. Structure of adam8bit_cuda.cu with
// one state instead of two, on the same shared pieces (quant8_block_cuda.cuh: chunk split,
// vector access, packed 4-bit codes, new absmax, requantize; quant8_prepare.cuh: the prepare
// launch):
//
//   work      one 512-thread block per 4096-element chunk (whole quantization blocks).
//   prepare   once per call: the map's 255 thresholds in Eytzinger order (4-bit: its 15, padded
//             with +inf), the map checks (validity flag) and its +0 code (8-bit); per tensor the
//             policy's Scalars (from the device step counter, lr, grad_scale, norm_sq) and the
//             stochastic-rounding seed.
//   setup     threads 0-255 copy the map (4-bit: threads 0-15, its 16 entries), 256-511 the
//             thresholds, to shared memory; thread 0 copies the tensor's scalars. One barrier.
//   update    two passes of 4 consecutive elements per thread (16/8/4-byte vectors when every
//             operand is aligned, element by element otherwise and at the tail; 4-bit codes:
//             two byte loads): decode with the OLD absmax, P::element in fp32 (load_weight /
//             store_weight of adam_math.h: the CPU's master modes), park the updated state in
//             shared memory, take max |s|.
//   reduce    QMax<1>: one barrier (block_size <= 128) or two.
//   encode    the new absmax is stored, then each thread requantizes its own parked states
//             (Eytzinger search; 8-bit: bitsandbytes' sign rule at the +0 code; 4-bit: the
//             nearest code, quant4_encode_eytzinger: the CPU's codes).
// found_inf > 0: every block leaves first, and the prepare writes nothing.
// Shared memory 18.9 KB (16 KB of parked states); two blocks per SM asked (<= 64 registers).
//
// Code width BITS (8 | 4, State8bitCommon::code_bits) is a specialization of the same kernel, as
// cpu::state8bit_chunk's BITS and adam8bit_cuda.cu's: 4-bit (sgd4bit_step_, lion4bit_step_) has
// a 16-entry map, two codes per byte (element 2k in the high nibble; an odd tensor end stores a
// zero low nibble), the codes of a chunk at begin / 2, no sign rule (a map without +0 is usable).
//
// A policy P supplies
//   using Config;   a struct with `State8bitCommon q` (one_state8bit_cuda.h) and its hyperparameters
//   using Scalars;  the per-tensor scalars of the shared per-element header (sizeof % 4 == 0)
//   __device__ static Scalars scalars(const Config&, double lr, float grad_mult, double t);
//   __device__ static void element(float& w, float g, float& state, const Scalars&);
// The per-element math stays in csrc/include/mpfused/*.h, shared with the CPU kernels.
//
// tests/cuda_emulation/one_state8bit_vs_cpu.cpp runs the kernels unchanged on the host and
// compares them byte for byte with the CPU kernels.
#pragma once
#include <stddef.h>

#include "mpfused/adam_math.h"  // MasterMode, load_weight / store_weight, step_seed
#include "mpfused/quant8_math.h"
#include "multi_tensor_apply.cuh"
#include "one_state8bit_cuda.h"
#include "quant8_block_cuda.cuh"
#include "quant8_prepare.cuh"

namespace mpfused::cuda {
namespace q8 {

// A tensor's record in the workspace: the scalars, then the seed, every byte a member.
template <class S, int PAD = int((8 - sizeof(S) % 8) % 8 / 4)>
struct PreparedOf {
  S s;
  float pad[PAD];
  uint64_t seed;  // step_seed(seed, t)
  __device__ __forceinline__ void zero_pad() { pad[0] = 0.f; }
};
template <class S>
struct PreparedOf<S, 0> {
  S s;
  uint64_t seed;
  __device__ __forceinline__ void zero_pad() {}
};

template <class P, int BITS>
struct OneStatePrepare {
  static constexpr int kMaps = 1;
  static constexpr int kCodes = 1 << BITS;  // map entries: 256 (8-bit codes) or 16 (4-bit)
  using Config = typename P::Config;
  using Tensor = PreparedOf<typename P::Scalars>;
  static_assert(sizeof(typename P::Scalars) % 4 == 0 &&
                    sizeof(Tensor) == (sizeof(typename P::Scalars) + 15) / 8 * 8,
                "workspace layout: every byte a member");

  __device__ __forceinline__ static bool skipped(const Config& cfg) {
    return cfg.q.common.found_inf != nullptr && *cfg.q.common.found_inf > 0.f;
  }
  __device__ __forceinline__ static const float* map(const Config& cfg, int) { return cfg.q.map; }
  __device__ __forceinline__ static Tensor tensor(const Config& cfg, const float* step) {
    const StepCommon& k = cfg.q.common;
    const float grad_mult = prepared_grad_mult(k.grad_scale, k.norm_sq, k.max_grad_norm);
    const double t = double(*step) + 1.0;
    const double lr = k.lr_ptr != nullptr ? double(*k.lr_ptr) : k.lr;
    Tensor out;
    out.s = P::scalars(cfg, lr, grad_mult, t);
    out.zero_pad();
    out.seed = step_seed(k.seed, t);
    return out;
  }
};

// Both code widths: the same layout.
template <class P>
using OneStateWorkspace = PreparedWorkspace<1, PreparedOf<typename P::Scalars>>;

template <class Scalars>
struct alignas(16) OneStateShared {  // 16: the parked states are accessed as 16-byte vectors
  float st[kChunk];  // updated fp32 states of the chunk until they are requantized
  float map[kQuantCodes];   // 4-bit: the first 16 entries (only codes < 16 are decoded)
  float eyt[kQuantCodes];  // decision thresholds in Eytzinger order (quant8_encode_eytzinger)
  QMax<1> red;
  Scalars scalars;
  uint64_t seed;
  int32_t zero_code;  // 8-bit: the +0 code (the sign rule)
  int32_t valid;      // the map passed the prepare launch's checks
};

// One chunk (whole quantization blocks) of one tensor, run by all kBlockSize threads of a block.
// T / MODE: the effective storage type and master mode (cpu::pick_state8_kernel's choice); BITS:
// the code width.
template <class P, typename T, int MODE, int BITS>
__device__ __forceinline__ void one_state_chunk(OneStateShared<typename P::Scalars>& sh,
                                                const MtaChunk<kOneState8bitDepth>& c,
                                                const typename P::Config& cfg,
                                                const OneStateWorkspace<P>& ws) {
  static_assert(offsetof(OneStateShared<typename P::Scalars>, eyt) % 128 == 0,
                "Eytzinger thresholds start at bank 0");
  static_assert(kBlockSize == 2 * kQuantCodes, "setup: one thread per map entry and threshold");
  const int tid = int(threadIdx.x);
  // Chunk-local indices fit in int (n <= kChunk); the block size is a power of two.
  const int n = int(c.n);
  const int B = int(cfg.q.block_size);
  int lb = 0;
  while ((1 << lb) < B) ++lb;
  const int nq = (n + B - 1) >> lb;  // quantization blocks in this chunk
  float* absmax = static_cast<float*>(c.ptr[kS8Absmax]) + (c.begin >> lb);

  // ---- setup: copy what the prepare launch computed for this step ----------------------------
  constexpr int kCodes = 1 << BITS;  // map entries (only codes < kCodes are ever decoded)
  {
    const int i = tid % kQuantCodes;
    if (tid < kQuantCodes) {
      if (i < kCodes) sh.map[i] = cfg.q.map[i];
    } else {
      sh.eyt[i] = ws.maps->eyt[0][i];
    }
  }
  if (tid == 0) {
    const PreparedOf<typename P::Scalars>& pt = ws.tensors[c.tensor];
    sh.scalars = pt.s;
    sh.seed = pt.seed;
    sh.zero_code = ws.maps->zero_code;
    sh.valid = ws.maps->valid;
  }
  __syncthreads();
  const int32_t zc = sh.zero_code;
  if (sh.valid == 0) {  // the map is unusable: poison this chunk's absmax, write nothing else
    if (tid < nq) absmax[tid] = NAN;
    return;
  }
  const typename P::Scalars s = sh.scalars;
  const uint64_t seed = sh.seed;
  const uint64_t stream = reinterpret_cast<uint64_t>(c.ptr[kS8Stream]);

  // ---- update ---------------------------------------------------------------------------------
  T* p = static_cast<T*>(c.ptr[kS8Param]) + c.begin;
  const T* g = static_cast<const T*>(c.ptr[kS8Grad]) + c.begin;
  // codes of the chunk: c.begin is a multiple of kChunk, so 4-bit ones start on a byte
  uint8_t* code = static_cast<uint8_t*>(c.ptr[kS8State]) + c.begin * BITS / 8;
  constexpr unsigned kCodeBytes = kVec * BITS / 8;  // of one vector
  using M = master_t<MODE>;
  constexpr bool kHasM = MasterStore<MODE>::kStored;
  M* mst = master_operand<MODE>(c.ptr[kS8Master], c.begin);
  const bool vec = aligned(p, kVec * sizeof(T)) && aligned(g, kVec * sizeof(T)) &&
                   aligned(code, kCodeBytes) && (!kHasM || aligned(mst, kVec * sizeof(M)));

  // Pass k: thread t owns elements e = 2048 k + 4t .. +3 (one quantization block).
  const int seg = qmax_lanes(B);
#pragma unroll 1
  for (int k = 0; k < kPasses; ++k) {
    const int e = k * int(kPassElems) + tid * kVec;
    const int cnt = n - e;
    VecN<float, kVec> sv;
    uint32_t x[1] = {0u};  // bits of max |state| over the vector
    if (cnt > 0) {
      T pv[kVec], gv[kVec];
      M mv[kVec] = {};
      load_n(p, e, cnt, vec, pv);
      load_n(g, e, cnt, vec, gv);
      const Codes<BITS> kv = load_codes<BITS>(code, e, cnt, vec);
      if constexpr (kHasM) load_n(mst, e, cnt, vec, mv);
      const float a = absmax[e >> lb];  // the OLD absmax (overwritten after the barriers)
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        sv.v[j] = 0.f;
        if (j >= cnt) continue;
        // cpu::state8bit_chunk's loop body.
        float w = load_weight<T, MODE>(pv[j], mv[j]);
        float st = quant8_decode(sh.map, kv[j], a);
        P::element(w, to_f32(gv[j]), st, s);
        store_weight<T, MODE>(w, pv[j], mv[j], seed, stream, c.begin + (e + j));
        sv.v[j] = st;
        x[0] = umax(x[0], f32_bits(fabsf(st)));
      }
      store_n(p, e, cnt, vec, pv);
      if constexpr (kHasM) store_n(mst, e, cnt, vec, mv);
      *reinterpret_cast<VecN<float, kVec>*>(sh.st + e) = sv;
    }
    qmax_stage_a(sh.red, x, B, lb, seg, k, e);
  }
  qmax_finish(sh.red, B);

  // ---- new absmax, requantize -------------------------------------------------------------------
  if (tid < nq) absmax[tid] = bits_f32(sh.red.am[0][tid]);  // every old-absmax read is done
#pragma unroll 1
  for (int k = 0; k < kPasses; ++k) {
    const int e = k * int(kPassElems) + tid * kVec;
    const int cnt = n - e;
    if (cnt <= 0) break;
    const float r = quant8_inv_scale(bits_f32(sh.red.am[0][e >> lb]));
    const VecN<float, kVec> sv = *reinterpret_cast<const VecN<float, kVec>*>(sh.st + e);
    uint8_t kv[kVec];
    encode_n<BITS == 8, BITS>(sh.eyt, sv, r, zc, kv);  // the sign rule: 8-bit only
    store_codes<BITS>(code, e, cnt, vec, kv);
  }
}

// MODE is the requested master mode; the effective one per dtype is cpu::pick_state8_kernel's.
// BITS: the code width.
template <class P, int MODE, int BITS>
struct OneState8bitFunctor {
  // Two blocks per SM (<= 64 registers), as adam8bit_cuda.cu: one block's setup and
  // barrier-bound reduction overlap the other's memory traffic. Not yet measured on a GPU.
  static constexpr int kMinBlocksPerSm = 2;
  typename P::Config cfg;
  void* workspace;  // written by the prepare launch earlier on the stream

  __device__ __forceinline__ void operator()(const MtaChunk<kOneState8bitDepth>& c) const {
    // Skipped step: every block leaves before touching anything (uniform branch).
    const float* found_inf = cfg.q.common.found_inf;
    if (found_inf != nullptr && *found_inf > 0.f) return;
    __shared__ OneStateShared<typename P::Scalars> sh;
    const OneStateWorkspace<P> ws(workspace);
    switch (c.dtype) {  // effective_master_mode: fp32 params are their own master
      case kFloat32:
        one_state_chunk<P, float, effective_master_mode<float>(MODE), BITS>(sh, c, cfg, ws);
        break;
      case kFloat16:
        one_state_chunk<P, f16_t, effective_master_mode<f16_t>(MODE), BITS>(sh, c, cfg, ws);
        break;
      default:
        one_state_chunk<P, bf16_t, effective_master_mode<bf16_t>(MODE), BITS>(sh, c, cfg, ws);
        break;
    }
  }
};

template <class P, int MODE, int BITS>
cudaError_t one_state8bit_launch(const TensorLists<kOneState8bitDepth>& t,
                                 const typename P::Config& cfg, void* workspace,
                                 cudaStream_t stream) {
  const cudaError_t err = prepare<OneStatePrepare<P, BITS>>(t, kS8Step, cfg, workspace, stream);
  if (err != cudaSuccess) return err;
  return multi_tensor_apply<kOneState8bitDepth>(
      t, kChunk, stream, OneState8bitFunctor<P, MODE, BITS>{cfg, workspace});
}

// One step of policy P over `t` (operands: one_state8bit_cuda.h's order), cfg.q.code_bits wide.
template <class P>
cudaError_t one_state8bit_step(const TensorLists<kOneState8bitDepth>& t,
                               const typename P::Config& cfg, void* workspace,
                               cudaStream_t stream) {
  const int64_t b = cfg.q.block_size;
  if (b < kMinBlock || b > kMaxBlock || (b & (b - 1)) != 0) return cudaErrorInvalidValue;
  if (cfg.q.code_bits != 8 && cfg.q.code_bits != 4) return cudaErrorInvalidValue;
  if (workspace == nullptr || (reinterpret_cast<uintptr_t>(workspace) & 15) != 0)
    return cudaErrorInvalidValue;
  if (t.size == 0) return cudaSuccess;
  // bf16 has every mode: the kernel narrows it per dtype (effective_master_mode)
  return dispatch_master_mode(kBFloat16, cfg.q.common.master_mode, [&](auto, auto m) {
    constexpr int kMode = decltype(m)::value;
    return cfg.q.code_bits == 4 ? one_state8bit_launch<P, kMode, 4>(t, cfg, workspace, stream)
                                : one_state8bit_launch<P, kMode, 8>(t, cfg, workspace, stream);
  });
}

template <class P>
size_t one_state8bit_workspace_bytes(int64_t ntensors) {
  return OneStateWorkspace<P>::bytes(ntensors);
}

}  // namespace q8
}  // namespace mpfused::cuda

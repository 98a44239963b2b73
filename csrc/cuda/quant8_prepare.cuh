// The step-invariant setup of the block-wise 8-bit kernels (adam8bit_cuda.cu,
// one_state8bit_cuda.cuh), done once per call instead of once per 4,096-element chunk: a small
// "prepare" launch writes a device workspace that every block of the main kernel then copies
// (coalesced, all threads) instead of computing.
//
//   maps      block 0 of the first launch, one thread per map entry: the 255 decision thresholds
//             (quant8_threshold) of each map in Eytzinger order, the map checks and the +0 code
//             of map 0, the signed one, and whether the maps are usable (valid; 0: the main
//             kernel poisons absmax). A 16-entry (4-bit) map's 15 thresholds are padded with +inf
//             to 255 (quant8_thresholds' rule), so the 8-bit searches return its nearest code;
//             it needs no +0 (no sign rule).
//   tensors   one thread per tensor: the policy's per-tensor record (the algorithm's scalars and
//             the stochastic-rounding seed) from its device step counter, lr, grad_scale, norm_sq.
//
// The step counters travel by value in the launch parameters, as increment_steps' do (448 per
// 4 KB launch, 3,584 per 32 KB launch): no pointer table in device memory, capturable. The
// workspace comes from the caller (the binding allocates it through torch's caching allocator on
// the params' device); the prepare and main launches are ordered on one stream, so nothing
// synchronizes with the host. found_inf > 0: the prepare writes nothing, like the main kernel.
//
// A prepare policy P supplies
//   static constexpr int kMaps;  the maps (1 or 2; map 0 is the signed one)
//   static constexpr int kCodes; entries per map: 256 (8-bit codes) or 16 (4-bit codes)
//   using Config;                the kernel's config (by value in the launch)
//   using Tensor;                the per-tensor record, every byte a member (initcheck)
//   __device__ static bool skipped(const Config&);      found_inf > 0
//   __device__ static Tensor tensor(const Config&, const float* step);
//   __device__ static const float* map(const Config&, int i);
#pragma once
#include <stddef.h>

#include "mpfused/quant8_math.h"
#include "multi_tensor_apply.cuh"

namespace mpfused::cuda {
namespace q8 {

// Every byte is written by the prepare (padding included), so a vector load of a whole struct
// reads nothing uninitialized (compute-sanitizer initcheck).
template <int NM>
struct alignas(16) PreparedMaps {
  float eyt[NM][kQuantCodes];  // thresholds in Eytzinger order (eyt[.][0] = +inf, never searched)
  // 256-entry maps: the +0 code of map 0 (> 0), or -1: a map is unsorted / lacks it.
  // 16-entry maps: 0, unused (no sign rule).
  int32_t zero_code;
  int32_t valid;  // 1: the maps are usable (sorted; 256 entries: with +0 in map 0), else 0
  int32_t pad[2];
};

// The workspace: the maps, then one Tensor record per packed tensor (index MtaChunk::tensor).
template <int NM, class Tensor>
struct PreparedWorkspace {
  static_assert(sizeof(PreparedMaps<NM>) % 16 == 0, "workspace layout");
  PreparedMaps<NM>* maps;
  Tensor* tensors;
  __host__ __device__ explicit PreparedWorkspace(void* p)
      : maps(static_cast<PreparedMaps<NM>*>(p)),
        tensors(reinterpret_cast<Tensor*>(static_cast<char*>(p) + sizeof(PreparedMaps<NM>))) {}
  static size_t bytes(int64_t ntensors) {
    return sizeof(PreparedMaps<NM>) + size_t(ntensors) * sizeof(Tensor);
  }
};

// The CPU bindings' grad_mult (common.h::cpu_grad_mult): float reciprocal, clip coefficient in
// double, then float.
__device__ __forceinline__ float prepared_grad_mult(const float* grad_scale, const float* norm_sq,
                                                    double max_grad_norm) {
  float grad_mult = grad_scale != nullptr ? 1.f / *grad_scale : 1.f;
  if (norm_sq != nullptr && max_grad_norm > 0) {
    const double norm = sqrt(double(*norm_sq));
    const double coef = max_grad_norm / (norm + 1e-6);
    grad_mult *= float(coef < 1.0 ? coef : 1.0);  // std::min(1.0, coef): NaN gives 1
  }
  return grad_mult;
}

// All kBlockSize threads of one block: thread t owns threshold slot t % 256 of map t / 256 (and
// reads entry t % 256 when the map has it); threads past the maps only vote.
template <class P>
__device__ __forceinline__ void prepare_maps(const typename P::Config& cfg,
                                             PreparedMaps<P::kMaps>& out) {
  constexpr int NM = P::kMaps, NC = P::kCodes;
  static_assert(NM * kQuantCodes <= kBlockSize, "one thread per threshold slot");
  static_assert(NC == kQuantCodes || NC == kQuant4Codes, "8-bit or 4-bit maps");
  constexpr bool kSignRule = NC == kQuantCodes;  // 4-bit: nearest code, no +0 needed
  const int tid = int(threadIdx.x);
  const int i = tid % kQuantCodes, mi = tid / kQuantCodes;
  bool ok = true, plus_zero = false;
  if (mi < NM) {
    const float* map = P::map(cfg, mi == 0 ? 0 : NM - 1);
    float* eyt = out.eyt[mi == 0 ? 0 : NM - 1];
    if (i < NC) {  // a 16-entry map is read at its 16 entries only
      const float a = map[i];
      if (i + 1 < NC) {
        const float b = map[i + 1];
        eyt[quant8_eytzinger_node(i)] = quant8_threshold(a, b);
        ok = a < b;  // false for NaN too
      }
      // +0 of map 0 above index 0 (the sign rule needs a code below it).
      plus_zero = kSignRule && mi == 0 && i > 0 && a == 0.f && (f32_bits(a) >> 31) == 0u;
    }
    if (i + 1 >= NC)  // the padding (quant8_thresholds): slot 255 is eyt[0], never searched
      eyt[i + 1 < kQuantCodes ? quant8_eytzinger_node(i) : 0] = INFINITY;
  }
  const bool sorted = __syncthreads_and(int(ok)) != 0;
  const bool has_zero = !kSignRule || __syncthreads_or(int(plus_zero)) != 0;  // uniform
  const bool valid = sorted && has_zero;
  if (!kSignRule) {
    if (tid == 0) out.zero_code = 0;
  } else if (valid) {
    if (plus_zero) out.zero_code = i;  // one writer: a sorted map holds one +0
  } else if (tid == 0) {
    out.zero_code = -1;
  }
  if (tid == 0) out.valid = int32_t(valid);
  if (tid < 2) out.pad[tid] = 0;
}

// Launch parameters: up to N step counters (448 fit 4 KB with the config, 3,584 fit 32 KB).
constexpr int kPrepareTensors = 448;
template <int N>
struct PrepareTable {
  const float* step[N];
};

template <class P, int N>
__global__ void __launch_bounds__(kBlockSize)
    prepare_kernel(MPF_PARAM_TABLE(PrepareTable<N>) table, int64_t first, int32_t n, bool maps,
                   const typename P::Config cfg, void* workspace) {
  if (P::skipped(cfg)) return;  // skipped step: write nothing
  const PreparedWorkspace<P::kMaps, typename P::Tensor> ws(workspace);
  const int j = int(blockIdx.x) * kBlockSize + int(threadIdx.x);
  if (j < n) ws.tensors[first + j] = P::tensor(cfg, table.step[j]);
  if (maps && blockIdx.x == 0) prepare_maps<P>(cfg, *ws.maps);  // uniform per block
}

// step_op: the operand of `t` holding each tensor's float* step counter.
template <class P, int N, int D>
cudaError_t prepare_with(const TensorLists<D>& t, int step_op, const typename P::Config& cfg,
                         void* workspace, cudaStream_t stream) {
  constexpr int kLimit = N > kPrepareTensors ? kMaxParamBytesLarge : kMaxParamBytes;
  static_assert(sizeof(PrepareTable<N>) +
                        param_bytes<int64_t, int32_t, bool, typename P::Config, void*>() <= kLimit,
                "prepare_kernel: step table + arguments exceed the kernel parameter limit");
  // At most N tensors a launch, fewer when max_blocks_per_launch() is (the emulation's tests
  // lower it to split launches; on a GPU it is 2^30).
  const int64_t per = N < max_blocks_per_launch() ? N : max_blocks_per_launch();
  for (int64_t first = 0; first == 0 || first < t.size; first += per) {  // >= 1: the maps
    const int32_t n = int32_t(t.size - first < per ? t.size - first : per);
    PrepareTable<N> table{};
    for (int32_t i = 0; i < n; ++i)
      table.step[i] = static_cast<const float*>(t.data[step_op][first + i]);
    const unsigned blocks = unsigned(n > 0 ? (n + kBlockSize - 1) / kBlockSize : 1);
    MPF_LAUNCH(dim3(blocks), dim3(kBlockSize), stream, prepare_kernel<P, N>)(table, first, n,
                                                                             first == 0, cfg,
                                                                             workspace);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The prepare launches of one call, in the parameter space multi_tensor_apply uses; the 4 KB
// table whenever it holds every tensor (a 28 KB parameter block is copied at every launch).
template <class P, int D>
cudaError_t prepare(const TensorLists<D>& t, int step_op, const typename P::Config& cfg,
                    void* workspace, cudaStream_t stream) {
  if (t.size <= kPrepareTensors)
    return prepare_with<P, kPrepareTensors>(t, step_op, cfg, workspace, stream);
#if MPF_MTA_LARGE_PARAMS == 2
  if (large_kernel_params())
    return prepare_with<P, 8 * kPrepareTensors>(t, step_op, cfg, workspace, stream);
  return prepare_with<P, kPrepareTensors>(t, step_op, cfg, workspace, stream);
#elif MPF_MTA_LARGE_PARAMS == 1
  return prepare_with<P, 8 * kPrepareTensors>(t, step_op, cfg, workspace, stream);
#else
  return prepare_with<P, kPrepareTensors>(t, step_op, cfg, workspace, stream);
#endif
}

}  // namespace q8
}  // namespace mpfused::cuda

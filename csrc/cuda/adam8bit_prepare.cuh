// The step-invariant setup of the 8-bit Adam kernel (adam8bit_cuda.cu), done once per call instead
// of once per 4,096-element chunk: a small "prepare" launch writes a device workspace that every
// block of the main kernel then copies (coalesced, all threads) instead of computing.
//
//   maps      block 0 of the first launch, one thread per map entry of both maps: the 2 x 255
//             decision thresholds (quant8_threshold) in Eytzinger order, the map checks and the
//             +0 code of map 1 (-1 when a map is unusable: the main kernel then poisons absmax).
//   tensors   one thread per tensor: its AdamScalars and stochastic-rounding seed from its device
//             step counter, lr, grad_scale and norm_sq (the fp64 pow of the bias corrections).
//
// The step counters travel by value in the launch parameters, as increment_steps' do (448 per
// 4 KB launch, 3,584 per 32 KB launch): no pointer table in device memory, capturable. The
// workspace comes from the caller (the binding allocates it through torch's caching allocator on
// the params' device); the prepare and main launches are ordered on one stream, so nothing
// synchronizes with the host. found_inf > 0: the prepare writes nothing, like the main kernel.
#pragma once
#include <stddef.h>

#include "adam8bit_cuda.h"
#include "mpfused/quant8_math.h"
#include "multi_tensor_apply.cuh"

namespace mpfused::cuda {
namespace q8 {

// Every byte is written by the prepare (padding included), so a vector load of a whole struct
// reads nothing uninitialized (compute-sanitizer initcheck).
struct alignas(16) PreparedMaps {
  float eyt1[kQuantCodes];  // thresholds in Eytzinger order (eyt[0] = +inf, never searched)
  float eyt2[kQuantCodes];
  int32_t zero_code;        // the +0 code of map 1 (> 0), or -1: a map is unsorted / lacks it
  int32_t pad[3];
};
struct alignas(16) PreparedTensor {
  AdamScalars s;
  float pad;
  uint64_t seed;  // step_seed(cfg.seed, t)
};
static_assert(sizeof(PreparedMaps) % 16 == 0 && sizeof(PreparedTensor) == 48, "workspace layout");

// The workspace: the maps, then one PreparedTensor per packed tensor (index MtaChunk::tensor).
struct Workspace {
  PreparedMaps* maps;
  PreparedTensor* tensors;
  __host__ __device__ explicit Workspace(void* p)
      : maps(static_cast<PreparedMaps*>(p)),
        tensors(reinterpret_cast<PreparedTensor*>(static_cast<char*>(p) + sizeof(PreparedMaps))) {}
};

inline size_t workspace_bytes(int64_t ntensors) {
  return sizeof(PreparedMaps) + size_t(ntensors) * sizeof(PreparedTensor);
}

// One tensor's scalars, exactly as the CPU binding forms them (grad_mult: float reciprocal, clip
// coefficient in double then float) and AdamFunctor in adam_cuda.cu.
__device__ __forceinline__ PreparedTensor tensor_scalars(const Adam8bitConfig& cfg,
                                                         const float* step) {
  float grad_mult = cfg.grad_scale != nullptr ? 1.f / *cfg.grad_scale : 1.f;
  if (cfg.norm_sq != nullptr && cfg.max_grad_norm > 0) {
    const double norm = sqrt(double(*cfg.norm_sq));
    const double coef = cfg.max_grad_norm / (norm + 1e-6);
    grad_mult *= float(coef < 1.0 ? coef : 1.0);  // std::min(1.0, coef): NaN gives 1
  }
  const double t = double(*step) + 1.0;
  const double lr = cfg.lr_ptr != nullptr ? double(*cfg.lr_ptr) : cfg.lr;
  PreparedTensor out;
  out.s = adam_scalars(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.decoupled,
                       cfg.maximize, grad_mult, t);
  out.pad = 0.f;
  out.seed = step_seed(cfg.seed, t);
  return out;
}

// All kBlockSize threads of one block: thread t owns entry t % 256 of map 1 (t < 256) or map 2.
__device__ __forceinline__ void prepare_maps(const Adam8bitConfig& cfg, PreparedMaps& out) {
  static_assert(kBlockSize == 2 * kQuantCodes, "one thread per map entry of both maps");
  const int tid = int(threadIdx.x);
  const int i = tid % kQuantCodes;
  const float* map = tid < kQuantCodes ? cfg.map1 : cfg.map2;
  float* eyt = tid < kQuantCodes ? out.eyt1 : out.eyt2;
  const float a = map[i];
  bool ok = true;
  if (i + 1 < kQuantCodes) {
    const float b = map[i + 1];
    eyt[quant8_eytzinger_node(i)] = quant8_threshold(a, b);
    ok = a < b;  // false for NaN too
  } else {
    eyt[0] = INFINITY;
  }
  // +0 of map 1 above index 0 (the sign rule needs a code below it).
  const bool plus_zero = tid < kQuantCodes && i > 0 && a == 0.f && (f32_bits(a) >> 31) == 0u;
  const bool sorted = __syncthreads_and(int(ok)) != 0;
  const bool has_zero = __syncthreads_or(int(plus_zero)) != 0;
  if (sorted && has_zero) {
    if (plus_zero) out.zero_code = i;  // one writer: a sorted map holds one +0
  } else if (tid == 0) {
    out.zero_code = -1;
  }
  if (tid < 3) out.pad[tid] = 0;
}

// Launch parameters: up to N step counters (448 fit 4 KB with the config, 3,584 fit 32 KB).
constexpr int kPrepareTensors = 448;
template <int N>
struct PrepareTable {
  const float* step[N];
};

template <int N>
__global__ void __launch_bounds__(kBlockSize)
    prepare_kernel(MPF_PARAM_TABLE(PrepareTable<N>) table, int64_t first, int32_t n, bool maps,
                   const Adam8bitConfig cfg, void* workspace) {
  if (cfg.found_inf != nullptr && *cfg.found_inf > 0.f) return;  // skipped step: write nothing
  const Workspace ws(workspace);
  const int j = int(blockIdx.x) * kBlockSize + int(threadIdx.x);
  if (j < n) ws.tensors[first + j] = tensor_scalars(cfg, table.step[j]);
  if (maps && blockIdx.x == 0) prepare_maps(cfg, *ws.maps);  // uniform per block
}

template <int N>
cudaError_t prepare_with(const TensorLists<kAdam8bitDepth>& t, const Adam8bitConfig& cfg,
                         void* workspace, cudaStream_t stream) {
  constexpr int kLimit = N > kPrepareTensors ? kMaxParamBytesLarge : kMaxParamBytes;
  static_assert(sizeof(PrepareTable<N>) +
                        param_bytes<int64_t, int32_t, bool, Adam8bitConfig, void*>() <= kLimit,
                "prepare_kernel: step table + arguments exceed the kernel parameter limit");
  // At most N tensors a launch, fewer when max_blocks_per_launch() is (the emulation's tests
  // lower it to split launches; on a GPU it is 2^30).
  const int64_t per = N < max_blocks_per_launch() ? N : max_blocks_per_launch();
  for (int64_t first = 0; first == 0 || first < t.size; first += per) {  // >= 1: the maps
    const int32_t n = int32_t(t.size - first < per ? t.size - first : per);
    PrepareTable<N> table{};
    for (int32_t i = 0; i < n; ++i)
      table.step[i] = static_cast<const float*>(t.data[kQ8Step][first + i]);
    const unsigned blocks = unsigned(n > 0 ? (n + kBlockSize - 1) / kBlockSize : 1);
    MPF_LAUNCH(dim3(blocks), dim3(kBlockSize), stream, prepare_kernel<N>)(table, first, n,
                                                                          first == 0, cfg,
                                                                          workspace);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The prepare launches of one call, in the parameter space multi_tensor_apply uses; the 4 KB
// table whenever it holds every tensor (a 28 KB parameter block is copied at every launch).
inline cudaError_t prepare(const TensorLists<kAdam8bitDepth>& t, const Adam8bitConfig& cfg,
                           void* workspace, cudaStream_t stream) {
  if (t.size <= kPrepareTensors) return prepare_with<kPrepareTensors>(t, cfg, workspace, stream);
#if MPF_MTA_LARGE_PARAMS == 2
  if (large_kernel_params())
    return prepare_with<8 * kPrepareTensors>(t, cfg, workspace, stream);
  return prepare_with<kPrepareTensors>(t, cfg, workspace, stream);
#elif MPF_MTA_LARGE_PARAMS == 1
  return prepare_with<8 * kPrepareTensors>(t, cfg, workspace, stream);
#else
  return prepare_with<kPrepareTensors>(t, cfg, workspace, stream);
#endif
}

}  // namespace q8
}  // namespace mpfused::cuda

// Generic multi-tensor apply for the CUDA kernels (torch-free: cuda_runtime.h + our headers).
//
// Every tensor of a TensorLists<DEPTH> is cut into chunks of `chunk_size` elements; one block runs
// one chunk. The chunks of consecutive tensors are packed into as few launches as the kernel
// argument limit allows: the per-launch metadata (operand pointers, numels, dtype codes, first
// block of each tensor) travels by value as a kernel parameter, so a launch needs no host->device
// copy and is captured as-is by CUDA graphs.
//
// Unlike torch/apex there is no per-block table (block_to_tensor / block_to_chunk): a block finds
// its tensor by a binary search over the launch's `first_block` array (<= 8 uniform constant-bank
// loads). The metadata is therefore per tensor only, and a launch is limited by tensors, not by
// blocks: big tensors never force extra launches.
//
// Indices exposed to the functor (MtaChunk):
//   tensor: position of the tensor in the whole call (the packed list), across launches. Equal to
//           the CPU kernels' tensor index (per-tensor outputs, stochastic-rounding stream).
//   chunk:  call-wide chunk index, chunks numbered tensor by tensor and in order inside a tensor,
//           i.e. the same order as cpu::make_chunks. Reductions write one partial per chunk there
//           and combine them in that fixed order: deterministic.
// All sizes and offsets are int64 (tensors beyond 2^31 elements).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch.cuh"
#include "mpfused/tensor_list.h"

// __grid_constant__ (CUDA >= 11.7, sm_70+) lets the kernel index the metadata in the parameter
// bank directly instead of copying 4 KB into local memory.
#if defined(__CUDACC__) && \
    (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))
#define MPF_GRID_CONSTANT __grid_constant__
#else
#define MPF_GRID_CONSTANT
#endif
// A kernel's by-value metadata parameter. The host emulation passes it by reference instead: a
// 32 KB copy per emulated thread would not fit its fiber stacks (read-only either way).
#ifdef MPF_CUDA_HOST_EMULATION
#define MPF_PARAM_TABLE(...) const __VA_ARGS__&
#else
#define MPF_PARAM_TABLE(...) const MPF_GRID_CONSTANT __VA_ARGS__
#endif

// Kernel parameter space: 4 KB everywhere; 32,764 B with CUDA >= 12.1 on a driver >= R530 and
// Volta or newer, i.e. ~8x more tensors per launch (10,000 tensors: ~270 launches a step at 4 KB).
//   MPF_MTA_LARGE_PARAMS 0: 4 KB only (toolkit < 12.1, or -DMPF_CUDA_SMALL_KERNEL_PARAMS);
//   1: 32 KB only (CUDA >= 13: its runtime needs a driver >= R580 and a GPU >= sm_75);
//   2: both, picked per call from the driver version and the device (CUDA 12.1 - 12.x, whose
//      runtime may run on an older driver, or -DMPF_CUDA_KERNEL_PARAMS_BY_DRIVER), and in the
//      host emulation (tests pick).
#if defined(MPF_CUDA_HOST_EMULATION) || defined(MPF_CUDA_KERNEL_PARAMS_BY_DRIVER)
#define MPF_MTA_LARGE_PARAMS 2
#elif defined(MPF_CUDA_SMALL_KERNEL_PARAMS) || !defined(CUDART_VERSION) || CUDART_VERSION < 12010
#define MPF_MTA_LARGE_PARAMS 0
#elif CUDART_VERSION >= 13000
#define MPF_MTA_LARGE_PARAMS 1
#else
#define MPF_MTA_LARGE_PARAMS 2
#endif

namespace mpfused::cuda {

constexpr int kBlockSize = 512;
constexpr int64_t kChunkSize = 65536;  // torch/apex's chunk: 32 iterations of 4 elements/thread
// Kernel parameters: 4 KB on every toolkit/driver, 32,764 B with CUDA 12.1 + R530 + Volta.
constexpr int kMaxParamBytes = 4096;
constexpr int kMaxParamBytesLarge = 32764;
// Left to the functor and the extra kernel arguments (checked by a static_assert per launch).
constexpr int kParamReserve = 320;
// first_block is int32 and gridDim.x <= 2^31 - 1; in practice a launch never gets near this.
constexpr int64_t kMaxBlocksPerLaunch = int64_t(1) << 30;

#ifdef MPF_CUDA_HOST_EMULATION
// Tests lower the limit to make launches end in the middle of a tensor.
inline int64_t max_blocks_per_launch() { return ::mpf_emulation::max_blocks_per_launch; }
#else
constexpr int64_t max_blocks_per_launch() { return kMaxBlocksPerLaunch; }
#endif

// Whether this call's launches may use the 32 KB parameter space (see MPF_MTA_LARGE_PARAMS).
inline bool large_kernel_params() {
#if defined(MPF_CUDA_HOST_EMULATION)
  return ::mpf_emulation::large_kernel_params;
#elif MPF_MTA_LARGE_PARAMS == 2
  static const int driver = [] {
    int v = 0;
    return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
  }();
  int dev = 0, major = 0;
  return driver >= 12010 && cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         major >= 7;
#else
  return MPF_MTA_LARGE_PARAMS == 1;
#endif
}

template <int DEPTH, int PARAM_BYTES = kMaxParamBytes>
struct MtaMeta {
  static constexpr int kHeaderBytes = 4 * 8 + 4;
  static constexpr int kPerTensorBytes = 8 * DEPTH + 8 + 4 + 1;
  static constexpr int kMaxTensors =
      (PARAM_BYTES - kParamReserve - kHeaderBytes - 8) / kPerTensorBytes;

  void* ptr[DEPTH][kMaxTensors];      // operand k of slot s: element 0 of the tensor
  int64_t numel[kMaxTensors];
  int64_t tensor_base;                // call-wide index of slot 0
  int64_t chunk_base;                 // call-wide chunk index of block 0
  int64_t first_chunk0;               // chunk (within its tensor) run by block 0: > 0 when slot 0
                                      // continues a tensor begun in the previous launch
  int64_t chunk_size;
  int32_t first_block[kMaxTensors];   // first block of slot s; non-decreasing, first_block[0] = 0
  int32_t ntensors;
  int8_t dtype[kMaxTensors];          // DType of operand 0
};

// The chunk a block runs, as the functor sees it.
template <int DEPTH>
struct MtaChunk {
  void* ptr[DEPTH];          // operand base pointers (element 0 of the tensor, not of the chunk)
  int64_t numel;             // elements of the tensor
  int64_t begin;             // first element of this chunk
  int64_t n;                 // elements in this chunk (1..chunk_size)
  int64_t tensor;            // index of the tensor in the whole call
  int64_t chunk;             // call-wide chunk index
  int64_t chunk_in_tensor;   // begin / chunk_size
  int64_t chunk_size;
  int32_t dtype;
};

// The chunk run by block b of a launch. Host-callable so the packing can be tested without a GPU.
template <int DEPTH, int P>
__host__ __device__ __forceinline__ MtaChunk<DEPTH> mta_locate(const MtaMeta<DEPTH, P>& meta,
                                                               int32_t b) {
  // Last slot whose first block is <= b (a 0-chunk slot shares its first_block with the next
  // slot, so it is never picked).
  int lo = 0, hi = meta.ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (meta.first_block[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  MtaChunk<DEPTH> c;
  for (int d = 0; d < DEPTH; ++d) c.ptr[d] = meta.ptr[d][lo];
  c.numel = meta.numel[lo];
  c.chunk_size = meta.chunk_size;
  c.chunk_in_tensor = (lo == 0 ? meta.first_chunk0 : 0) + int64_t(b - meta.first_block[lo]);
  c.begin = c.chunk_in_tensor * meta.chunk_size;
  const int64_t left = c.numel - c.begin;
  c.n = left < meta.chunk_size ? left : meta.chunk_size;
  c.tensor = meta.tensor_base + lo;
  c.chunk = meta.chunk_base + b;
  c.dtype = meta.dtype[lo];
  return c;
}

// Blocks of kBlockSize threads a functor asks to keep resident per SM (static member
// kMinBlocksPerSm; default 1): ptxas then caps registers at 65536 / (kBlockSize * that).
template <typename F, typename = void>
struct MinBlocksPerSm {
  static constexpr int value = 1;
};
template <typename F>
struct MinBlocksPerSm<F, decltype(void(F::kMinBlocksPerSm))> {
  static constexpr int value = F::kMinBlocksPerSm;
};

template <int DEPTH, int P, typename Functor, typename... Args>
__global__ void __launch_bounds__(kBlockSize, MinBlocksPerSm<Functor>::value)
    mta_kernel(MPF_PARAM_TABLE(MtaMeta<DEPTH, P>) meta, const Functor functor, Args... args) {
  functor(mta_locate<DEPTH>(meta, int32_t(blockIdx.x)), args...);
}

// Host side: packs `lists` into launches and calls emit(meta, nblocks) for each, in order.
// Separate from the launch so the packing can be tested without a GPU.
template <int DEPTH, int P = kMaxParamBytes, typename Emit>
void mta_pack(const TensorLists<DEPTH>& lists, int64_t chunk_size, int64_t max_blocks,
              Emit&& emit) {
  using Meta = MtaMeta<DEPTH, P>;
  Meta meta{};
  meta.chunk_size = chunk_size;
  int32_t nt = 0;   // slots used in this launch
  int64_t nb = 0;   // blocks used in this launch
  auto flush = [&]() {
    meta.ntensors = nt;
    if (nb > 0) emit(static_cast<const Meta&>(meta), nb);
    meta.chunk_base += nb;
  };
  for (int64_t t = 0; t < lists.size; ++t) {
    const int64_t chunks = (lists.numel[t] + chunk_size - 1) / chunk_size;
    for (int d = 0; d < DEPTH; ++d) meta.ptr[d][nt] = lists.data[d][t];
    meta.numel[nt] = lists.numel[t];
    meta.dtype[nt] = int8_t(lists.dtype[t]);
    meta.first_block[nt] = int32_t(nb);
    ++nt;
    for (int64_t c = 0; c < chunks;) {
      const int64_t take = chunks - c < max_blocks - nb ? chunks - c : max_blocks - nb;
      nb += take;
      c += take;
      if (nb == max_blocks && c < chunks) {
        // Launch full in the middle of tensor t: t continues in slot 0 of the next launch.
        flush();
        for (int d = 0; d < DEPTH; ++d) meta.ptr[d][0] = meta.ptr[d][nt - 1];
        meta.numel[0] = meta.numel[nt - 1];
        meta.dtype[0] = meta.dtype[nt - 1];
        meta.first_block[0] = 0;
        meta.tensor_base = t;
        meta.first_chunk0 = c;
        nt = 1;
        nb = 0;
      }
    }
    if (nt == Meta::kMaxTensors || nb == max_blocks) {
      flush();
      meta.tensor_base = t + 1;
      meta.first_chunk0 = 0;
      nt = 0;
      nb = 0;
    }
  }
  if (nt > 0) flush();
}

template <typename... Ts>
constexpr int param_bytes() {
  return (0 + ... + int(sizeof(Ts) + alignof(Ts)));  // size + worst-case padding of each
}

template <int P, int DEPTH, typename Functor, typename... Args>
cudaError_t mta_launch_all(const TensorLists<DEPTH>& lists, int64_t chunk_size,
                           cudaStream_t stream, const Functor& functor, const Args&... args) {
  static_assert(sizeof(MtaMeta<DEPTH, P>) + param_bytes<Functor, Args...>() <= P,
                "multi_tensor_apply: metadata + functor + arguments exceed the kernel parameter "
                "limit");
  static_assert(MtaMeta<DEPTH, P>::kMaxTensors >= 16, "multi_tensor_apply: DEPTH too large");
  cudaError_t err = cudaSuccess;
  mta_pack<DEPTH, P>(lists, chunk_size, max_blocks_per_launch(),
                     [&](const MtaMeta<DEPTH, P>& meta, int64_t nblocks) {
                       if (err != cudaSuccess) return;
                       MPF_LAUNCH(dim3(unsigned(nblocks)), dim3(kBlockSize), stream,
                                  mta_kernel<DEPTH, P, Functor, Args...>)(meta, functor, args...);
                       err = cudaGetLastError();
                     });
  return err;
}

// Runs functor(const MtaChunk<DEPTH>&, args...) (a __device__ operator()) once per chunk of every
// tensor, kBlockSize threads per chunk, on `stream`. Returns the first launch error, if any.
// Tensors are taken as given: empty ones are harmless but waste a slot (the bindings drop them).
template <int DEPTH, typename Functor, typename... Args>
cudaError_t multi_tensor_apply(const TensorLists<DEPTH>& lists, int64_t chunk_size,
                               cudaStream_t stream, const Functor& functor, const Args&... args) {
  if (lists.size == 0) return cudaSuccess;
#if MPF_MTA_LARGE_PARAMS == 2
  if (large_kernel_params())
    return mta_launch_all<kMaxParamBytesLarge>(lists, chunk_size, stream, functor, args...);
  return mta_launch_all<kMaxParamBytes>(lists, chunk_size, stream, functor, args...);
#elif MPF_MTA_LARGE_PARAMS == 1
  return mta_launch_all<kMaxParamBytesLarge>(lists, chunk_size, stream, functor, args...);
#else
  return mta_launch_all<kMaxParamBytes>(lists, chunk_size, stream, functor, args...);
#endif
}

}  // namespace mpfused::cuda

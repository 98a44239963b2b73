// The CUDA emulation itself (cuda_runtime.h here) against CUDA's documented semantics, and proof
// that it reports the mistakes it is meant to catch: a divergent barrier, threads meeting at
// different barriers or shuffles, a read of shared memory nothing wrote, a bad launch
// configuration, and (built with -fsanitize=thread, run as `emulator_selftest race-barrier` or
// `race-shuffle`) a missing barrier as a data race, including one a shuffle does not prevent.
//
// usage: emulator_selftest [race-barrier | race-shuffle]
#include <cuda_runtime.h>

#include "harness.h"
#include "launch.cuh"

namespace {

__device__ int max_int(int a, int b) { return a > b ? a : b; }

__global__ void shuffles(int* out) {
  const int t = int(threadIdx.x), lane = t % 32;
  int down = t;
  for (int o = 16; o > 0; o >>= 1) down += __shfl_down_sync(0xffffffffu, down, o);
  int x = t;
  for (int o = 16; o > 0; o >>= 1) x = max_int(x, __shfl_xor_sync(0xffffffffu, x, o));
  const double d = __shfl_sync(0xffffffffu, double(t) * 0.5, 3);
  out[4 * t + 0] = lane == 0 ? down : -1;  // lane 0 holds its warp's sum
  out[4 * t + 1] = x;                      // every lane: its warp's max
  out[4 * t + 2] = int(d * 2);             // lane 3's value
  out[4 * t + 3] = __shfl_down_sync(0xffffffffu, t, 31);  // past the warp: own value
}

__global__ void votes(int* out, int n_true) {
  const int t = int(threadIdx.x);
  out[3 * t + 0] = __syncthreads_or(t < n_true);
  out[3 * t + 1] = __syncthreads_and(t < n_true);
  out[3 * t + 2] = __syncthreads_count(t < n_true);
}

// Thread 0 writes, everyone reads after the barrier; `barrier` false drops it (a race).
__global__ void broadcast(int* out, bool barrier) {
  __shared__ int value;
  if (threadIdx.x == 0) value = int(blockIdx.x) + 1;
  if (barrier) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

// Reads a slot of shared memory that this block never writes (block 0 writes it).
__global__ void stale_shared(unsigned* out) {
  __shared__ unsigned slot[2];
  if (threadIdx.x == 0) slot[blockIdx.x == 0 ? 1 : 0] = 7;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = slot[1];
}

// Lane 0 writes shared memory, lane 1 reads it after a shuffle (sync false) or a __syncwarp (true).
// A shuffle orders no memory on a GPU: without __syncwarp this is a race.
__global__ void across_a_shuffle(int* out, bool sync) {
  __shared__ int slot;
  if (threadIdx.x == 0) slot = 42;
  int v = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
  if (sync) __syncwarp();
  if (threadIdx.x == 1) out[0] = slot + v;  // v: lane 0's index, 0
}

[[maybe_unused]] __global__ void mismatched_barriers(int* out) {
  if (threadIdx.x % 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

[[maybe_unused]] __global__ void mismatched_shuffles(int* out) {
  int v = int(threadIdx.x);
  if (threadIdx.x % 2) v = __shfl_xor_sync(0xffffffffu, v, 1);
  else v = __shfl_down_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// Lane 5 leaves before its warp's shuffle (undefined with the full mask).
[[maybe_unused]] __global__ void shuffle_after_exit(int* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

[[maybe_unused]] __global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}

[[maybe_unused]] __global__ void barrier_after_exit(int* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    // Only one racy kernel: under TSan this must end in a data-race report.
    std::vector<int> out(4 * 256, 0);
    if (std::strcmp(argv[1], "race-barrier") == 0) {
      MPF_LAUNCH(4, 256, nullptr, broadcast)(out.data(), false);
    } else if (std::strcmp(argv[1], "race-shuffle") == 0) {
      MPF_LAUNCH(1, 64, nullptr, across_a_shuffle)(out.data(), false);
    } else {
      std::printf("unknown argument %s\n", argv[1]);
      return 2;
    }
    std::printf("racy kernel ran\n");
    return 0;
  }
  size_t cases = 0;
  {
    std::vector<int> out(4 * 96, 0);
    MPF_LAUNCH(2, 96, nullptr, shuffles)(out.data());
    EXPECT(cudaGetLastError() == cudaSuccess, "shuffles launch");
    for (int t = 0; t < 96; ++t) {
      const int w = t / 32, lane = t % 32, lo = 32 * w;
      if (lane == 0) EXPECT(out[4 * t] == 32 * lo + 496, "warp %d sum %d", w, out[4 * t]);
      EXPECT(out[4 * t + 1] == lo + 31, "thread %d max %d", t, out[4 * t + 1]);
      EXPECT(out[4 * t + 2] == lo + 3, "thread %d shfl %d", t, out[4 * t + 2]);
      EXPECT(out[4 * t + 3] == (lane == 0 ? t + 31 : t), "thread %d shfl past the warp %d", t, out[4 * t + 3]);
    }
    ++cases;
  }
  for (int n_true : {0, 1, 77, 128}) {
    std::vector<int> out(3 * 128, -1);
    MPF_LAUNCH(1, 128, nullptr, votes)(out.data(), n_true);
    EXPECT(cudaGetLastError() == cudaSuccess, "votes launch");
    for (int t = 0; t < 128; ++t)
      EXPECT(out[3 * t] == (n_true > 0) && out[3 * t + 1] == (n_true == 128) && out[3 * t + 2] == n_true,
             "votes with %d true: thread %d got %d %d %d", n_true, t, out[3 * t], out[3 * t + 1], out[3 * t + 2]);
    ++cases;
  }
  {
    std::vector<int> out(4 * 256, 0);
    MPF_LAUNCH(4, 256, nullptr, broadcast)(out.data(), true);
    EXPECT(cudaGetLastError() == cudaSuccess, "broadcast launch");
    bool all = true;
    for (int i = 0; i < 4 * 256; ++i) all = all && out[i] == i / 256 + 1;
    EXPECT(all, "broadcast with its barrier");
#ifndef MPF_EMU_TSAN  // there the race itself is the report (`race` above)
    // Without the barrier most threads run before thread 0 in a shuffled round: they read the
    // poisoned value, never this block's.
    MPF_LAUNCH(4, 256, nullptr, broadcast)(out.data(), false);
    EXPECT(cudaGetLastError() == cudaSuccess, "racy broadcast launch");
    int wrong = 0;
    for (int i = 0; i < 4 * 256; ++i) wrong += out[i] != i / 256 + 1;
    EXPECT(wrong > 256, "a missing barrier went unseen: %d of 1024 reads wrong", wrong);
#endif
    cases += 2;
  }
  {
    int out[1] = {0};
    MPF_LAUNCH(1, 64, nullptr, across_a_shuffle)(out, true);  // racecheck: no report
    EXPECT(cudaGetLastError() == cudaSuccess && out[0] == 42, "write, __syncwarp, read: %d", out[0]);
    ++cases;
  }
  {
    unsigned out[3] = {0, 0, 0};
    MPF_LAUNCH(3, 32, nullptr, stale_shared)(out);
    EXPECT(cudaGetLastError() == cudaSuccess, "stale_shared launch");
    EXPECT(out[0] == 7u, "block 0 reads its own write: %u", out[0]);
    EXPECT(out[1] == 0xFFFFFFFFu && out[2] == 0xFFFFFFFFu,
           "blocks 1, 2 must see fresh (0xFF) shared memory, not block 0's: %x %x", out[1], out[2]);
    ++cases;
  }
#ifndef MPF_EMU_TSAN  // a failed block's threads never finish, which TSan cannot follow
  {
    std::vector<int> out(64, 0);
    MPF_LAUNCH(1, 64, nullptr, divergent_barrier)(out.data());
    EXPECT(cudaGetLastError() == cudaErrorLaunchFailure, "a divergent barrier went unreported");
    MPF_LAUNCH(1, 64, nullptr, barrier_after_exit)(out.data());
    EXPECT(cudaGetLastError() == cudaErrorLaunchFailure, "a barrier after an exit went unreported");
    MPF_LAUNCH(1, 64, nullptr, mismatched_barriers)(out.data());
    EXPECT(cudaGetLastError() == cudaErrorLaunchFailure, "different __syncthreads calls met");
    MPF_LAUNCH(1, 64, nullptr, mismatched_shuffles)(out.data());
    EXPECT(cudaGetLastError() == cudaErrorLaunchFailure, "different shuffle calls met");
    MPF_LAUNCH(1, 64, nullptr, shuffle_after_exit)(out.data());
    EXPECT(cudaGetLastError() == cudaErrorLaunchFailure, "a shuffle with an exited lane completed");
    EXPECT(cudaGetLastError() == cudaSuccess, "cudaGetLastError must clear the error");
    cases += 5;
  }
#endif
  {
    int out[1];
    MPF_LAUNCH(1, 2048, nullptr, divergent_barrier)(out);
    EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration, "2048 threads per block accepted");
    MPF_LAUNCH(0, 32, nullptr, divergent_barrier)(out);
    EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration, "an empty grid accepted");
    ++cases;
  }
  return emu_test::report(cases);
}

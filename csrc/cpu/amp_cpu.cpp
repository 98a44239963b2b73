#include "amp_cpu.h"

#include <omp.h>

#include "parallel.h"

namespace mpfused::cpu {
namespace {

constexpr int kLanes = 16;  // independent accumulators: lets the compiler vectorize the reduction

template <typename T, bool WRITE, bool NORM>
MPF_CPU_MULTIVERSION void check_chunk(T* __restrict x, int64_t n, float inv_scale, uint32_t& bad, double& sumsq) {
  // Per-lane flags and sums, reduced once per chunk: a reduction per vector of 16 costs more
  // than the check itself.
  uint32_t flags[kLanes] = {};
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float u = unscale_element(to_f32(x[i + l]), inv_scale, flags[l]);
      if (WRITE) x[i + l] = from_f32<T>(u);
      if (NORM) acc[l] += u * u;
    }
  }
  for (; i < n; ++i) {
    const float u = unscale_element(to_f32(x[i]), inv_scale, flags[0]);
    if (WRITE) x[i] = from_f32<T>(u);
    if (NORM) acc[0] += u * u;
  }
  uint32_t b = 0;
  for (int l = 0; l < kLanes; ++l) b |= flags[l];
  bad |= b;
  if (NORM) {
    double s = 0;
    for (int l = 0; l < kLanes; ++l) s += acc[l];
    sumsq = s;
  }
}

template <bool WRITE, bool NORM>
void check_chunk_any(void* p, int32_t dtype, int64_t n, float inv, uint32_t& bad, double& ss) {
  switch (dtype) {
    case kFloat32: return check_chunk<float, WRITE, NORM>(static_cast<float*>(p), n, inv, bad, ss);
    case kFloat16: return check_chunk<f16_t, WRITE, NORM>(static_cast<f16_t*>(p), n, inv, bad, ss);
    default: return check_chunk<bf16_t, WRITE, NORM>(static_cast<bf16_t*>(p), n, inv, bad, ss);
  }
}

}  // namespace

void amp_check(const TensorLists<1>& grads, float inv_scale, bool write_back, float* found_inf,
               float* norm_sq, float* norm_sq_per_tensor, int num_threads) {
  const std::vector<Chunk> chunks = make_chunks(grads.numel, grads.size);
  const int64_t nc = int64_t(chunks.size());
  const bool norm = norm_sq || norm_sq_per_tensor;
  std::vector<double> partial(norm ? nc : 0);
  uint32_t bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) num_threads(num_threads) \
    if (nc >= kMinParallelLightChunks)
  for (int64_t c = 0; c < nc; ++c) {
    const Chunk& k = chunks[c];
    const int32_t dt = grads.dtype[k.tensor];
    const size_t esize = dt == kFloat32 ? 4 : 2;
    void* p = static_cast<char*>(grads.data[0][k.tensor]) + k.begin * esize;
    double ss = 0;
    const int64_t n = k.end - k.begin;
    if (write_back) {
      norm ? check_chunk_any<true, true>(p, dt, n, inv_scale, bad, ss)
           : check_chunk_any<true, false>(p, dt, n, inv_scale, bad, ss);
    } else {
      norm ? check_chunk_any<false, true>(p, dt, n, inv_scale, bad, ss)
           : check_chunk_any<false, false>(p, dt, n, inv_scale, bad, ss);
    }
    if (norm) partial[c] = ss;
  }
  if (bad) *found_inf = 1.f;
  if (!norm) return;
  // Combine in chunk order (chunks of one tensor are consecutive): deterministic.
  double total = 0, per = 0;
  for (int64_t c = 0; c < nc; ++c) {
    per += partial[c];
    total += partial[c];
    if (c + 1 == nc || chunks[c + 1].tensor != chunks[c].tensor) {
      if (norm_sq_per_tensor) norm_sq_per_tensor[chunks[c].tensor] += float(per);
      per = 0;
    }
  }
  if (norm_sq) *norm_sq += float(total);
}

}  // namespace mpfused::cpu

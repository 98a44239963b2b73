#include "adam_cpu.h"

#include <omp.h>

#include "parallel.h"
#include "step_scalars.h"

namespace mpfused::cpu {
namespace {

template <typename T, int MODE, bool AMSGRAD>
MPF_CPU_MULTIVERSION void adam_chunk(void* const* ops, int64_t begin, int64_t n, const AdamScalars& s, uint64_t seed,
                uint64_t stream) {
  T* __restrict p = static_cast<T*>(ops[kParam]) + begin;
  const T* __restrict g = static_cast<const T*>(ops[kGrad]) + begin;
  float* __restrict m = static_cast<float*>(ops[kExpAvg]) + begin;
  float* __restrict v = static_cast<float*>(ops[kExpAvgSq]) + begin;
  float* __restrict vmax = AMSGRAD ? static_cast<float*>(ops[kMaxExpAvgSq]) + begin : nullptr;
  float* __restrict master = MODE == kFp32Master ? static_cast<float*>(ops[kMaster]) + begin : nullptr;
  int16_t* __restrict rem = MODE == kRemainder ? static_cast<int16_t*>(ops[kMaster]) + begin : nullptr;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float w = load_weight<T, MODE>(p, master, rem, i);
    float vm = AMSGRAD ? vmax[i] : 0.f;
    adam_element<AMSGRAD>(w, to_f32(g[i]), m[i], v[i], vm, s);
    if (AMSGRAD) vmax[i] = vm;
    store_weight<T, MODE>(w, p, master, rem, i, seed, stream, begin + i);
  }
}

using ChunkFn = void (*)(void* const*, int64_t, int64_t, const AdamScalars&, uint64_t, uint64_t);

template <typename T, int MODE>
ChunkFn pick_ams(bool ams) {
  return ams ? &adam_chunk<T, MODE, true> : &adam_chunk<T, MODE, false>;
}

template <typename T>
ChunkFn pick(int mode, bool ams) {
  switch (mode) {
    case kFp32Master: return pick_ams<T, kFp32Master>(ams);
    case kRemainder: return pick_ams<T, kRemainder>(ams);
    case kStochastic: return pick_ams<T, kStochastic>(ams);
    default: return pick_ams<T, kNoMaster>(ams);
  }
}

ChunkFn pick_kernel(int32_t dtype, int mode, bool ams) {
  switch (dtype) {
    case kFloat32: return pick<float>(kNoMaster, ams);  // fp32 params are their own master
    case kFloat16: return mode == kFp32Master ? pick<f16_t>(kFp32Master, ams) : pick<f16_t>(kNoMaster, ams);
    default: return pick<bf16_t>(mode, ams);
  }
}

}  // namespace

void adam_step(const TensorLists<6>& t, const double* step, const AdamConfig& c, int num_threads) {
  const std::vector<Chunk> chunks = make_chunks(t.numel, t.size);
  const StepScalars ss = step_scalars(c, step, t.size);
  const std::vector<AdamScalars>& scalars = ss.scalars;
  const std::vector<uint64_t>& seeds = ss.seeds;
  std::vector<ChunkFn> kernels(size_t(t.size));
  for (int64_t i = 0; i < t.size; ++i) kernels[i] = pick_kernel(t.dtype[i], c.master_mode, c.amsgrad);
  const int64_t nc = int64_t(chunks.size());
#pragma omp parallel for schedule(static) num_threads(num_threads) if (nc > 1)
  for (int64_t k = 0; k < nc; ++k) {
    const Chunk& ch = chunks[k];
    void* ops[6];
    for (int d = 0; d < 6; ++d) ops[d] = t.data[d][ch.tensor];
    kernels[ch.tensor](ops, ch.begin, ch.end - ch.begin, scalars[ch.tensor], seeds[ch.tensor],
                       c.streams[ch.tensor]);
  }
}

}  // namespace mpfused::cpu

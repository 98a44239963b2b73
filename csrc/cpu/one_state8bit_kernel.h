// The CPU kernel of every step with one block-wise 8-bit or 4-bit state, generic over the
// algorithm's per-element update U: u.visit(f) calls f with a functor uc, uc(w, g, s) updating
// the fp32 param w and the fp32 state s (sgd_element / lion_element with the tensor's scalars).
// Codes and absmax follow exactly the rules of adam8bit_cpu.cpp's first moment: the same encoder
// (LUT; 8-bit with the sign rule, 4-bit without), the same decode, the new absmax as the bits of
// max |s| (a NaN state gives a NaN absmax). BITS = 4: two codes per byte (quant8_math.h's "4-bit
// codes", load_codes / store_codes of quant8_cpu.h), a 16-entry map, codes at begin / 2.
// Included by one .cpp per algorithm; everything here is per translation unit.
#pragma once
#include <omp.h>

#include <vector>

#include "mpfused/adam_math.h"
#include "mpfused/quant8_math.h"
#include "one_state8bit_cpu.h"
#include "parallel.h"
#include "quant8_cpu.h"

namespace mpfused::cpu {
namespace {

struct StateMap {
  const float* map;
  const Encoder* enc;  // the map's encoder with the sign rule at zero_code (8-bit)
  int32_t zero_code;   // -1: no sign rule (4-bit)
};

// One chunk (whole quantization blocks) of one tensor. Per block: pass 1 dequantizes with the
// old absmax, runs the fp32 update (the param gets this step's unquantized state) and takes the
// new absmax; pass 2 requantizes the block with it. Not pipelined as Adam's: pass 2's table
// gathers take about two thirds of the step (perf), and pass 1, without Adam's divisions, has no
// latency for them to hide in.
// VBMI: decode without gathers (8-bit: VBMI byte permutes; 4-bit: AVX-512 vpermps; the 4-bit
// encode too: encode_tile4_avx512).
template <class U, typename T, int MODE, bool LUT, int BITS, bool VBMI = false>
MPF_HD void state8bit_chunk(void* const* ops, int64_t begin, int64_t n, int64_t block,
                            const U& upd, const StateMap& sm, uint64_t seed, uint64_t stream) {
  T* __restrict p = static_cast<T*>(ops[kSParam]) + begin;
  const T* __restrict g = static_cast<const T*>(ops[kSGrad]) + begin;
  // element offsets below are relative to `begin`, which is block-aligned (so even)
  uint8_t* __restrict c = static_cast<uint8_t*>(ops[kSState]) + begin * BITS / 8;
  master_t<MODE>* __restrict mst = master_operand<MODE>(ops[kSMaster], begin);
  float* __restrict absmax = static_cast<float*>(ops[kSAbsmax]);
  const float* __restrict map = sm.map;
  const uint32_t* __restrict lut = sm.enc->lut.center();
  const float* __restrict thr = sm.enc->thr;
  const int32_t zc = sm.zero_code;
  const U u = upd;  // a local copy: the stores below cannot alias it
  alignas(64) float sb[kMaxBlock];  // the block's updated state
  // Codes are widened to / narrowed from int32 in tiles so that the table lookups are 32-bit
  // gathers (compilers emulate gathers with 8-bit indices element by element).
  alignas(64) int32_t codes[kTile];
  alignas(64) float dec[kTile];  // VBMI: the decoded map entries
  // remainder8: the int8 corrections widened to int16 per tile (see remainder8_join_wide)
  constexpr bool kWide8 = MODE == kRemainder8;
  alignas(64) int16_t rin[kWide8 ? kTile : 1], rout[kWide8 ? kTile : 1];
  // 16-bit params: the new absmax in a loop of its own over the tile's updated state. In the
  // update loop, the reduction's per-lane array (omp simd) has 16 lanes, which caps that loop at
  // 16 elements a step: 256-bit vectors for the 16-bit operands, 2 x 256 for the floats (AVX-512:
  // 512 / 2 x 512 without it).
  constexpr bool kSplitMax = sizeof(T) == 2;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = n - b0 < block ? n - b0 : block;
    const int64_t blk = (begin + b0) / block;
    const float a = absmax[blk];
    uint32_t am = 0u;  // max |s| as bits: ordered as the floats, NaN above inf
    for (int64_t t0 = 0; t0 < len; t0 += kTile) {
      const int64_t tl = len - t0 < kTile ? len - t0 : kTile;
      const int64_t o = b0 + t0;
      if constexpr (VBMI) {
#if MPF_8BIT_ISAS
        if constexpr (BITS == 8) decode_tile_vbmi(sm.enc->planes, map, c + o, dec, tl);
        else decode_tile4_avx512(map, c + o / 2, dec, tl);  // o is even: tiles start on a byte
#endif
      } else {
        load_codes<BITS>(c, o, codes, tl);
      }
      if constexpr (kWide8) widen_corrections(mst + o, rin, tl);
      float* __restrict sc = sb + t0;
      // u.visit hands the loop the update with its per-tensor cases decided (SGD: first step,
      // weight decay): one loop per case, none with arithmetic under a condition, which
      // compilers do not vectorize (-ftrapping-math) and GCC only partly splits by itself.
      u.visit([&](const auto& uc) __attribute__((always_inline)) {
        // element j's update; returns its new state
        auto step = [&](int64_t j) __attribute__((always_inline)) {
          const int64_t i = o + j;
          float w;
          if constexpr (kWide8) w = remainder8_join_wide(p[i].bits, rin[j]);
          else w = load_weight<T, MODE>(p, mst, i);
          float s = VBMI ? dec[j] * a : quant8_decode(map, codes[j], a);
          uc(w, to_f32(g[i]), s);
          if constexpr (kWide8) remainder8_split_wide(w, p[i].bits, rout[j]);
          else store_weight<T, MODE>(w, p, mst, i, seed, stream, begin + i);
          return s;
        };
        if constexpr (kSplitMax) {
#pragma omp simd
          for (int64_t j = 0; j < tl; ++j) sc[j] = step(j);
          am = absmax_bits(sc, tl, am);
        } else {
          uint32_t tm = am;
#pragma omp simd reduction(max : tm)
          for (int64_t j = 0; j < tl; ++j) {
            const float s = step(j);
            sc[j] = s;
            const uint32_t bits = f32_bits(fabsf(s));
            tm = tm > bits ? tm : bits;
          }
          am = tm;
        }
      });
      if constexpr (kWide8) narrow_corrections(rout, mst + o, tl);
    }
    absmax[blk] = bits_f32(am);
    const float r = quant8_inv_scale(bits_f32(am));
    if constexpr (VBMI && BITS == 4) {  // the whole block at once, no gathers (b0 is even)
#if MPF_8BIT_ISAS
      encode_tile4_avx512(thr, sb, r, c + b0 / 2, len);
#endif
      continue;
    }
    for (int64_t t0 = 0; t0 < len; t0 += kTile) {
      const int64_t tl = len - t0 < kTile ? len - t0 : kTile;
      const float* __restrict sc = sb + t0;
#pragma omp simd
      for (int64_t j = 0; j < tl; ++j) {
        const float x = sc[j] * r;
        if constexpr (LUT) codes[j] = int32_t(quant8_encode_lut(lut, x));  // 8-bit: sign rule in it
        else codes[j] = quant8_keep_negative(quant8_encode(thr, x), sc[j], zc);
      }
      store_codes<BITS>(c, b0 + t0, codes, tl);
    }
  }
}

template <class U>
using StateChunkFn = void (*)(void* const*, int64_t, int64_t, int64_t, const U&, const StateMap&,
                              uint64_t, uint64_t);

#define MPF_STATE8_ARGS                                                                          \
  void* const* ops, int64_t begin, int64_t n, int64_t block, const U& u, const StateMap& sm,    \
      uint64_t seed, uint64_t stream
#define MPF_STATE8_CALL(...) state8bit_chunk<__VA_ARGS__>(ops, begin, n, block, u, sm, seed, stream)

template <class U, typename T, int MODE, bool LUT, int BITS>
void state8_base(MPF_STATE8_ARGS) { MPF_STATE8_CALL(U, T, MODE, LUT, BITS); }
#if MPF_8BIT_ISAS
template <class U, typename T, int MODE, int BITS>
MPF_8BIT_V3 void state8_v3(MPF_STATE8_ARGS) { MPF_STATE8_CALL(U, T, MODE, true, BITS); }
template <class U, typename T, int MODE, int BITS>  // 4-bit: the vpermps decode (AVX-512)
MPF_8BIT_V4 void state8_v4(MPF_STATE8_ARGS) { MPF_STATE8_CALL(U, T, MODE, true, BITS, BITS == 4); }
template <class U, typename T, int MODE>
MPF_8BIT_VBMI void state8_vbmi(MPF_STATE8_ARGS) { MPF_STATE8_CALL(U, T, MODE, true, 8, true); }
#endif
#undef MPF_STATE8_ARGS
#undef MPF_STATE8_CALL

// The table-driven encode on the fastest ISA (isa_level); maps the tables cannot encode exactly
// (never the bitsandbytes or torchao maps) take the binary search, baseline build only. 4-bit
// codes take the v4 build on a VBMI CPU, which decodes them with vpermps (VBMI's is for bytes).
template <class U, typename T, int MODE, int BITS>
StateChunkFn<U> pick_state8_isa(bool lut) {
  if (!lut) return &state8_base<U, T, MODE, false, BITS>;
#if MPF_8BIT_ISAS
  const int level = isa_level();
  if constexpr (BITS == 8)
    if (level == 5) return &state8_vbmi<U, T, MODE>;
  if (level >= 4) return &state8_v4<U, T, MODE, BITS>;
  if (level == 3) return &state8_v3<U, T, MODE, BITS>;
#endif
  return &state8_base<U, T, MODE, true, BITS>;
}

template <class U>
StateChunkFn<U> pick_state8_kernel(int32_t dtype, int mode, bool lut, int code_bits) {
  return dispatch_master_mode(dtype, mode, [lut, code_bits](auto tag, auto m) {
    return code_bits == 4 ? pick_state8_isa<U, decltype(tag), decltype(m)::value, 4>(lut)
                          : pick_state8_isa<U, decltype(tag), decltype(m)::value, 8>(lut);
  });
}

// The step over every tensor: upd[i] is tensor i's update (its scalars), block-aligned slices
// of all tensors in one OpenMP loop.
template <class U>
void state8bit_step(const TensorLists<5>& t, const double* step, const State8bitConfig& c,
                    const std::vector<U>& upd, int num_threads) {
  const StateMap sm{c.map, &encoder_for(c.map, c.zero_code, 1 << c.code_bits), c.zero_code};
  const bool lut = sm.enc->lut.exact;
  std::vector<StateChunkFn<U>> kernels(size_t(t.size));
  std::vector<uint64_t> seeds(size_t(t.size));
  for (int64_t i = 0; i < t.size; ++i) {
    kernels[i] = pick_state8_kernel<U>(t.dtype[i], c.master_mode, lut, c.code_bits);
    seeds[i] = step_seed(c.seed, step[i]);
  }
  // cut at whole blocks (chunks hold whole blocks: kMaxBlock)
  const Slices slices = make_slices(t.numel, t.size, num_threads, c.block_size);
  for_each_slice(slices, num_threads, [&](const Chunk& ch) {
    void* ops[5];
    for (int d = 0; d < 5; ++d) ops[d] = t.data[d][ch.tensor];
    kernels[ch.tensor](ops, ch.begin, ch.end - ch.begin, c.block_size, upd[ch.tensor], sm,
                       seeds[ch.tensor], c.streams[ch.tensor]);
  });
}

}  // namespace
}  // namespace mpfused::cpu

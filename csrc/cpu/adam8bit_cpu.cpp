#include "adam8bit_cpu.h"

#include <omp.h>

#include <type_traits>
#include <vector>

#include "mpfused/quant8_math.h"
#include "parallel.h"
#include "quant8_cpu.h"
#include "step_scalars.h"

namespace mpfused::cpu {
namespace {

struct Maps {
  const float* map1;
  const float* map2;
  const Encoder* enc1;
  const Encoder* enc2;
  int32_t zero_code1;
};

// Requantization of one element (pass 2): the nearest code of x = s * (1 / absmax).
template <bool LUT>
MPF_HD void encode_pair(float m, float v, float r1, float r2, const uint32_t* __restrict lut1,
                        const uint32_t* __restrict lut2, const float* __restrict thr1,
                        const float* __restrict thr2, int32_t zc, int32_t& q1, int32_t& q2) {
  const float x1 = m * r1;
  const float x2 = v * r2;
  if constexpr (LUT) {
    // The sign rule is in the first moment's table. Codes in the low byte: stored as uint8.
    q1 = int32_t(quant8_encode_lut(lut1, x1));
    q2 = int32_t(quant8_encode_lut(lut2, x2));
  } else {
    q1 = quant8_keep_negative(quant8_encode(thr1, x1), m, zc);
    q2 = quant8_encode(thr2, x2);
  }
}

// Pass 2 alone over elements [from, to) of one block (moments in mb/vb, codes at c1/c2).
template <bool LUT, int BITS>
MPF_HD void requantize(const float* __restrict mb, const float* __restrict vb, uint8_t* __restrict c1,
                       uint8_t* __restrict c2, int64_t from, int64_t to, float r1, float r2,
                       const uint32_t* __restrict lut1, const uint32_t* __restrict lut2,
                       const float* __restrict thr1, const float* __restrict thr2, int32_t zc) {
  alignas(64) int32_t out1[kTile], out2[kTile];
  for (int64_t t0 = from; t0 < to; t0 += kTile) {
    const int64_t tl = to - t0 < kTile ? to - t0 : kTile;
#pragma omp simd
    for (int64_t j = 0; j < tl; ++j)
      encode_pair<LUT>(mb[t0 + j], vb[t0 + j], r1, r2, lut1, lut2, thr1, thr2, zc, out1[j], out2[j]);
    store_codes<BITS>(c1, t0, out1, tl);
    store_codes<BITS>(c2, t0, out2, tl);
  }
}

// One chunk (whole quantization blocks) of one tensor. Per block: pass 1 dequantizes with the old
// absmax, runs the fp32 Adam update (the param gets this step's unquantized moments) and takes
// the new absmax of the updated moments; pass 2 requantizes them with the new absmax.
// Software-pipelined by one block: pass 2 of block b-1 runs in the same loop as pass 1 of block b.
// Pass 1 waits on the divider (two divisions and a square root per element), pass 2 on table
// gathers; interleaved, each hides the other (about 1.3x faster than the two passes in turn).
// BITS = 8: one code per byte; 4: two (quant8_math.h's "4-bit codes"; codes at begin / 2).
// VBMI: decode without gathers (8-bit: VBMI byte permutes; 4-bit: AVX-512 vpermps).
template <typename T, int MODE, bool LUT, int BITS, bool VBMI = false>
MPF_HD void adam8bit_chunk(void* const* ops, int64_t begin, int64_t n, int64_t block,
                           const AdamScalars& s, const Maps& mp, uint64_t seed, uint64_t stream) {
  T* __restrict p = static_cast<T*>(ops[kQParam]) + begin;
  const T* __restrict g = static_cast<const T*>(ops[kQGrad]) + begin;
  // element offsets below are relative to `begin`, which is block-aligned (so even)
  uint8_t* __restrict c1 = static_cast<uint8_t*>(ops[kQExpAvg]) + begin * BITS / 8;
  uint8_t* __restrict c2 = static_cast<uint8_t*>(ops[kQExpAvgSq]) + begin * BITS / 8;
  master_t<MODE>* __restrict mst = master_operand<MODE>(ops[kQMaster], begin);
  float* __restrict absmax1 = static_cast<float*>(ops[kQAbsmax1]);
  float* __restrict absmax2 = static_cast<float*>(ops[kQAbsmax2]);
  const float* __restrict map1 = mp.map1;
  const float* __restrict map2 = mp.map2;
  const int32_t zc = mp.zero_code1;
  const float* __restrict thr1 = mp.enc1->thr;
  const float* __restrict thr2 = mp.enc2->thr;
  const uint32_t* __restrict lut1 = mp.enc1->lut.center();
  const uint32_t* __restrict lut2 = mp.enc2->lut.center();
  const AdamScalars sc = s;  // a local copy: the stores below cannot alias it
  // Codes are widened to / narrowed from int32 in tiles so that the table lookups are 32-bit
  // gathers (compilers emulate gathers with 8-bit indices element by element).
  alignas(64) float mb[2][kMaxBlock];  // updated moments of the current and the previous block
  alignas(64) float vb[2][kMaxBlock];
  alignas(64) int32_t in1[kTile], in2[kTile], out1[kTile], out2[kTile];
  alignas(64) float d1[kTile], d2[kTile];  // VBMI: the decoded map entries
  // remainder8: the int8 corrections widened to int16 per tile (see remainder8_join_wide)
  constexpr bool kWide8 = MODE == kRemainder8;
  alignas(64) int16_t rin[kWide8 ? kTile : 1], rout[kWide8 ? kTile : 1];
  // 16-bit params: the new absmax in loops of their own over the tile's moments (as
  // one_state8bit_kernel.h: the reduction's per-lane array would cap the update at 16 lanes).
  constexpr bool kSplitMax = sizeof(T) == 2;

  int64_t prev_b0 = -1, prev_len = 0;
  float prev_r1 = 0.f, prev_r2 = 0.f;
  int cur = 0;
  for (int64_t b0 = 0; b0 < n; b0 += block, cur ^= 1) {
    const int64_t len = n - b0 < block ? n - b0 : block;
    const int64_t blk = (begin + b0) / block;
    const float a1 = absmax1[blk], a2 = absmax2[blk];
    const bool pipe = prev_b0 >= 0;
    const int prv = cur ^ 1;
    // new absmax as the bits of max |x| (the CUDA kernel's rule): ordered as the floats for
    // non-negative values, and a NaN moment (above inf) gives a NaN absmax in any order
    uint32_t am1 = 0u, am2 = 0u;
    for (int64_t t0 = 0; t0 < len; t0 += kTile) {
      const int64_t tl = len - t0 < kTile ? len - t0 : kTile;
      const int64_t o = b0 + t0;
      if constexpr (VBMI) {
#if MPF_8BIT_ISAS
        if constexpr (BITS == 8) {
          decode_tile_vbmi(mp.enc1->planes, map1, c1 + o, d1, tl);
          decode_tile_vbmi(mp.enc2->planes, map2, c2 + o, d2, tl);
        } else {  // o is even: tiles start on a byte
          decode_tile4_avx512(map1, c1 + o / 2, d1, tl);
          decode_tile4_avx512(map2, c2 + o / 2, d2, tl);
        }
#endif
      } else {
        load_codes<BITS>(c1, o, in1, tl);
        load_codes<BITS>(c2, o, in2, tl);
      }
      if constexpr (kWide8) widen_corrections(mst + o, rin, tl);
      float* __restrict mc = mb[cur] + t0;
      float* __restrict vc = vb[cur] + t0;
      const float* __restrict mp_ = mb[prv] + t0;
      const float* __restrict vp_ = vb[prv] + t0;
      // The update of this tile, with pass 2 of the previous block over the same positions (the
      // previous block is whole, so it covers the tile) or without: two loops, so that neither
      // carries the other's masks.
      auto update = [&](auto pipe_tag) __attribute__((always_inline)) {
        constexpr bool PIPE = decltype(pipe_tag)::value;
        auto step = [&](int64_t j) __attribute__((always_inline)) {
          const int64_t i = o + j;
          float w;
          if constexpr (kWide8) w = remainder8_join_wide(p[i].bits, rin[j]);
          else w = load_weight<T, MODE>(p, mst, i);
          float m = VBMI ? d1[j] * a1 : quant8_decode(map1, in1[j], a1);
          float v = VBMI ? d2[j] * a2 : quant8_decode(map2, in2[j], a2);
          float unused = 0.f;
          adam_element<false>(w, to_f32(g[i]), m, v, unused, sc);
          if constexpr (kWide8) remainder8_split_wide(w, p[i].bits, rout[j]);
          else store_weight<T, MODE>(w, p, mst, i, seed, stream, begin + i);
          mc[j] = m;
          vc[j] = v;
          if constexpr (PIPE)
            encode_pair<LUT>(mp_[j], vp_[j], prev_r1, prev_r2, lut1, lut2, thr1, thr2, zc, out1[j], out2[j]);
        };
        if constexpr (kSplitMax) {
#pragma omp simd
          for (int64_t j = 0; j < tl; ++j) step(j);
          am1 = absmax_bits(mc, tl, am1);
          am2 = absmax_bits(vc, tl, am2);
        } else {
          uint32_t t1 = am1, t2 = am2;
#pragma omp simd reduction(max : t1, t2)
          for (int64_t j = 0; j < tl; ++j) {
            step(j);
            const uint32_t b1 = f32_bits(fabsf(mc[j])), b2 = f32_bits(fabsf(vc[j]));
            t1 = t1 > b1 ? t1 : b1;
            t2 = t2 > b2 ? t2 : b2;
          }
          am1 = t1;
          am2 = t2;
        }
      };
      if (pipe) update(std::true_type{});
      else update(std::false_type{});
      if constexpr (kWide8) narrow_corrections(rout, mst + o, tl);
      if (pipe) {
        store_codes<BITS>(c1, prev_b0 + t0, out1, tl);
        store_codes<BITS>(c2, prev_b0 + t0, out2, tl);
      }
    }
    if (pipe && len < prev_len)
      requantize<LUT, BITS>(mb[prv], vb[prv], c1 + prev_b0 * BITS / 8, c2 + prev_b0 * BITS / 8,
                            len, prev_len, prev_r1, prev_r2, lut1, lut2, thr1, thr2, zc);
    absmax1[blk] = bits_f32(am1);
    absmax2[blk] = bits_f32(am2);
    prev_b0 = b0;
    prev_len = len;
    prev_r1 = quant8_inv_scale(bits_f32(am1));
    prev_r2 = quant8_inv_scale(bits_f32(am2));
  }
  if (prev_b0 >= 0)
    requantize<LUT, BITS>(mb[cur ^ 1], vb[cur ^ 1], c1 + prev_b0 * BITS / 8,
                          c2 + prev_b0 * BITS / 8, 0, prev_len, prev_r1, prev_r2, lut1, lut2, thr1,
                          thr2, zc);
}

#define MPF_8BIT_CHUNK_ARGS                                                                     \
  void* const* ops, int64_t begin, int64_t n, int64_t block, const AdamScalars& s,              \
      const Maps& mp, uint64_t seed, uint64_t stream
using ChunkFn = void (*)(MPF_8BIT_CHUNK_ARGS);

template <typename T, int MODE, bool LUT, int BITS>
void chunk_base(MPF_8BIT_CHUNK_ARGS) { adam8bit_chunk<T, MODE, LUT, BITS>(ops, begin, n, block, s, mp, seed, stream); }
#if MPF_8BIT_ISAS
template <typename T, int MODE, bool LUT, int BITS>
MPF_8BIT_V3 void chunk_v3(MPF_8BIT_CHUNK_ARGS) { adam8bit_chunk<T, MODE, LUT, BITS>(ops, begin, n, block, s, mp, seed, stream); }
template <typename T, int MODE, bool LUT, int BITS>
MPF_8BIT_V4 void chunk_v4(MPF_8BIT_CHUNK_ARGS) { adam8bit_chunk<T, MODE, LUT, BITS, BITS == 4>(ops, begin, n, block, s, mp, seed, stream); }
template <typename T, int MODE, bool LUT>
MPF_8BIT_VBMI void chunk_vbmi(MPF_8BIT_CHUNK_ARGS) { adam8bit_chunk<T, MODE, LUT, 8, true>(ops, begin, n, block, s, mp, seed, stream); }
#endif

// The table-driven encode on the fastest ISA; maps the tables cannot encode exactly (never the
// bitsandbytes or torchao maps) take the binary search, baseline build only. 4-bit codes take
// the v4 build on a VBMI CPU, which decodes them with vpermps (the VBMI decode is for bytes).
template <typename T, int MODE, int BITS>
ChunkFn pick_lut(bool lut) {
  if (!lut) return &chunk_base<T, MODE, false, BITS>;
#if MPF_8BIT_ISAS
  const int level = isa_level();
  if constexpr (BITS == 8)
    if (level == 5) return &chunk_vbmi<T, MODE, true>;
  if (level >= 4) return &chunk_v4<T, MODE, true, BITS>;
  if (level == 3) return &chunk_v3<T, MODE, true, BITS>;
#endif
  return &chunk_base<T, MODE, true, BITS>;
}

template <int BITS>
ChunkFn pick_kernel(int32_t dtype, int mode, bool lut) {
  return dispatch_master_mode(dtype, mode, [lut](auto tag, auto m) {
    return pick_lut<decltype(tag), decltype(m)::value, BITS>(lut);
  });
}

}  // namespace

void adam8bit_step(const TensorLists<7>& t, const double* step, const Adam8bitConfig& c,
                   int num_threads) {
  if (t.size == 0) return;
  const int ncodes = 1 << c.code_bits;
  const Maps mp{c.map1, c.map2, &encoder_for(c.map1, c.zero_code1, ncodes),
                &encoder_for(c.map2, -1, ncodes), c.zero_code1};
  const bool lut = mp.enc1->lut.exact && mp.enc2->lut.exact;
  const StepScalars<AdamScalars> ss =
      step_scalars<AdamScalars>(step, t.size, c.seed, [&c](double s) {
        return adam_scalars(c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.decoupled,
                            c.maximize, c.grad_mult, s);
      });
  const std::vector<AdamScalars>& scalars = ss.scalars;
  const std::vector<uint64_t>& seeds = ss.seeds;
  std::vector<ChunkFn> kernels(size_t(t.size));
  for (int64_t i = 0; i < t.size; ++i)
    kernels[i] = c.code_bits == 4 ? pick_kernel<4>(t.dtype[i], c.master_mode, lut)
                                  : pick_kernel<8>(t.dtype[i], c.master_mode, lut);
  // cut at whole blocks (chunks hold whole blocks: static_assert in quant8_cpu.h)
  const Slices slices = make_slices(t.numel, t.size, num_threads, c.block_size);
  for_each_slice(slices, num_threads, [&](const Chunk& ch) {
    void* ops[7];
    for (int d = 0; d < 7; ++d) ops[d] = t.data[d][ch.tensor];
    kernels[ch.tensor](ops, ch.begin, ch.end - ch.begin, c.block_size, scalars[ch.tensor], mp,
                       seeds[ch.tensor], c.streams[ch.tensor]);
  });
}

}  // namespace mpfused::cpu

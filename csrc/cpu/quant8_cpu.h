// What every CPU kernel with block-wise 8-bit state shares: the per-map encoder cache, the per-ISA
// builds and their selection, and the gather-free decode of the VBMI build.
#pragma once
#include <stdint.h>

#include "mpfused/quant8_math.h"
#include "parallel.h"

// Per-ISA builds of the chunk kernel (AVX-512, AVX2+FMA, baseline), picked once at run time.
// Not MPF_CPU_MULTIVERSION: target_clones clones get GCC's generic tuning, which never emits
// hardware gathers and emulates the table lookups with scalar loads (about 2x slower here).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define MPF_8BIT_ISAS 1
#define MPF_8BIT_V4 __attribute__((target("arch=x86-64-v4,tune=icelake-server,prefer-vector-width=512")))
#define MPF_8BIT_V3 __attribute__((target("arch=x86-64-v3,tune=haswell")))
// v4 + AVX512-VBMI (Ice Lake and later): decodes codes with in-register byte permutes.
#define MPF_8BIT_VBMI __attribute__((target("arch=x86-64-v4,avx512vbmi,tune=icelake-server,prefer-vector-width=512")))
#include <immintrin.h>
#else
#define MPF_8BIT_ISAS 0
#endif

namespace mpfused::cpu {

constexpr int64_t kMaxBlock = 4096;
constexpr int64_t kTile = 256;
static_assert(kChunkSize % kMaxBlock == 0, "chunks must hold whole quantization blocks");

// Encoding tables and thresholds per map, built once per distinct (map, sign rule) (about 2 ms)
// and kept: a step only compares the 1 KB map with the cached ones.
struct Encoder {
  Quant8Lut lut;           // with the first moment's sign rule when zero_code >= 0
  float thr[kQuantCodes];  // binary-search thresholds: the fallback when a LUT is not exact
  // The map as four byte planes (plane k = byte k of every entry's bit pattern): the decode
  // table of the VBMI path, 4 x 256 bytes = 16 zmm registers.
  alignas(64) uint8_t planes[4][kQuantCodes];
};

// `ncodes`: 256 (8-bit map) or 16 (4-bit map; thresholds padded with +inf, quant8_math.h).
const Encoder& encoder_for(const float* map, int32_t zero_code, int ncodes = kQuantCodes);

#if MPF_8BIT_ISAS
// The fastest build this CPU runs: 5 = v4 + VBMI, 4 = x86-64-v4, 3 = x86-64-v3, 0 = baseline.
// MPFUSED_CPU_ISA=base|v3|v4|vbmi caps it (read once), so that tests can run every build on one
// machine and compare them bit for bit.
int isa_level();
#endif

namespace {  // per translation unit, as before the move (inlining decisions unchanged)

// remainder8 masters staged through int16 tiles around a hot loop (remainder8_join_wide).
template <typename M>
MPF_HD void widen_corrections(const M* __restrict src, int16_t* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = int16_t(src[j]);
}

template <typename M>
MPF_HD void narrow_corrections(const int16_t* __restrict src, M* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = M(src[j]);
}

// max(am, the bits of max |s[j]| for j < n): the new absmax as bits, ordered as the floats for
// non-negative values, a NaN (above inf) wins in any order (the CUDA kernels' rule).
MPF_HD uint32_t absmax_bits(const float* __restrict s, int64_t n, uint32_t am) {
#pragma omp simd reduction(max : am)
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = f32_bits(fabsf(s[j]));
    am = am > b ? am : b;
  }
  return am;
}

#if MPF_8BIT_ISAS
// Byte position 16L + 4q + r (lane L, slot r of output vector q) takes code 16q + 4L + r: the
// order in which decode_tile_vbmi's per-lane interleave leaves the floats in order.
struct DecodePerm {
  alignas(64) uint8_t b[64];
};
constexpr DecodePerm make_decode_perm() {
  DecodePerm p{};
  for (int L = 0; L < 4; ++L)
    for (int q = 0; q < 4; ++q)
      for (int r = 0; r < 4; ++r) p.b[16 * L + 4 * q + r] = uint8_t(16 * q + 4 * L + r);
  return p;
}
constexpr DecodePerm kDecodePerm = make_decode_perm();

// out[j] = map[codes[j]] for j < n without gathers (bit-identical to quant8_decode's lookup):
// for 64 codes at a time, each byte plane of the map is looked up with two 128-entry byte
// permutes (vpermi2b) blended on the code's top bit, and the four planes are interleaved into
// floats. The codes are first permuted so that the interleave (which works per 128-bit lane)
// leaves the floats in order. Gathers cost one load per element; this costs none.
[[maybe_unused]] MPF_8BIT_VBMI void decode_tile_vbmi(const uint8_t (*planes)[kQuantCodes],
                                                     const float* map,
                                                     const uint8_t* __restrict codes,
                                                     float* __restrict out, int64_t n) {
  __m512i t[4][4];
  for (int k = 0; k < 4; ++k)
    for (int q = 0; q < 4; ++q) t[k][q] = _mm512_load_si512(planes[k] + 64 * q);
  const __m512i perm = _mm512_load_si512(kDecodePerm.b);
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512i c = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(codes + j));
    const __mmask64 upper = _mm512_movepi8_mask(c);  // codes 128..255
    __m512i b[4];
    for (int k = 0; k < 4; ++k)
      b[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(t[k][0], c, t[k][1]),
                                    _mm512_permutex2var_epi8(t[k][2], c, t[k][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    _mm512_store_si512(out + j, _mm512_unpacklo_epi16(lo01, lo23));
    _mm512_store_si512(out + j + 16, _mm512_unpackhi_epi16(lo01, lo23));
    _mm512_store_si512(out + j + 32, _mm512_unpacklo_epi16(hi01, hi23));
    _mm512_store_si512(out + j + 48, _mm512_unpackhi_epi16(hi01, hi23));
  }
  for (; j < n; ++j) out[j] = map[codes[j]];
}

// The 4-bit counterpart (x86-64-v4, no VBMI needed): out[j] = map[code of element j] for j < n,
// element 0 the high nibble of codes[0] (quant4_code_at's order; n may be odd). The 16-entry map
// is one zmm register and vpermps looks 16 codes up at once: no gathers.
[[maybe_unused]] MPF_8BIT_V4 void decode_tile4_avx512(const float* map,
                                                      const uint8_t* __restrict codes,
                                                      float* __restrict out, int64_t n) {
  const __m512 table = _mm512_loadu_ps(map);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j / 2));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);  // elements 2k
    const __m128i lo = _mm_and_si128(b, low4);                      // elements 2k + 1
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
    _mm512_storeu_ps(out + j, _mm512_permutexvar_ps(idx, table));
  }
  for (; j < n; ++j) out[j] = map[quant4_code_at(codes, j)];
}

// The 4-bit encode of a tile (x86-64-v4): the code of s[j] * r for j < n, packed two per byte
// from codes[0] (store_codes<4>'s layout from an even element: an odd n leaves the last low
// nibble 0). quant4_encode step by step, its thresholds in one zmm register: each step looks up
// the next threshold of 16 values with one vpermps and compares (ordered, false for NaN, as the
// scalar `>`): the same codes as the scalar search and the LUT for every float32, with neither
// the LUT's table gathers nor its 256 KiB in the cache. `thr`: the map's padded thresholds
// (quant8_thresholds(map, thr, 16): thr[15] = +inf, never compared).
[[maybe_unused]] MPF_8BIT_V4 void encode_tile4_avx512(const float* thr,
                                                      const float* __restrict s, float r,
                                                      uint8_t* __restrict codes, int64_t n) {
  const __m512 table = _mm512_loadu_ps(thr);
  const __m512 scale = _mm512_set1_ps(r);
  const __m512 mid = _mm512_set1_ps(thr[7]);
  const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
  const __m512i three = _mm512_set1_epi32(3), four = _mm512_set1_epi32(4);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), scale);
    __m512i c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, mid, _CMP_GT_OQ),
                                       _mm512_set1_epi32(8));
    __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(c, three), table);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, t, _CMP_GT_OQ), c, four);
    t = _mm512_permutexvar_ps(_mm512_add_epi32(c, one), table);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, t, _CMP_GT_OQ), c, two);
    t = _mm512_permutexvar_ps(c, table);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, t, _CMP_GT_OQ), c, one);
    // element pairs as 32-bit words (even | odd << 16) -> one byte each: even << 4 | odd
    const __m256i w = _mm512_cvtepi32_epi16(c);
    const __m256i b = _mm256_or_si256(_mm256_slli_epi32(w, 4), _mm256_srli_epi32(w, 16));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + j / 2), _mm256_cvtepi32_epi8(b));
  }
  for (; j + 1 < n; j += 2)
    codes[j / 2] = quant4_pack(quant4_encode(thr, s[j] * r), quant4_encode(thr, s[j + 1] * r));
  if (j < n) codes[j / 2] = quant4_pack(quant4_encode(thr, s[j] * r), 0);
}
#endif

// Codes q[0, count) of elements [from, from + count) into a state of BITS-bit codes. 4-bit: an
// odd `from` shares its byte with the element before (written earlier in the same pass: only
// the low nibble is set); an odd end leaves the low nibble 0 (the padding of an odd-sized tensor,
// or a seam the next store fills).
template <int BITS>
MPF_HD void store_codes(uint8_t* __restrict c, int64_t from, const int32_t* __restrict q,
                        int64_t count) {
  if constexpr (BITS == 8) {
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) c[from + j] = uint8_t(q[j]);
  } else {
    int64_t j = 0;
    if ((from & 1) != 0 && count > 0) {
      c[from >> 1] = uint8_t((c[from >> 1] & 0xF0) | (q[0] & 0xF));
      j = 1;
    }
    uint8_t* __restrict d = c + ((from + j) >> 1);
    const int64_t pairs = (count - j) >> 1;
#pragma omp simd
    for (int64_t k = 0; k < pairs; ++k) d[k] = quant4_pack(q[j + 2 * k], q[j + 2 * k + 1]);
    if (((count - j) & 1) != 0) d[pairs] = quant4_pack(q[count - 1], 0);
  }
}

// Codes of elements [from, from + count) of a BITS-bit state, widened to int32.
template <int BITS>
MPF_HD void load_codes(const uint8_t* __restrict c, int64_t from, int32_t* __restrict q,
                       int64_t count) {
  if constexpr (BITS == 4) {
    if ((from & 1) == 0) {  // always, in the kernel: tiles start on a byte
      const uint8_t* __restrict b = c + (from >> 1);
      const int64_t pairs = count >> 1;
#pragma omp simd
      for (int64_t k = 0; k < pairs; ++k) {
        q[2 * k] = b[k] >> 4;
        q[2 * k + 1] = b[k] & 0xF;
      }
      if ((count & 1) != 0) q[count - 1] = b[pairs] >> 4;
      return;
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < count; ++j)
    q[j] = BITS == 8 ? int32_t(c[from + j]) : quant4_code_at(c, from + j);
}

}  // namespace
}  // namespace mpfused::cpu

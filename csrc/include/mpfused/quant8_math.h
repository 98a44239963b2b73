// Block-wise 8-bit quantization of optimizer state, in the layout of bitsandbytes (>= 0.44):
// a state tensor of n elements is stored as n uint8 codes (indices into a sorted 256-entry float32
// map, mpfused/quant_maps.py) plus one float32 absmax per block of `block` consecutive elements
// (logical row-major order; the last block may be short):
//     value[i] = map[code[i]] * absmax[i / block]
//     absmax[b] = max |s| over block b of the (updated, fp32) state s
//     code[i]   = the map entry nearest to x = s[i] * (1 / absmax[b])  (x = 0 when absmax is 0)
// The reciprocal is one float32 division per block, as bitsandbytes' CPU path; its CUDA kernel
// divides every element, which can change x by one ulp and so, rarely, a code by one.
// Host and device: the CPU kernel and (later) the CUDA kernel use these same functions.
#pragma once
#include "mpfused/platform.h"

namespace mpfused {

constexpr int kQuantCodes = 256;

// ---- encoding thresholds ---------------------------------------------------------------------
// thr[i] = the largest float32 <= the exact midpoint of map[i] and map[i+1]; thr[255] = +inf.
// For a float32 x, `x > thr[i]` is then exactly `x > (map[i] + map[i+1]) / 2`, so
// code(x) = #{i : x > thr[i]} is the nearest entry with no rounding in the decision (ties go to
// the lower index, like argmin |x - map|). mpfused/quant_maps.py::thresholds computes the same.
MPF_HD float quant8_threshold(float a, float b) {
  const double mid = (double(a) + double(b)) * 0.5;  // exact: the maps span < 2^29 in magnitude
  float t = float(mid);
  if (double(t) > mid) t = nextafterf(t, -INFINITY);
  return t;
}

// `ncodes` = 256 (8-bit maps) or 16 (4-bit maps, see "4-bit codes" below): thr[ncodes - 1 ..
// 255] = +inf, so that quant8_encode over the padded array returns the nearest of the `ncodes`
// entries (never above ncodes - 1): every encoder below serves both widths unchanged.
MPF_HD void quant8_thresholds(const float* map, float* thr, int ncodes = kQuantCodes) {
  for (int i = 0; i + 1 < ncodes; ++i) thr[i] = quant8_threshold(map[i], map[i + 1]);
  for (int i = ncodes - 1; i < kQuantCodes; ++i) thr[i] = INFINITY;
}

// ---- encode / decode -------------------------------------------------------------------------
// Branch-free binary search over the 255 sorted thresholds: 8 compares, the nearest code.
// (NaN compares false everywhere and encodes as 0.)
// Written out (not a loop) so that CPU compilers vectorize it. Codes are int32 throughout: x86
// compilers only emit hardware gathers for signed 32-bit indices.
MPF_HD int32_t quant8_encode(const float* thr, float x) {
  int32_t c = x > thr[127] ? 128 : 0;
  c += x > thr[c + 63] ? 64 : 0;
  c += x > thr[c + 31] ? 32 : 0;
  c += x > thr[c + 15] ? 16 : 0;
  c += x > thr[c + 7] ? 8 : 0;
  c += x > thr[c + 3] ? 4 : 0;
  c += x > thr[c + 1] ? 2 : 0;
  c += x > thr[c] ? 1 : 0;
  return c;
}

// ---- the same search over thresholds in breadth-first (Eytzinger) order (CUDA kernel) --------
// quant8_encode's implicit tree stored level by level: node k (1..255; level d = floor(log2 k),
// j = k - 2^d) is the pivot that search compares at step d after taking path j,
//     eyt[k] = thr[j * (256 >> d) + (128 >> d) - 1],
// and the search is k = 2k + (x > eyt[k]), 8 times, code = k - 256: the same comparisons in the
// same order, so the same code for every float32 (NaN: 0; tests/test_quant8_eytzinger.py checks
// all 2^32). Why: in sorted order the pivots of one level share their low index bits, so a warp's
// 32 searches hit the same shared-memory banks (~31 wavefronts per warp-wide search with Adam-like
// moments); level by level they spread over the banks (~10). eyt[0] is unused.
// The node of sorted threshold i (0..254): i + 1 = 2^(7-d) (2j + 1).
MPF_HD int32_t quant8_eytzinger_node(int32_t i) {
  const int32_t s = i + 1;
  int32_t tz = 0;
  while (((s >> tz) & 1) == 0) ++tz;
  return (1 << (7 - tz)) + (s >> (tz + 1));
}

MPF_HD int32_t quant8_encode_eytzinger(const float* eyt, float x) {
  int32_t k = 1;
#pragma unroll
  for (int l = 0; l < 8; ++l) k = 2 * k + (x > eyt[k] ? 1 : 0);
  return k - kQuantCodes;
}

// The value encoded is s * quant8_inv_scale(absmax). The reciprocal saturates at FLT_MAX, so an
// all-zero block (absmax 0) encodes zeros and a block with a subnormal absmax stays finite.
// |x| may exceed 1 by an ulp: the encoders clamp (it still encodes as +-1's code).
MPF_HD float quant8_inv_scale(float absmax) {
  const float r = 1.f / absmax;
  return r < 3.40282347e38f ? r : 3.40282347e38f;
}

MPF_HD float quant8_decode(const float* map, int32_t code, float absmax) {
  return map[code] * absmax;
}

// bitsandbytes' sign rule for the first moment (kOptimizerStatic8bit2StateBlockwise): when the
// code's value and m differ in sign bit, step one code toward m. With a sorted map holding +0 at
// `zero_code`, that happens only to a negative m (or -0) rounded to +0: it is stored one code
// below zero, so a negative first moment never comes back as 0 or positive (a positive one may
// still round to 0). Never applied to the second moment.
MPF_HD int32_t quant8_keep_negative(int32_t code, float m, int32_t zero_code) {
  return ((f32_bits(m) >> 31) != 0u && code == zero_code) ? code - 1 : code;
}

// ---- table-driven encode (CPU fast path, same result as quant8_encode) -------------------------
// One table entry per bin of the float32 bit pattern: bin = bits >> 16 (sign, exponent and 7
// mantissa bits, i.e. the bf16 pattern), key = bits & 0xFFFF (the position in the bin; x moves
// monotonically with the key inside a bin, up for positive bins, down for negative ones). Codes
// are monotonic in x, so a bin whose codes differ by at most one holds one cut: the entry packs
//     [ cut : 16 | code if key > cut : 8 | code otherwise : 8 ]
// (cut 0xFFFF: one code for the whole bin). One table load and four integer operations per value
// (shift, compare, masked shift, narrow) instead of eight dependent loads; every float32 (NaN and inf included) encodes as
// quant8_encode would, which the builder checks bin by bin.
struct Quant8Lut {
  static constexpr int kBins = 1 << 16;
  uint32_t lut[kBins];  // bin b at b ^ 0x8000 (the negative bins first)
  const uint32_t* center() const { return lut + kBins / 2; }
  bool exact;  // false: some bin spans more than two codes; use quant8_encode
};

// `center` = lut + 32768: the entries are indexed by the signed top half of the bits, which x86
// compilers turn into a hardware gather (an index they can prove non-negative they do not).
// Returns a word whose low 8 bits are the code (callers narrow to uint8, which drops the rest).
MPF_HD uint32_t quant8_encode_lut(const uint32_t* center, float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t e = center[int32_t(u) >> 16];
  // key > cut  <=>  (key << 16) > e: the codes in e's low half only break the tie key == cut,
  // downward, so the cut needs no unpacking.
  return (u << 16) > e ? e >> 8 : e;
}


// Host: fills the table for `map` (sorted) and says whether it reproduces quant8_encode exactly.
// With `negative_zero_code` >= 0 (the first moment's map) the table also applies
// quant8_keep_negative: x = m * (1 / absmax) has m's sign, so the negative bins (sign bit set,
// -0 included) store zero_code - 1 where the nearest code is zero_code.
inline void quant8_build_lut(const float* map, Quant8Lut& t, int32_t negative_zero_code = -1,
                             int ncodes = kQuantCodes) {
  float thr[kQuantCodes];
  quant8_thresholds(map, thr, ncodes);
  t.exact = true;
  for (uint32_t bin = 0; bin < uint32_t(Quant8Lut::kBins); ++bin) {
    const uint32_t base = bin << 16;
    const int32_t c0 = quant8_encode(thr, bits_f32(base));
    const int32_t c1 = quant8_encode(thr, bits_f32(base | 0xFFFFu));
    uint32_t cut = 0xFFFFu;
    if (c0 != c1) {
      // Codes are monotonic in x: a finite bin spanning two codes has one cut. The inf bins are
      // inf at key 0 and NaN (code 0) above: one cut too.
      const bool inf_bin = (bin & 0x7F80u) == 0x7F80u;
      t.exact = t.exact && (inf_bin || c1 - c0 == 1 || c0 - c1 == 1);
      uint32_t lo = 1, hi = 0xFFFFu;  // the first key with code c1 (the code at key 0 is c0)
      while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (quant8_encode(thr, bits_f32(base | mid)) == c1) hi = mid;
        else lo = mid + 1;
      }
      cut = lo - 1;
    }
    int32_t d0 = c0, d1 = c1;
    if (negative_zero_code >= 0 && (bin & 0x8000u) != 0) {
      d0 = d0 == negative_zero_code ? d0 - 1 : d0;
      d1 = d1 == negative_zero_code ? d1 - 1 : d1;
    }
    t.lut[bin ^ 0x8000u] = (cut << 16) | (uint32_t(d1) << 8) | uint32_t(d0);  // see center
  }
}

// ---- 4-bit codes (two per byte) --------------------------------------------------------------
// A 4-bit state is the same block-wise format with a 16-entry sorted map (mpfused/quant_maps.py:
// torchao's signed dynamic map for a first moment, its zero-free linear map 1/16 .. 1 for a second
// moment) and two codes per byte in torchao's order: element 2k in the high nibble of byte k,
// element 2k+1 in the low nibble; an odd-sized tensor's last byte has a zero low nibble. Blocks
// hold an even number of elements (block_size >= 64), so every block starts on a byte.
// Encoding is quant8_encode over quant8_thresholds(map, thr, 16) (nearest entry, ties to the lower
// code), or quant4_encode over the first 16 thresholds: the same code for every float32.
constexpr int kQuant4Codes = 16;

MPF_HD int32_t quant4_encode(const float* thr, float x) {
  int32_t c = x > thr[7] ? 8 : 0;
  c += x > thr[c + 3] ? 4 : 0;
  c += x > thr[c + 1] ? 2 : 0;
  c += x > thr[c] ? 1 : 0;
  return c;
}

// quant8_encode_eytzinger over the thresholds of a 16-entry map padded with +inf (above): its
// first four levels compare with +inf (false for every float32, NaN included) and reach node 16,
// so starting there gives the same code with 4 of the 8 compares (CUDA kernel).
MPF_HD int32_t quant4_encode_eytzinger(const float* eyt, float x) {
  int32_t k = kQuant4Codes;
#pragma unroll
  for (int l = 0; l < 4; ++l) k = 2 * k + (x > eyt[k] ? 1 : 0);
  return k - kQuantCodes;
}

// The code of element i of a packed 4-bit state.
MPF_HD int32_t quant4_code_at(const uint8_t* packed, int64_t i) {
  return int32_t(packed[i >> 1] >> (((i & 1) ^ 1) * 4)) & 0xF;
}

// The byte of elements 2k (`even`) and 2k+1 (`odd`); only the low 4 bits of each are used.
MPF_HD uint8_t quant4_pack(int32_t even, int32_t odd) {
  return uint8_t(((even & 0xF) << 4) | (odd & 0xF));
}

}  // namespace mpfused

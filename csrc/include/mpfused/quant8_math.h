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

MPF_HD void quant8_thresholds(const float* map, float* thr) {
  for (int i = 0; i + 1 < kQuantCodes; ++i) thr[i] = quant8_threshold(map[i], map[i + 1]);
  thr[kQuantCodes - 1] = INFINITY;
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
// Bins of the float32 bit pattern with 7 mantissa bits (bf16 resolution) over |x| in [2^-24, 1],
// one table per map. A bin holds at most one threshold (checked when the table is built), so an
// entry packs the code of the bin's lowest value and where in the bin the next code starts: the
// low 16 bits of that threshold, as a key increasing with x (0xFFFF: nowhere). One table load per
// value instead of 8 dependent ones. |x| below 2^-24 / above 1 encodes like +-2^-24 / +-1 (also
// checked).
struct Quant8Lut {
  static constexpr uint32_t kLo = 0x33800000u;  // 2^-24
  static constexpr uint32_t kHi = 0x3F800000u;  // 1.0
  static constexpr int kShift = 16;
  static constexpr int kHalf = int((kHi - kLo) >> kShift) + 1;  // bins per sign
  int32_t lut[2 * kHalf];  // (cutoff16 << 8) | code
  bool exact;              // false: the map does not fit the bins; use quant8_encode
};

// |x| clamped to [2^-24, 1] as bits (a), its bin (increasing with x) and its key within the bin.
MPF_HD int32_t quant8_lut_entry_index(float x, int32_t& key) {
  const uint32_t u = f32_bits(x);
  const uint32_t neg = u >> 31;
  uint32_t a = u & 0x7FFFFFFFu;
  a = a < Quant8Lut::kLo ? Quant8Lut::kLo : a;
  a = a > Quant8Lut::kHi ? Quant8Lut::kHi : a;  // NaN too: the kernels never feed NaN here
  key = int32_t((a & 0xFFFFu) ^ (neg ? 0xFFFFu : 0u));
  const int32_t m = int32_t((a - Quant8Lut::kLo) >> Quant8Lut::kShift);
  return neg ? Quant8Lut::kHalf - 1 - m : Quant8Lut::kHalf + m;
}

MPF_HD int32_t quant8_encode_lut(const int32_t* lut, float x) {
  int32_t key;
  const int32_t e = lut[quant8_lut_entry_index(x, key)];
  return (e & 0xFF) + (key > (e >> 8) ? 1 : 0);
}

// Host: fills the table for `map` (sorted); `exact` says it reproduces quant8_encode exactly.
inline void quant8_build_lut(const float* map, Quant8Lut& t) {
  float thr[kQuantCodes];
  quant8_thresholds(map, thr);
  const float lo_mag = bits_f32(Quant8Lut::kLo);
  bool ok = thr[0] >= -1.f && thr[kQuantCodes - 2] < 1.f;
  for (int i = 0; i + 1 < kQuantCodes; ++i)  // nothing to decide between -2^-24 and +2^-24
    ok = ok && !(thr[i] >= -lo_mag && thr[i] < lo_mag);
  for (int b = 0; b < 2 * Quant8Lut::kHalf; ++b) {
    const bool neg = b < Quant8Lut::kHalf;
    const uint32_t m = uint32_t(neg ? Quant8Lut::kHalf - 1 - b : b - Quant8Lut::kHalf);
    const uint32_t a0 = Quant8Lut::kLo + (m << Quant8Lut::kShift);
    const uint32_t top = a0 + ((1u << Quant8Lut::kShift) - 1u);
    const uint32_t a1 = top < Quant8Lut::kHi ? top : Quant8Lut::kHi;
    const float lo = neg ? -bits_f32(a1) : bits_f32(a0);
    const float hi = neg ? -bits_f32(a0) : bits_f32(a1);
    const int32_t c = quant8_encode(thr, lo);
    const int32_t c_hi = quant8_encode(thr, hi);
    int32_t cutoff = 0xFFFF;
    if (c_hi == c + 1) {  // thr[c] lies in [lo, hi): same high bits, compare the low 16
      const uint32_t at = f32_bits(thr[c]) & 0x7FFFFFFFu;
      ok = ok && (at >> Quant8Lut::kShift) == (a0 >> Quant8Lut::kShift) && (f32_bits(thr[c]) >> 31) == (neg ? 1u : 0u);
      cutoff = int32_t((at & 0xFFFFu) ^ (neg ? 0xFFFFu : 0u));
    } else {
      ok = ok && c_hi == c;
    }
    t.lut[b] = (cutoff << 8) | c;
  }
  t.exact = ok;
}

}  // namespace mpfused

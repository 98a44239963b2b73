// Storage types and their conversions to and from the fp32 compute type.
// bf16/fp16 are plain 16-bit structs so this header needs neither torch nor cuda_fp16.h; the bit
// formulas are the IEEE round-to-nearest-even conversions (the same results as c10::Half and
// c10::BFloat16), written without branches so CPU loops vectorize.
#pragma once
#include "mpfused/platform.h"

namespace mpfused {

// Codes shared with the bindings (which map torch dtypes to them) and the Python side.
enum DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

MPF_HD float to_f32(float x) { return x; }
MPF_HD float to_f32(bf16_t x) { return bits_f32(uint32_t(x.bits) << 16); }

MPF_HD float to_f32(f16_t h) {
  // Branch-free half -> float (normal, subnormal, inf and NaN), exact.
  const uint32_t w = uint32_t(h.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
  return bits_f32(r);
}

// Round to nearest even; NaN becomes the canonical quiet NaN 0x7FC0 as in c10::BFloat16.
MPF_HD uint16_t bf16_bits_rne(float f) {
  uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
}

MPF_HD uint16_t f16_bits_rne(float f) {
  // Float -> half, round to nearest even, overflow to inf, NaN to quiet NaN.
  float base = (bits_f32(f32_bits(f) & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// from_f32<T>(x): the store conversion for each storage type (overloads picked by a tag).
MPF_HD float from_f32_as(float x, float) { return x; }
MPF_HD bf16_t from_f32_as(float x, bf16_t) { return bf16_t{bf16_bits_rne(x)}; }
MPF_HD f16_t from_f32_as(float x, f16_t) { return f16_t{f16_bits_rne(x)}; }
template <typename T> MPF_HD T from_f32(float x) { return from_f32_as(x, T{}); }

}  // namespace mpfused

// Portability layer for the per-element math: the same inline functions compile for the host
// (gcc/clang, CPU kernels) and for the device (nvcc). No torch headers anywhere under include/.
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__CUDACC__)
#define MPF_HD __host__ __device__ __forceinline__
#else
// static: every translation unit (and every ISA variant of a CPU kernel) gets its own copy, so an
// AVX-512 build of a helper can never be picked by the linker for the baseline path.
#define MPF_HD static inline __attribute__((always_inline))
#endif

// The CPU and CUDA kernels agree to the bit only with IEEE float math on both sides: no fast math
// (approximate division / square root, flush-to-zero, which the branch-free fp16 conversions in
// dtype.h also rely on) and no FMA contraction (setup.py: --fmad=false, -ffp-contract=off;
// tests/test_cuda_compile.py checks the flags and the PTX). nvcc 13 defines no macro for
// --use_fast_math or --fmad, so for CUDA the guards are setup.py's flag check and that PTX test.
#if defined(__FAST_MATH__)
#error "mpfused: -ffast-math breaks the bit-exact CPU = CUDA contract; build without it"
#endif

namespace mpfused {

MPF_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
#endif
}

MPF_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// Finite test on the bit pattern: exact under -ffast-math too, and branch-free for vectorizers.
MPF_HD bool is_finite_f32(float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }

MPF_HD float min_f32(float a, float b) { return a < b ? a : b; }
MPF_HD float max_f32(float a, float b) { return a > b ? a : b; }

}  // namespace mpfused

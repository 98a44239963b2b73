// Adam/AdamW per-element math shared by every native backend, and the ways a 16-bit parameter
// keeps (or does not keep) its fp32 value between steps (MasterMode).
#pragma once
#include <type_traits>

#include "mpfused/dtype.h"

namespace mpfused {

// How the fp32 value w of a parameter is stored between steps.
enum MasterMode : int32_t {
  kNoMaster = 0,    // fp32 params: w is the param. 16-bit params: round to nearest, no master.
  kFp32Master = 1,  // 16-bit params + fp32 master (4 B/param); param = master rounded to nearest
  kRemainder = 2,   // bf16 params + int16 low half of the fp32 master (2 B/param), exact
  kStochastic = 3,  // bf16 params, no master, stochastic rounding of each update
  kRemainder8 = 4,  // bf16 params + int8 correction (1 B/param): a 24-bit master, rounded
};

// The per-element masters operand of each mode (MasterStore<MODE>::type) and whether the mode
// reads one (kStored; else its pointer is null and never read). A kernel written against this
// trait, load_weight / store_weight and dispatch_master_mode gets every mode.
template <int MODE> struct MasterStore { using type = float; static constexpr bool kStored = false; };
template <> struct MasterStore<kFp32Master> { using type = float; static constexpr bool kStored = true; };
template <> struct MasterStore<kRemainder> { using type = int16_t; static constexpr bool kStored = true; };
template <> struct MasterStore<kRemainder8> { using type = int8_t; static constexpr bool kStored = true; };
template <int MODE> using master_t = typename MasterStore<MODE>::type;

// The masters operand of a chunk starting at `begin` (null for a mode without one).
template <int MODE>
MPF_HD master_t<MODE>* master_operand(void* op, int64_t begin) {
  if constexpr (MasterStore<MODE>::kStored) return static_cast<master_t<MODE>*>(op) + begin;
  else return nullptr;
}

// The master modes each dtype has (every backend's rule): fp32 params are their own master, fp16
// has an fp32 master or none (fp16 is not the top half of an fp32 word), bf16 every mode.
template <typename T>
constexpr int effective_master_mode(int mode) {
  if (std::is_same<T, float>::value) return kNoMaster;
  if (std::is_same<T, f16_t>::value) return mode == kFp32Master ? kFp32Master : kNoMaster;
  return mode == kFp32Master || mode == kRemainder || mode == kStochastic || mode == kRemainder8
             ? mode : kNoMaster;
}

// Host dispatch of a tensor's kernel: f(T{}, std::integral_constant<int, MODE>{}) with the
// storage type of `dtype` and the effective master mode of the requested `mode`.
template <typename F>
decltype(auto) dispatch_master_mode(int32_t dtype, int mode, F&& f) {
  using NoM = std::integral_constant<int, kNoMaster>;
  using Fp32 = std::integral_constant<int, kFp32Master>;
  if (dtype == kFloat32) return f(float{}, NoM{});
  if (dtype == kFloat16) return mode == kFp32Master ? f(f16_t{}, Fp32{}) : f(f16_t{}, NoM{});
  switch (mode) {
    case kFp32Master: return f(bf16_t{}, Fp32{});
    case kRemainder: return f(bf16_t{}, std::integral_constant<int, kRemainder>{});
    case kStochastic: return f(bf16_t{}, std::integral_constant<int, kStochastic>{});
    case kRemainder8: return f(bf16_t{}, std::integral_constant<int, kRemainder8>{});
    default: return f(bf16_t{}, NoM{});
  }
}

// Scalars of one tensor's update, computed once per tensor (host or device). Every constant that
// torch derives from its double hyperparameters is derived here in double and rounded to fp32
// once, as torch's for-loop and fused CPU kernels do: 1 - beta rounded from the fp32 beta instead
// would be off by up to 3e-3 relative for beta2 = 0.99999 (half an fp32 ulp of beta2 / (1 - beta2)).
struct AdamScalars {
  float beta2, eps;
  float one_minus_beta1, one_minus_beta2;
  float decay;       // AdamW: lr*weight_decay (applied to p); Adam: 0
  float l2;          // Adam: weight_decay (added to g); AdamW: 0
  float grad_mult;   // inv_scale * clip_coef, negated for maximize
  float step_size;   // lr / (1 - beta1^t)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
};

// lr, betas and weight_decay in double (the bias corrections use the betas unrounded, as torch).
MPF_HD AdamScalars adam_scalars(double lr, double beta1, double beta2, float eps,
                                double weight_decay, bool decoupled, bool maximize,
                                float grad_mult, double t) {
  AdamScalars s;
  s.beta2 = float(beta2);
  s.eps = eps;
  s.one_minus_beta1 = float(1.0 - beta1);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.decay = decoupled ? float(lr * weight_decay) : 0.f;
  s.l2 = decoupled ? 0.f : float(weight_decay);
  s.grad_mult = maximize ? -grad_mult : grad_mult;
  s.step_size = float(lr / (1.0 - pow(beta1, t)));
  s.inv_bc2_sqrt = float(1.0 / sqrt(1.0 - pow(beta2, t)));
  return s;
}

// One Adam(W) update of the fp32 value w. torch order: decoupled decay of w, m = lerp(m, g, 1-b1),
// v = b2*v + (1-b2)*g*g, denom = sqrt(v)/sqrt(1-b2^t) + eps, w -= step_size * m / denom.
// One difference in rounding: sqrt(v) is multiplied by the per-tensor 1/sqrt(1-b2^t) instead of
// divided by sqrt(1-b2^t) (denom within 1 fp32 ulp of torch's): a division per element is the
// scarcest resource of the CPU kernels (about 10% of an in-cache 8-bit step).
template <bool AMSGRAD>
MPF_HD void adam_element(float& w, float g, float& m, float& v, float& vmax, const AdamScalars& s) {
  g = g * s.grad_mult;
  if (s.l2 != 0.f) g = g + s.l2 * w;  // Adam's L2 term; AdamW leaves g as it is, like torch
  w = w - s.decay * w;
  m = m + s.one_minus_beta1 * (g - m);
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  float vv = v;
  if (AMSGRAD) {
    vmax = max_f32(vmax, v);
    vv = vmax;
  }
  const float denom = sqrtf(vv) * s.inv_bc2_sqrt + s.eps;
  w = w - s.step_size * m / denom;
}

// Remainder master (TransformerEngine's trick): the fp32 word is [hi16 | lo16]; the bf16 param
// holds hi16 rounded to nearest (ties away from zero), the int16 remainder holds lo16. A NaN is
// stored as the canonical quiet NaN (param 0x7FC0, remainder 0), as torch converts NaN to bf16:
// rounding GPU arithmetic's NaN 0x7FFFFFFF up would carry into the sign and leave a -0.0 param.
MPF_HD float remainder_join(uint16_t p_bits, int16_t rem) {
  const uint32_t hi = rem < 0 ? uint32_t(uint16_t(p_bits - 1)) : uint32_t(p_bits);
  return bits_f32((hi << 16) | uint32_t(uint16_t(rem)));
}

MPF_HD void remainder_split(float w, uint16_t& p_bits, int16_t& rem) {
  uint32_t u = f32_bits(w);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = 0x7FC00000u;
  rem = int16_t(uint16_t(u & 0xFFFFu));
  p_bits = uint16_t((u >> 16) + (rem < 0 ? 1u : 0u));
}

// Counter-based random 16 bits (a splitmix64 finalizer): the same stream on every backend for the
// same (seed, stream, element), so stochastic rounding is reproducible and backend-independent.
// `stream` is sr_stream(param_id, elem_offset) of the element's tensor, `index` its logical
// position in that tensor: the bits depend on the param and the element's index in the whole
// param only, never on how params are grouped, bucketed or sharded.
MPF_HD uint64_t sr_stream(uint64_t param_id, uint64_t elem_offset) {
  return 0x9E3779B97F4A7C15ull * (param_id + 1) + elem_offset * 0xBF58476D1CE4E5B9ull;
}

MPF_HD uint32_t random16(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t z = seed + stream + index * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z = z ^ (z >> 31);
  return uint32_t(z >> 48);
}

// The stream of step t: a fresh draw every step without any host-side counter (capturable).
MPF_HD uint64_t step_seed(uint64_t seed, double t) {
  return seed ^ (uint64_t(t) * 0xD1B54A32D192ED03ull);
}

// bf16 stochastic rounding: round away from zero with probability lo16 / 2^16.
MPF_HD uint16_t bf16_bits_stochastic(float w, uint32_t r16) {
  const uint32_t u = f32_bits(w);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t(0x7FC0);
  return uint16_t((u + r16) >> 16);
}

// One-byte master correction (kRemainder8). The master is the fp32 word rounded to its top 24
// bits (sign, exponent, 15 of 23 mantissa bits: 16 significant bits), to nearest, ties to even;
// overflow rounds to inf, a NaN becomes the canonical quiet NaN 0x7FC00000. It is split as the
// int16 remainder: the int8 correction is bits 8..15 of that word, the bf16 param bits 16..31
// rounded to nearest, ties away from zero (a negative correction, bit 15 set, rounds up), so
// join(split(w)) is w rounded to 24 bits, bit for bit.
MPF_HD uint32_t round_to_24_bits(float w) {
  const uint32_t u = f32_bits(w);
  const uint32_t r = (u + 0x7Fu + ((u >> 8) & 1u)) & 0xFFFFFF00u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : r;
}

// The correction is taken and given sign-extended to 16 bits (the `_wide` forms): CPU kernels
// stage the int8 corrections through int16 tiles, so that their hot loops handle only 16- and
// 32-bit lanes, as the int16 remainder's do (an int8 operand in the loop makes GCC vectorize it
// 4 floats at a time).
MPF_HD float remainder8_join_wide(uint16_t p_bits, int16_t rem) {
  const uint32_t hi = rem < 0 ? uint32_t(uint16_t(p_bits - 1)) : uint32_t(p_bits);
  return bits_f32((hi << 16) | ((uint32_t(uint16_t(rem)) & 0xFFu) << 8));
}

MPF_HD void remainder8_split_wide(float w, uint16_t& p_bits, int16_t& rem) {
  const uint32_t u = round_to_24_bits(w);
  rem = int16_t(int32_t(u << 16) >> 24);  // bits 8..15, sign-extended
  p_bits = uint16_t((u >> 16) + (rem < 0 ? 1u : 0u));
}

MPF_HD float remainder8_join(uint16_t p_bits, int8_t rem) {
  return remainder8_join_wide(p_bits, int16_t(rem));
}

MPF_HD void remainder8_split(float w, uint16_t& p_bits, int8_t& rem) {
  int16_t r;
  remainder8_split_wide(w, p_bits, r);
  rem = int8_t(r);
}

// The fp32 value w of a param element p with its master m (MasterStore<MODE>), and its store
// back, per master mode: what every kernel does around its per-element update. T is the
// effective storage type (effective_master_mode: bf16 for the remainder and stochastic modes).
template <typename T, int MODE>
MPF_HD float load_weight(T p, master_t<MODE> m) {
  if constexpr (MODE == kFp32Master) return m;
  else if constexpr (MODE == kRemainder) return remainder_join(p.bits, m);
  else if constexpr (MODE == kRemainder8) return remainder8_join(p.bits, m);
  else return to_f32(p);
}

// `index` is the element's logical position in its tensor, `stream` the tensor's sr_stream: the
// stochastic-rounding stream.
template <typename T, int MODE>
MPF_HD void store_weight(float w, T& p, master_t<MODE>& m, uint64_t seed, uint64_t stream,
                         int64_t index) {
  if constexpr (MODE == kFp32Master) {
    m = w;
    p = from_f32<T>(w);
  } else if constexpr (MODE == kRemainder) {
    remainder_split(w, p.bits, m);
  } else if constexpr (MODE == kRemainder8) {
    remainder8_split(w, p.bits, m);
  } else if constexpr (MODE == kStochastic) {
    p.bits = bf16_bits_stochastic(w, random16(seed, stream, uint64_t(index)));
  } else {
    p = from_f32<T>(w);
  }
}

// The same on arrays: element i of param p and masters `mst` (null for a mode without masters).
template <typename T, int MODE>
MPF_HD float load_weight(const T* p, const master_t<MODE>* mst, int64_t i) {
  if constexpr (MasterStore<MODE>::kStored) return load_weight<T, MODE>(p[i], mst[i]);
  else return load_weight<T, MODE>(p[i], master_t<MODE>{});
}

template <typename T, int MODE>
MPF_HD void store_weight(float w, T* p, master_t<MODE>* mst, int64_t i, uint64_t seed,
                         uint64_t stream, int64_t index) {
  if constexpr (MasterStore<MODE>::kStored) {
    store_weight<T, MODE>(w, p[i], mst[i], seed, stream, index);
  } else {
    master_t<MODE> unused{};
    store_weight<T, MODE>(w, p[i], unused, seed, stream, index);
  }
}

}  // namespace mpfused

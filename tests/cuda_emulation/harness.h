// Test helpers shared by the emulated-CUDA programs in this directory: failure counting, element
// access by dtype code, and buffers with guard bytes around them. The guards hold a canary (a
// stray write shows as a changed byte) and, under -fsanitize=address, are poisoned (a stray read
// or write is reported where it happens, as compute-sanitizer's memcheck would on a GPU).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mpfused/adam_math.h"  // MasterMode
#include "mpfused/dtype.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define MPF_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define MPF_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define MPF_POISON(p, n) ((void)(p), (void)(n))
#define MPF_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace emu_test {

inline long failures = 0;

#define EXPECT(cond, ...)                                           \
  do {                                                              \
    if (!(cond) && ++emu_test::failures < 30) {                     \
      std::printf("FAIL line %d: %s: ", __LINE__, #cond);           \
      std::printf(__VA_ARGS__);                                     \
      std::printf("\n");                                            \
    }                                                               \
  } while (0)

// The run's seed: argv[i] when given, else 1. It seeds the test data and the emulation.
inline uint64_t seed_from(int argc, char** argv, int i) {
  const uint64_t s = argc > i ? std::strtoull(argv[i], nullptr, 10) : 1;
  std::printf("seed %llu\n", (unsigned long long)s);
  return s;
}

inline int report(size_t cases) {
  std::printf("%zu cases\n", cases);
  if (failures) {
    std::printf("%ld failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}

// Hyperparameters of every Adam case here (the CPU kernel gets the same).
constexpr double kBeta1 = 0.9, kBeta2 = 0.999, kWeightDecay = 0.01;
constexpr float kEps = 1e-8f;
constexpr uint64_t kSeed = 1234;

// The stochastic-rounding stream of tensor i of a case: param ids and shard offsets other than
// the position, as the optimizers pass them.
inline uint64_t test_stream(int64_t i) { return mpfused::sr_stream(uint64_t(7 + 3 * i), uint64_t(1000 * i)); }

// The device scalars of a case (host floats stand in for them): cuda::StepCommon's fields, which
// cuda::Adam8bitConfig has too.
struct AdamScalarsIn {
  float* lr;
  float* grad_scale;
  float* found_inf;
  float* norm_sq;
  double max_grad_norm;
};
template <typename Common, typename Case>
void fill_step_common(Common& c, const Case& k, const AdamScalarsIn& in) {
  c.lr = k.lr_ptr ? 0.0 : double(*in.lr);
  c.lr_ptr = k.lr_ptr ? in.lr : nullptr;
  c.grad_scale = k.grad_scale ? in.grad_scale : nullptr;
  c.found_inf = k.has_found ? in.found_inf : nullptr;
  c.norm_sq = k.clip ? in.norm_sq : nullptr;
  c.max_grad_norm = in.max_grad_norm;
  c.maximize = k.maximize;
  c.master_mode = k.mode;
  c.seed = kSeed;
}

// Adam's hyperparameters, the same in cuda::AdamConfig and cuda::Adam8bitConfig.
template <typename Config, typename Case>
void fill_adam_hyperparameters(Config& cfg, const Case& k) {
  cfg.beta1 = kBeta1;
  cfg.beta2 = kBeta2;
  cfg.eps = kEps;
  cfg.weight_decay = kWeightDecay;
  cfg.decoupled = k.decoupled;
}

// cuda::Adam8bitConfig, whose scalars are its own fields (cuda::AdamConfig has them in `common`).
template <typename Config, typename Case>
void fill_adam_config(Config& cfg, const Case& k, const AdamScalarsIn& in) {
  fill_step_common(cfg, k, in);
  fill_adam_hyperparameters(cfg, k);
}

constexpr size_t kGuard = 64;  // guard bytes on each side of every buffer
constexpr unsigned char kCanary = 0xA5;

// `bytes` of payload at mem[off], off = kGuard + misalign; everything else is guard.
struct Buf {
  std::vector<unsigned char> mem;
  size_t off = 0, bytes = 0;

  Buf() = default;
  Buf(const Buf& o) : mem(), off(o.off), bytes(o.bytes) {
    o.open();
    mem = o.mem;
    o.close();
    close();
  }
  Buf& operator=(const Buf& o) {
    if (this != &o) {
      open();
      o.open();
      mem = o.mem;
      off = o.off;
      bytes = o.bytes;
      o.close();
      close();
    }
    return *this;
  }
  ~Buf() { open(); }

  void init(size_t nbytes, size_t misalign) {
    open();
    bytes = nbytes;
    off = kGuard + misalign;
    mem.assign(nbytes + 2 * kGuard + 64, kCanary);
    close();
  }
  void* ptr() { return bytes ? mem.data() + off : nullptr; }
  template <typename T>
  T* as() { return static_cast<T*>(ptr()); }
  // Guards readable (for copies and comparisons) / poisoned again.
  void open() const { MPF_UNPOISON(mem.data(), mem.size()); }
  void close() const {
    if (mem.empty()) return;
    MPF_POISON(mem.data(), off);
    MPF_POISON(mem.data() + off + bytes, mem.size() - off - bytes);
  }
};

// Misaligned cases: operand `tensor % (operands + 1)` of a tensor is one element past aligned
// (none when that is `operands`), so each alignment condition of a vector path is the only one
// failing for some tensor. Returns operand -> misalignment in elements.
inline auto one_operand_misaligned(bool on, int64_t tensor, int operands) {
  return [=](int operand) -> size_t { return on && int(tensor % (operands + 1)) == operand ? 1 : 0; };
}

// Bytes per element of the master operand the Adam kernels keep for a master mode and param
// dtype: 4 (fp32 master of a 16-bit param), 2 (int16 remainder of a bf16 param) or 0 (none).
inline size_t master_bytes(int mode, int dtype) {
  if (mode == mpfused::kFp32Master && dtype != mpfused::kFloat32) return 4;
  if (mode == mpfused::kRemainder && dtype == mpfused::kBFloat16) return 2;
  if (mode == mpfused::kRemainder8 && dtype == mpfused::kBFloat16) return 1;
  return 0;
}

inline size_t elem_size(int dt) { return dt == mpfused::kFloat32 ? 4 : 2; }

inline void put(Buf& b, int dt, int64_t i, float x) {
  unsigned char* q = static_cast<unsigned char*>(b.ptr());
  if (dt == mpfused::kFloat32) {
    std::memcpy(q + 4 * i, &x, 4);
  } else {
    const uint16_t h = dt == mpfused::kFloat16 ? mpfused::f16_bits_rne(x) : mpfused::bf16_bits_rne(x);
    std::memcpy(q + 2 * i, &h, 2);
  }
}

inline float get(Buf& b, int dt, int64_t i) {
  const unsigned char* q = static_cast<unsigned char*>(b.ptr());
  if (dt == mpfused::kFloat32) {
    float x;
    std::memcpy(&x, q + 4 * i, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, q + 2 * i, 2);
  return dt == mpfused::kFloat16 ? mpfused::to_f32(mpfused::f16_t{h}) : mpfused::to_f32(mpfused::bf16_t{h});
}

// The +0 code of a map (-1 if none).
inline int plus_zero_code(const float* m, int ncodes) {
  int zc = -1;
  for (int j = 0; j < ncodes; ++j)
    if (m[j] == 0.f && !std::signbit(m[j])) zc = j;
  return zc;
}

// Code c of element j of a state of `bits`-bit codes (4-bit: the nibble, the rest of the byte
// kept).
inline void put_code(Buf& b, int bits, int64_t j, int c) {
  uint8_t* q = static_cast<uint8_t*>(b.ptr());
  if (bits == 8) {
    q[j] = uint8_t(c);
  } else {
    const int sh = (j & 1) ? 0 : 4;
    q[j >> 1] = uint8_t((q[j >> 1] & ~(0xF << sh)) | ((c & 0xF) << sh));
  }
}

// Byte-for-byte, guards included. NaN payloads compare as bits.
inline void expect_same_bytes(const Buf& got, const Buf& exp, const char* what, const char* name,
                              size_t tensor) {
  got.open();
  exp.open();
  size_t first = got.mem.size(), count = 0;
  EXPECT(got.mem.size() == exp.mem.size(), "%s: tensor %zu %s: buffer sizes differ", what, tensor, name);
  for (size_t j = 0; j < got.mem.size() && j < exp.mem.size(); ++j)
    if (got.mem[j] != exp.mem[j]) {
      ++count;
      first = std::min(first, j);
    }
  EXPECT(count == 0, "%s: tensor %zu %s: %zu bytes differ, first at byte %lld of the payload", what,
         tensor, name, count, (long long)first - (long long)got.off);
  got.close();
  exp.close();
}

}  // namespace emu_test

// The CUDA one-state entry points (cuda::sgd8bit_step / lion8bit_step: sgd8bit_cuda.cu,
// lion8bit_cuda.cu on one_state8bit_cuda.cuh, prepare and main launches), run whole on the host
// through the CUDA emulation and compared byte for byte, guard bytes included, with the CPU
// kernels cpu::sgd8bit_step / cpu::lion8bit_step, for one code width per run (8: sgd8bit_step_ /
// lion8bit_step_; 4: sgd4bit_step_ / lion4bit_step_, packed codes and a 16-entry map): every
// dtype x master mode, block sizes 64..4096, SGD momentum / dampening / Nesterov / weight decay /
// maximize and its first step (step counter 0: the buffer is the gradient), Lion, grad_scale,
// clipping, a device lr, odd sizes and tails, misaligned (scalar-path) operands, launches that
// end mid-tensor, many tensors, empty ones, found_inf skips, NaN / inf gradients (NaN states: a
// NaN absmax), bad maps (4-bit: only an unsorted map is bad, one without +0 runs) and bad
// arguments (block sizes, workspaces, code widths). The workspace starts as 0xFF bytes: a block
// reading an entry the prepare did not write would change the bytes; on a skipped step it must
// still be all 0xFF.
//
// usage: one_state8bit_vs_cpu maps.bin [seed [bits]]   (maps.bin: 544 float32: the 8-bit signed
// and unsigned maps (256 each), then the 4-bit signed and unsigned maps (16 each); bits: 8 or 4,
// default 8)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../cpu/one_state8bit_cpu.h"
#include "harness.h"
#include "mpfused/quant8_math.h"  // kQuant4Codes
#include "multi_tensor_apply.cuh"  // kMaxBlocksPerLaunch
#include "one_state8bit_cuda.h"

using namespace mpfused;
using namespace mpfused::cuda;
using emu_test::Buf;
using emu_test::elem_size;
using emu_test::expect_same_bytes;
using emu_test::plus_zero_code;
using emu_test::put;
using emu_test::put_code;

namespace {

struct Tensor {
  int64_t n = 0;
  int dtype = kFloat32;
  Buf p, g, c, master, a, step;
};

struct Case {
  const char* name;
  std::vector<int64_t> sizes;
  bool lion;
  int mode;
  int block;
  double momentum = 0.9, dampening = 0.0, weight_decay = 0.0;  // SGD (weight_decay: both)
  bool nesterov = false;
  bool misalign = false;
  bool grad_scale = false, clip = false, lr_ptr = false, maximize = false;
  bool has_found = false;
  float found = 0.f;
  int bad_map = 0;  // 1 unsorted, 2 no +0 (sorted), 3 the unsigned map (8-bit: +0 at index 0)
  int64_t max_blocks = kMaxBlocksPerLaunch;
  bool zero_state = false;  // absmax 0
  bool nonfinite = false;   // NaN / +-inf gradients in some elements (NaN states, NaN absmax)
  int bits = 8;             // code width: 8 or 4 (two codes per byte, 16-entry map)
};

// The maps of one code width: 8-bit 256 entries each, 4-bit the first 16 (the rest NaN, unused).
struct Maps {
  float m[256], u[256];  // the signed map (the state's), the unsigned one (a bad map)
  int ncodes = 256;
};

constexpr double kLionBeta1 = 0.9, kLionBeta2 = 0.99;

void run_case(const Case& k, const Maps& maps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> unif(1e-4f, 1e-2f);
  const int B = k.block;
  const int ncodes = maps.ncodes;
  const int zc_init = plus_zero_code(maps.m, ncodes);  // the good map's +0 code (both widths)
  auto code_bytes = [&](int64_t n) { return k.bits == 4 ? (n + 1) / 2 : n; };
  const std::string label = std::string(k.bits == 4 ? "4-bit: " : "8-bit: ") + k.name;
  const char* const name = label.c_str();
  std::vector<Tensor> ts(k.sizes.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor& t = ts[i];
    t.n = k.sizes[i];
    t.dtype = int(i % 3);
    const size_t es = elem_size(t.dtype);
    const auto mis = emu_test::one_operand_misaligned(k.misalign, int64_t(i), 4);
    t.p.init(t.n * es, mis(0) * es);
    t.g.init(t.n * es, mis(1) * es);
    t.c.init(code_bytes(t.n), mis(2));
    // random bytes (4-bit: an odd size's padding nibble too: both kernels write it 0)
    for (int64_t j = 0; j < code_bytes(t.n); ++j)
      static_cast<uint8_t*>(t.c.ptr())[j] = uint8_t(byte(rng));
    const int64_t nb = (t.n + B - 1) / B;
    t.a.init(nb * 4, 0);
    t.step.init(4, 0);
    const size_t mb = emu_test::master_bytes(k.mode, t.dtype);
    if (mb) t.master.init(t.n * mb, mis(3) * mb);
    for (int64_t j = 0; j < t.n; ++j) {
      const float w = normal(rng) * 0.5f;
      put(t.p, t.dtype, j, w);
      // Every 7th element: state 0 and a tiny gradient, so the new state rounds to the +0 code
      // (bitsandbytes' sign rule, 8-bit: a negative one is stored one code below). Every 101st:
      // a zero gradient (Lion: sign(0) moves nothing).
      const bool tiny = j % 7 == 3;
      const float gs = j % 101 == 50 ? 0.f : (tiny ? 1e-6f : 1.f) * (k.grad_scale ? 1024.f : 1.f);
      put(t.g, t.dtype, j, normal(rng) * gs);
      if (k.nonfinite && j % 331 == 17)  // NaN, +inf, -inf in turn: NaN states and absmax
        put(t.g, t.dtype, j, (j / 331) % 3 == 0 ? NAN : ((j / 331) % 3 == 1 ? INFINITY : -INFINITY));
      if (k.zero_state || tiny) put_code(t.c, k.bits, j, zc_init);
      if (mb == 4) {
        const float m = w + normal(rng) * 1e-4f;
        std::memcpy(static_cast<float*>(t.master.ptr()) + j, &m, 4);
      }
      if (mb == 2) static_cast<int16_t*>(t.master.ptr())[j] = int16_t(byte(rng) * 256 + byte(rng));
      if (mb == 1) static_cast<int8_t*>(t.master.ptr())[j] = int8_t(byte(rng));
    }
    for (int64_t j = 0; j < nb; ++j)
      static_cast<float*>(t.a.ptr())[j] = k.zero_state ? 0.f : unif(rng) * 10.f;
    *static_cast<float*>(t.step.ptr()) = float((3 * i) % 7);  // tensor 0: the first step
  }
  float mp[256];
  std::memcpy(mp, maps.m, sizeof mp);
  if (k.bad_map == 1) std::swap(mp[ncodes / 2 - 3], mp[ncodes / 2 - 2]);
  if (k.bad_map == 2) mp[zc_init] = 0.5f * mp[zc_init + 1];
  if (k.bad_map == 3) std::memcpy(mp, maps.u, sizeof mp);
  // As the binding's map tensor: exactly ncodes floats (ASan: no read past them), both kernels.
  Buf qmap;
  qmap.init(size_t(ncodes) * 4, 0);
  std::memcpy(qmap.ptr(), mp, size_t(ncodes) * 4);
  float grad_scale = 1024.f, found = k.found, lr = 1e-3f;
  float norm_sq = 0.f;
  for (auto& t : ts)
    for (int64_t j = 0; j < t.n; ++j) {
      const float x = emu_test::get(t.g, t.dtype, j) / (k.grad_scale ? grad_scale : 1.f);
      norm_sq += x * x;
    }
  const double max_grad_norm = k.clip ? 0.3 * std::sqrt(double(norm_sq)) : 0.0;

  // Packed lists (empty tensors dropped, as PackedLists does).
  std::vector<Tensor> ref = ts;  // the CPU kernel runs on a copy
  auto pack = [&](std::vector<Tensor>& v, int depth, std::vector<std::vector<void*>>& ptrs,
                  std::vector<int64_t>& numel, std::vector<int32_t>& dtype,
                  std::vector<double>& steps, std::vector<uint64_t>& streams) {
    ptrs.assign(depth, {});
    for (size_t i = 0; i < v.size(); ++i) {
      Tensor& t = v[i];
      if (t.n == 0) continue;
      Buf* ops[6] = {&t.p, &t.g, &t.c, &t.master, &t.a, &t.step};
      for (int d = 0; d < depth && d < 6; ++d) ptrs[d].push_back(ops[d]->ptr());
      streams.push_back(emu_test::test_stream(int64_t(i)));
      if (depth > kS8Stream) ptrs[kS8Stream].push_back(reinterpret_cast<void*>(streams.back()));
      numel.push_back(t.n);
      dtype.push_back(t.dtype);
      steps.push_back(double(*static_cast<float*>(t.step.ptr())) + 1.0);
    }
  };
  std::vector<std::vector<void*>> gp, cp;
  std::vector<int64_t> gn, cn;
  std::vector<int32_t> gd, cd;
  std::vector<double> gs, cs;
  std::vector<uint64_t> gk, ck;
  pack(ts, kOneState8bitDepth, gp, gn, gd, gs, gk);
  pack(ref, 5, cp, cn, cd, cs, ck);

  // Expected: the CPU kernel with the binding's host-side decisions (a map the CPU binding would
  // refuse poisons absmax on CUDA; 4-bit maps need no +0: no sign rule).
  const int zc = k.bits == 8 ? plus_zero_code(mp, ncodes) : -1;
  bool sorted = true;
  for (int j = 0; j + 1 < ncodes; ++j) sorted = sorted && mp[j] < mp[j + 1];
  const bool bad = !sorted || (k.bits == 8 && zc <= 0);
  const bool skip = k.has_found && k.found > 0.f;
  if (!bad && !skip && !cn.empty()) {
    float gm = k.grad_scale ? 1.f / grad_scale : 1.f;
    if (k.clip && max_grad_norm > 0)
      gm *= float(std::min(1.0, max_grad_norm / (std::sqrt(double(norm_sq)) + 1e-6)));
    TensorLists<5> L{};
    for (int d = 0; d < 5; ++d) L.data[d] = cp[d].data();
    L.numel = cn.data();
    L.dtype = cd.data();
    L.size = int64_t(cn.size());
    const cpu::State8bitConfig q{lr, k.weight_decay, gm, k.maximize, k.mode, emu_test::kSeed,
                                 ck.data(), B, qmap.as<float>(), zc, k.bits};
    if (k.lion) cpu::lion8bit_step(L, cs.data(), cpu::Lion8bitConfig{q, kLionBeta1, kLionBeta2}, 1);
    else cpu::sgd8bit_step(L, cs.data(), cpu::Sgd8bitConfig{q, k.momentum, k.dampening, k.nesterov}, 1);
  }
  if (bad && !skip)
    for (auto& t : ref)
      for (int64_t j = 0; j < (t.n + B - 1) / B; ++j) static_cast<float*>(t.a.ptr())[j] = NAN;

  // The emulated CUDA call.
  if (!gn.empty()) {
    TensorLists<kOneState8bitDepth> L{};
    for (int d = 0; d < kOneState8bitDepth; ++d) L.data[d] = gp[d].data();
    L.numel = gn.data();
    L.dtype = gd.data();
    L.size = int64_t(gn.size());
    State8bitCommon q{};
    emu_test::fill_step_common(q.common, k, {&lr, &grad_scale, &found, &norm_sq, max_grad_norm});
    q.block_size = B;
    q.map = qmap.as<float>();
    q.code_bits = k.bits;
    Buf ws;
    ws.init(k.lion ? lion8bit_workspace_bytes(L.size) : sgd8bit_workspace_bytes(L.size), 0);
    std::memset(ws.ptr(), 0xFF, ws.bytes);
    // Launches of at most k.max_blocks blocks: with small limits they end mid-tensor.
    mpf_emulation::max_blocks_per_launch = k.max_blocks;
    const cudaError_t err =
        k.lion ? lion8bit_step(L, Lion8bitConfig{q, kLionBeta1, kLionBeta2, k.weight_decay},
                               ws.ptr(), nullptr)
               : sgd8bit_step(L, Sgd8bitConfig{q, k.momentum, k.dampening, k.weight_decay,
                                               k.nesterov},
                              ws.ptr(), nullptr);
    mpf_emulation::max_blocks_per_launch = kMaxBlocksPerLaunch;
    EXPECT(err == cudaSuccess, "%s: step returned %d", name, int(err));
    EXPECT(cudaGetLastError() == cudaSuccess, "%s: error left behind", name);
    if (skip) {
      Buf untouched = ws;
      std::memset(untouched.ptr(), 0xFF, untouched.bytes);
      expect_same_bytes(ws, untouched, name, "workspace", 0);
    } else if (!bad) {  // every word written, padding included (a bad map: zero_code -1)
      size_t unwritten = 0;
      for (size_t j = 0; j + 4 <= ws.bytes; j += 4) {
        uint32_t w;
        std::memcpy(&w, static_cast<char*>(ws.ptr()) + j, 4);
        unwritten += w == 0xFFFFFFFFu;
      }
      EXPECT(unwritten == 0, "%s: %zu workspace words never written", name, unwritten);
    }
  }

  // Byte for byte, guards included (a NaN absmax compares as bits).
  static const char* names[6] = {"param", "grad", "codes", "master", "absmax", "step"};
  for (size_t i = 0; i < ts.size(); ++i) {
    const Buf* got[6] = {&ts[i].p, &ts[i].g, &ts[i].c, &ts[i].master, &ts[i].a, &ts[i].step};
    const Buf* exp[6] = {&ref[i].p, &ref[i].g, &ref[i].c, &ref[i].master, &ref[i].a, &ref[i].step};
    for (int d = 0; d < 6; ++d) expect_same_bytes(*got[d], *exp[d], name, names[d], i);
  }
}

// A block size or code width the kernels do not serve, or a null or misaligned workspace, is
// refused before anything runs (bits: the run's code width, that of the other bad arguments).
size_t run_bad_arguments(const float* map, int bits) {
  float p = 1.f, g = 1.f, a = 0.f, step = 0.f;
  uint8_t c = 127;
  void* ops[6] = {&p, &g, &c, nullptr, &a, &step};
  void* const* data[6];
  for (int d = 0; d < 6; ++d) data[d] = &ops[d];
  void* stream_op = nullptr;
  const int64_t numel = 1;
  const int32_t dtype = kFloat32;
  TensorLists<kOneState8bitDepth> L{};
  for (int d = 0; d < 6; ++d) L.data[d] = data[d];
  L.data[kS8Stream] = &stream_op;
  L.numel = &numel;
  L.dtype = &dtype;
  L.size = 1;
  Buf ws;
  ws.init(lion8bit_workspace_bytes(1) + 16, 0);
  char* const base = static_cast<char*>(ws.ptr());
  size_t cases = 0;
  // (block size, workspace, code width): bad sizes with a good workspace, a good size with bad
  // ones, then bad widths.
  struct Bad {
    int64_t b;
    void* w;
    int32_t bits;
  };
  const Bad bad[] = {{0, base, bits},   {32, base, bits},     {100, base, bits},
                     {8192, base, bits}, {-256, base, bits},  {256, nullptr, bits},
                     {256, base + 8, bits}, {256, base, 0},   {256, base, 2},
                     {256, base, 16},   {256, base, -4}};
  for (const auto& [b, w, cb] : bad)
    for (bool lion : {false, true}) {
      State8bitCommon q{};
      q.common.lr = 1e-3;
      q.block_size = b;
      q.map = map;
      q.code_bits = cb;
      const int64_t launches = mpf_emulation::launch_state.launches;
      const cudaError_t err = lion ? lion8bit_step(L, Lion8bitConfig{q, 0.9, 0.99, 0.0}, w, nullptr)
                                   : sgd8bit_step(L, Sgd8bitConfig{q, 0.9, 0.0, 0.0, false}, w, nullptr);
      EXPECT(err == cudaErrorInvalidValue,
             "%s: block size %lld, workspace %p, %d-bit codes accepted", lion ? "lion" : "sgd",
             (long long)b, w, int(cb));
      EXPECT(mpf_emulation::launch_state.launches == launches && p == 1.f && c == 127,
             "block size %lld, workspace %p, %d-bit codes: something ran", (long long)b, w,
             int(cb));
      ++cases;
    }
  return cases;
}

// The algorithm variants every (mode, block) case runs.
void add_variants(std::vector<Case>& v, Case c, int variant) {
  switch (variant % 4) {
    case 0: c.name = "sgd momentum"; break;
    case 1:
      c.name = "sgd nesterov, weight decay, maximize";
      c.nesterov = true;
      c.weight_decay = 0.01;
      c.maximize = true;
      break;
    case 2:
      c.name = "sgd dampening, weight decay";
      c.momentum = 0.5;
      c.dampening = 0.3;
      c.weight_decay = 0.02;
      break;
    default:
      c.name = "lion, weight decay";
      c.lion = true;
      c.weight_decay = 0.1;
      c.maximize = c.block == 64;
      break;
  }
  v.push_back(c);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: %s maps.bin [seed]\n", argv[0]);
    return 2;
  }
  const int bits = argc > 3 ? std::atoi(argv[3]) : 8;
  if (bits != 8 && bits != 4) {
    std::printf("bits must be 8 or 4, got %s\n", argv[3]);
    return 2;
  }
  Maps maps8, maps4;
  maps4.ncodes = kQuant4Codes;
  std::fill(maps4.m, maps4.m + 256, NAN);  // entries past 16: never read
  std::fill(maps4.u, maps4.u + 256, NAN);
  FILE* f = std::fopen(argv[1], "rb");
  const bool ok = f && std::fread(maps8.m, sizeof(float), 256, f) == 256 &&
                  std::fread(maps8.u, sizeof(float), 256, f) == 256 &&
                  std::fread(maps4.m, sizeof(float), 16, f) == 16 &&
                  std::fread(maps4.u, sizeof(float), 16, f) == 16;
  if (f) std::fclose(f);
  if (!ok) {
    std::printf("cannot read 544 floats from %s\n", argv[1]);
    return 2;
  }
  const Maps& maps = bits == 4 ? maps4 : maps8;
  // Each tensor list holds all three dtypes (tensor i: dtype i % 3). Small enough for the
  // sanitizer builds to stay fast: every block is 512 emulated threads.
  const std::vector<int64_t> sizes = {1, 3, 64, 65, 255, 0, 4095, 4097, 13, 2048 + 4};
  std::vector<Case> cases;
  int variant = 0;
  for (int mode : {kNoMaster, kFp32Master, kRemainder, kStochastic, kRemainder8})
    for (int block : {64, 128, 256, 1024, 4096}) {  // 5 blocks: each mode sees all 4 variants
      Case c{"", sizes, false, mode, block};
      c.misalign = block == 256 || block == 64;
      c.grad_scale = mode != kNoMaster;
      c.clip = mode == kFp32Master || block == 1024;
      c.lr_ptr = mode == kRemainder;
      add_variants(cases, c, variant++);
    }
  for (bool lion : {false, true}) {
    // Two blocks per launch: the main launches end mid-tensor, the prepare launches after two
    // tensors (the second one without the map).
    Case c{"512 / 2048 blocks, launch split", {5000, 12288, 3, 9000}, lion, kFp32Master, 512};
    c.max_blocks = 2;
    cases.push_back(c);
    c.block = 2048;
    c.misalign = true;
    cases.push_back(c);
    // 119 non-empty: three main launches at 4 KB. (The 32 KB prepare table, > 448 tensors, is
    // the same template code as adam8bit_vs_cpu's, which runs it.)
    std::vector<int64_t> many;
    for (int i = 0; i < 120; ++i) many.push_back((i * 37) % 300);
    if (!lion) cases.push_back(Case{"120 small tensors (several launches)", many, lion, kStochastic, 128});
    Case z{"first step (absmax 0)", sizes, lion, kFp32Master, 256};
    z.zero_state = true;
    cases.push_back(z);
    Case r{"found_inf = 0 runs", sizes, lion, kRemainder, 256};
    r.has_found = r.grad_scale = true;
    cases.push_back(r);
    for (float fi : {1.f, INFINITY, NAN}) {
      Case s{"found_inf > 0 skips", sizes, lion, kFp32Master, 256};
      s.misalign = s.grad_scale = s.clip = s.has_found = true;
      s.found = fi;
      if (std::isnan(fi)) s.name = "found_inf NaN runs (NaN > 0 is false)";
      cases.push_back(s);
    }
    for (int mode : {kNoMaster, kStochastic}) {
      Case nf{"NaN / inf gradients", sizes, lion, mode, 128};
      nf.nonfinite = nf.misalign = true;
      cases.push_back(nf);
    }
    for (int bad : {1, 2, 3}) {
      // 8-bit: unsorted, no +0, +0 at index 0: each poisons absmax. 4-bit: only the unsorted map
      // does (no sign rule: a map without +0 is used as it is).
      Case b{bits == 4 && bad > 1 ? "4-bit map without +0 runs" : "bad map poisons absmax", sizes,
             lion, kFp32Master, 256};
      b.bad_map = bad;
      cases.push_back(b);
    }
  }
  for (Case& c : cases) c.bits = bits;
  uint64_t seed = emu_test::seed_from(argc, argv, 2);
  mpf_emulation::seed(seed);
  seed *= 1000;
  size_t sgd = 0, lion = 0;
  for (size_t i = 0; i < cases.size(); ++i) {  // 4 KB and 32 KB kernel parameters in turn
    mpf_emulation::large_kernel_params = i % 2 == 1;
    run_case(cases[i], maps, seed++);
    (cases[i].lion ? lion : sgd) += 1;
  }
  const size_t bad_args = run_bad_arguments(maps.m, bits);
  std::printf("sgd%dbit cases %zu, lion%dbit cases %zu, bad-argument cases %zu\n", bits, sgd, bits,
              lion, bad_args);
  std::printf("emulated launches %lld, blocks %lld\n", (long long)mpf_emulation::launch_state.launches,
              (long long)mpf_emulation::launch_state.blocks);
  return emu_test::report(cases.size() + bad_args);
}

// The CUDA 8-bit Adam entry point (cuda::adam8bit_step, adam8bit_cuda.cu), run whole on the host
// through the CUDA emulation (cuda_runtime.h here: multi_tensor_apply's packing and launches,
// every block as 512 cooperative threads with real barrier and warp-shuffle semantics, blocks in
// a shuffled order) and compared byte for byte, guard bytes included, with the CPU kernel
// cpu::adam8bit_step, for both code widths (8-bit codes: adam8bit_step_; 4-bit packed codes with
// 16-entry maps: adam4bit_step_): every master mode and dtype, block sizes 64..4096, odd sizes and
// tails, misaligned (scalar-path) tensors, launches that end mid-tensor, unscale / clip / device
// lr / maximize / L2, found_inf skips, NaN / inf grads and absmax, bad maps (4-bit: only an
// unsorted map is bad, one without +0 runs), bad block sizes and code widths.
// The per-step workspace starts as 0xFF bytes (NaN scalars and thresholds), so a block that read
// an entry the prepare launch did not write would change the bytes; on a skipped step it must
// still be 0xFF (the prepare writes nothing either).
//
// usage: adam8bit_vs_cpu maps.bin [seed]   (maps.bin: 544 float32: the 8-bit signed map, the 8-bit
// unsigned map (256 each), then the 4-bit signed and unsigned maps (16 each))
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../cpu/adam8bit_cpu.h"
#include "adam8bit_cuda.h"
#include "harness.h"
#include "mpfused/quant8_math.h"  // kQuant4Codes
#include "multi_tensor_apply.cuh"  // kMaxBlocksPerLaunch

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
  Buf p, g, c1, c2, master, a1, a2, step;
};

struct Case {
  const char* name;
  std::vector<int64_t> sizes;
  int mode;
  int block;
  int bits = 8;                // code width: 8 or 4 (two codes per byte, 16-entry maps)
  bool misalign = false;
  bool grad_scale = false, clip = false, lr_ptr = false, maximize = false, decoupled = true;
  bool has_found = false;
  float found = 0.f;
  int bad_map = 0;             // 1 unsorted, 2 no +0 (sorted), 3 +0 at index 0
  int64_t max_blocks = kMaxBlocksPerLaunch;
  bool zero_state = false;     // absmax 0 (first step)
  bool nonfinite = false;      // NaN / inf / huge grads and a NaN / inf old absmax
};

// The maps of one code width: 8-bit 256 entries each, 4-bit the first 16 (the rest unused).
struct Maps {
  float m1[256], m2[256];
  int ncodes = 256;
};

void run_case(const Case& k, const Maps& maps8, const Maps& maps4, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> unif(1e-4f, 1e-2f);
  const int B = k.block;
  const Maps& maps = k.bits == 4 ? maps4 : maps8;
  const int ncodes = maps.ncodes;
  const int zc_init = plus_zero_code(maps.m1, ncodes);  // the good map's +0 code (both widths)
  auto code_bytes = [&](int64_t n) { return k.bits == 4 ? (n + 1) / 2 : n; };
  const std::string label = std::string(k.bits == 4 ? "4-bit: " : "8-bit: ") + k.name;
  const char* const name = label.c_str();
  std::vector<Tensor> ts(k.sizes.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor& t = ts[i];
    t.n = k.sizes[i];
    t.dtype = int(i % 3);
    const size_t es = elem_size(t.dtype);
    const auto mis = emu_test::one_operand_misaligned(k.misalign, int64_t(i), 5);
    t.p.init(t.n * es, mis(0) * es);
    t.g.init(t.n * es, mis(1) * es);
    t.c1.init(code_bytes(t.n), mis(2));
    t.c2.init(code_bytes(t.n), mis(3));
    // random bytes (4-bit: an odd size's padding nibble too: both kernels write it 0)
    for (int64_t j = 0; j < code_bytes(t.n); ++j) {
      static_cast<uint8_t*>(t.c1.ptr())[j] = uint8_t(byte(rng));
      static_cast<uint8_t*>(t.c2.ptr())[j] = uint8_t(byte(rng));
    }
    const int64_t nb = (t.n + B - 1) / B;
    t.a1.init(nb * 4, 0);
    t.a2.init(nb * 4, 0);
    t.step.init(4, 0);
    const size_t mb = emu_test::master_bytes(k.mode, t.dtype);
    if (mb) t.master.init(t.n * mb, mis(4) * mb);
    const bool fp32_master = mb == 4, remainder = mb == 2;
    for (int64_t j = 0; j < t.n; ++j) {
      const float w = normal(rng) * 0.5f;
      put(t.p, t.dtype, j, w);
      // Every 7th element: m_old = 0 and a tiny gradient, so the new m rounds to the +0 code
      // (bitsandbytes' sign rule, 8-bit: a negative one is stored one code below).
      const bool tiny = j % 7 == 3;
      float gj = normal(rng) * (tiny ? 1e-6f : 1.f) * (k.grad_scale ? 1024.f : 1.f);
      if (k.nonfinite && j % 97 == 5) {  // NaN, +-inf, and a value whose square overflows
        const float bad[4] = {NAN, INFINITY, -INFINITY, 3e38f};
        gj = bad[(j / 97) % 4];
      }
      put(t.g, t.dtype, j, gj);
      if (k.zero_state || tiny) put_code(t.c1, k.bits, j, zc_init);
      if (k.zero_state) put_code(t.c2, k.bits, j, 0);
      if (fp32_master) {
        const float m = w + normal(rng) * 1e-4f;
        std::memcpy(static_cast<float*>(t.master.ptr()) + j, &m, 4);
      }
      if (remainder) static_cast<int16_t*>(t.master.ptr())[j] = int16_t(byte(rng) * 256 + byte(rng));
      if (mb == 1) static_cast<int8_t*>(t.master.ptr())[j] = int8_t(byte(rng));
    }
    for (int64_t j = 0; j < nb; ++j) {
      static_cast<float*>(t.a1.ptr())[j] = k.zero_state ? 0.f : unif(rng) * 10.f;
      static_cast<float*>(t.a2.ptr())[j] = k.zero_state ? 0.f : unif(rng) * 1e-3f;
    }
    if (k.nonfinite && nb > 0) {  // an old absmax NaN (first block) / inf (last block)
      static_cast<float*>(t.a1.ptr())[0] = NAN;
      static_cast<float*>(t.a2.ptr())[nb - 1] = INFINITY;
    }
    *static_cast<float*>(t.step.ptr()) = float((3 * i) % 7);
  }
  Maps mp = maps;  // edited below; both kernels read it from guarded buffers of ncodes floats
  if (k.bad_map == 1) std::swap(mp.m1[ncodes / 2 - 3], mp.m1[ncodes / 2 - 2]);
  if (k.bad_map == 2) mp.m1[zc_init] = 0.5f * mp.m1[zc_init + 1];
  if (k.bad_map == 3) {
    for (int j = 0; j < ncodes; ++j) mp.m1[j] = mp.m2[j];
  }
  float grad_scale = 1024.f, found = k.found, lr = 1e-3f;
  float norm_sq = 0.f;
  for (auto& t : ts)
    for (int64_t j = 0; j < t.n; ++j) {
      const unsigned char* q = static_cast<unsigned char*>(t.g.ptr());
      float x;
      if (t.dtype == kFloat32) std::memcpy(&x, q + 4 * j, 4);
      else {
        uint16_t h;
        std::memcpy(&h, q + 2 * j, 2);
        x = t.dtype == kFloat16 ? to_f32(f16_t{h}) : to_f32(bf16_t{h});
      }
      x /= k.grad_scale ? grad_scale : 1.f;
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
      Buf* ops[8] = {&t.p, &t.g, &t.c1, &t.c2, &t.master, &t.a1, &t.a2, &t.step};
      for (int d = 0; d < depth && d < 8; ++d) ptrs[d].push_back(ops[d]->ptr());
      streams.push_back(emu_test::test_stream(int64_t(i)));
      if (depth > kQ8Stream) ptrs[kQ8Stream].push_back(reinterpret_cast<void*>(streams.back()));
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
  pack(ts, kAdam8bitDepth, gp, gn, gd, gs, gk);
  pack(ref, 7, cp, cn, cd, cs, ck);

  Buf qmap1, qmap2;  // as the binding's map tensors: exactly ncodes floats (ASan: no read past)
  qmap1.init(size_t(ncodes) * 4, 0);
  qmap2.init(size_t(ncodes) * 4, 0);
  std::memcpy(qmap1.ptr(), mp.m1, size_t(ncodes) * 4);
  std::memcpy(qmap2.ptr(), mp.m2, size_t(ncodes) * 4);

  // Expected: the CPU kernel with the binding's host-side decisions (a map the CPU binding would
  // refuse poisons absmax on CUDA; 4-bit maps need no +0: no sign rule).
  const int zc = k.bits == 8 ? plus_zero_code(mp.m1, ncodes) : -1;
  bool sorted = true;
  for (int j = 0; j + 1 < ncodes; ++j)
    sorted = sorted && mp.m1[j] < mp.m1[j + 1] && mp.m2[j] < mp.m2[j + 1];
  const bool bad = !sorted || (k.bits == 8 && zc <= 0);
  const bool skip = k.has_found && k.found > 0.f;
  if (!bad && !skip && !cn.empty()) {
    float gm = k.grad_scale ? 1.f / grad_scale : 1.f;
    if (k.clip && max_grad_norm > 0)
      gm *= float(std::min(1.0, max_grad_norm / (std::sqrt(double(norm_sq)) + 1e-6)));
    TensorLists<7> L{};
    for (int d = 0; d < 7; ++d) L.data[d] = cp[d].data();
    L.numel = cn.data();
    L.dtype = cd.data();
    L.size = int64_t(cn.size());
    using namespace emu_test;
    cpu::Adam8bitConfig c{lr, kBeta1, kBeta2, kEps, kWeightDecay, gm, k.maximize, k.decoupled, k.mode,
                          kSeed, ck.data(), B, qmap1.as<float>(), qmap2.as<float>(), zc, k.bits};
    cpu::adam8bit_step(L, cs.data(), c, 1);
  }
  if (bad && !skip)
    for (auto& t : ref)
      for (int64_t j = 0; j < (t.n + B - 1) / B; ++j) {
        static_cast<float*>(t.a1.ptr())[j] = NAN;
        static_cast<float*>(t.a2.ptr())[j] = NAN;
      }

  // The emulated CUDA call.
  if (!gn.empty()) {
    TensorLists<kAdam8bitDepth> L{};
    for (int d = 0; d < kAdam8bitDepth; ++d) L.data[d] = gp[d].data();
    L.numel = gn.data();
    L.dtype = gd.data();
    L.size = int64_t(gn.size());
    Adam8bitConfig cfg{};
    emu_test::fill_adam_config(cfg, k, {&lr, &grad_scale, &found, &norm_sq, max_grad_norm});
    cfg.block_size = B;
    cfg.map1 = qmap1.as<float>();
    cfg.map2 = qmap2.as<float>();
    cfg.code_bits = k.bits;
    Buf ws;
    ws.init(adam8bit_workspace_bytes(L.size), 0);
    std::memset(ws.ptr(), 0xFF, ws.bytes);
    // Launches of at most k.max_blocks blocks: with small limits they end mid-tensor.
    mpf_emulation::max_blocks_per_launch = k.max_blocks;
    const cudaError_t err = adam8bit_step(L, cfg, ws.ptr(), nullptr);
    mpf_emulation::max_blocks_per_launch = kMaxBlocksPerLaunch;
    EXPECT(err == cudaSuccess, "%s: adam8bit_step returned %d", name, int(err));
    EXPECT(cudaGetLastError() == cudaSuccess, "%s: error left behind", name);
    if (skip) {
      Buf untouched = ws;
      std::memset(untouched.ptr(), 0xFF, untouched.bytes);
      expect_same_bytes(ws, untouched, name, "workspace", 0);
    } else if (!bad) {  // every word written, padding included (initcheck on a GPU); a bad map
                        // leaves zero_code -1, all ones
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
  static const char* names[8] = {"param", "grad", "codes1", "codes2", "master", "absmax1", "absmax2", "step"};
  for (size_t i = 0; i < ts.size(); ++i) {
    const Buf* got[8] = {&ts[i].p, &ts[i].g, &ts[i].c1, &ts[i].c2, &ts[i].master, &ts[i].a1, &ts[i].a2, &ts[i].step};
    const Buf* exp[8] = {&ref[i].p, &ref[i].g, &ref[i].c1, &ref[i].c2, &ref[i].master, &ref[i].a1, &ref[i].a2, &ref[i].step};
    for (int d = 0; d < 8; ++d) expect_same_bytes(*got[d], *exp[d], name, names[d], i);
  }
}

// A block size or code width the kernel does not serve, or a null or misaligned workspace, is
// refused before anything runs.
size_t run_bad_arguments(const Maps& maps) {
  float p = 1.f, g = 1.f, a1 = 0.f, a2 = 0.f, step = 0.f;
  uint8_t c1 = 127, c2 = 0;
  void* ops[8] = {&p, &g, &c1, &c2, nullptr, &a1, &a2, &step};
  void* const* data[8];
  for (int d = 0; d < 8; ++d) data[d] = &ops[d];
  const int64_t numel = 1;
  const int32_t dtype = kFloat32;
  TensorLists<kAdam8bitDepth> L{};
  for (int d = 0; d < 8; ++d) L.data[d] = data[d];
  L.numel = &numel;
  L.dtype = &dtype;
  L.size = 1;
  Buf ws;
  ws.init(adam8bit_workspace_bytes(1) + 16, 0);
  char* const base = static_cast<char*>(ws.ptr());
  size_t cases = 0;
  // (block size, workspace, code width): bad sizes with a good workspace, a good size with bad
  // ones, then bad widths.
  struct Bad {
    int64_t b;
    void* w;
    int32_t bits;
  };
  const Bad bad[] = {{0, base, 8},     {32, base, 8},   {100, base, 4},     {8192, base, 4},
                     {-256, base, 8},  {256, nullptr, 4}, {256, base + 8, 8}, {256, base, 0},
                     {256, base, 2},   {256, base, 16}, {256, base, -4}};
  for (const auto& [b, w, bits] : bad) {
    Adam8bitConfig cfg{};
    cfg.lr = 1e-3;
    cfg.beta1 = 0.9;
    cfg.beta2 = 0.999;
    cfg.block_size = b;
    cfg.map1 = maps.m1;
    cfg.map2 = maps.m2;
    cfg.code_bits = bits;
    const int64_t launches = mpf_emulation::launch_state.launches;
    EXPECT(adam8bit_step(L, cfg, w, nullptr) == cudaErrorInvalidValue,
           "block size %lld, workspace %p, %d-bit codes accepted", (long long)b, w, int(bits));
    EXPECT(mpf_emulation::launch_state.launches == launches && p == 1.f && c1 == 127,
           "block size %lld, workspace %p, %d-bit codes: something ran", (long long)b, w, int(bits));
    ++cases;
  }
  return cases;
}

}  // namespace

// The case list of one code width.
void add_cases(std::vector<Case>& cases, int bits) {
  const std::vector<int64_t> sizes = {1, 3, 64, 65, 255, 0, 4095, 4096, 4097, 8192 + 77, 13, 2048 + 4};
  const size_t first = cases.size();
  for (int mode : {kNoMaster, kFp32Master, kRemainder, kStochastic, kRemainder8})
    for (int block : {64, 128, 256, 1024, 4096}) {
      Case c{"modes x blocks", sizes, mode, block};
      c.misalign = block == 256 || block == 64;
      c.grad_scale = mode != kNoMaster;
      c.clip = mode == kFp32Master || (mode == kRemainder8 && block == 128);
      c.lr_ptr = mode == kRemainder;
      c.maximize = block == 128;
      c.decoupled = block != 1024;
      cases.push_back(c);
    }
  {
    // Two blocks per launch: the main launches end mid-tensor, the prepare launches after two
    // tensors (the second one without the maps).
    Case c{"512 / 2048 blocks, launch split", {5000, 12288, 3, 9000}, kFp32Master, 512};
    c.max_blocks = 2;
    cases.push_back(c);
    c.block = 2048;
    c.misalign = true;
    c.mode = kRemainder8;
    cases.push_back(c);
  }
  {
    std::vector<int64_t> many;
    for (int i = 0; i < 120; ++i) many.push_back((i * 37) % 300);
    cases.push_back(Case{"120 small tensors (several launches)", many, kStochastic, 256});
    // 450 non-empty: > 381, two main launches at 32 KB; > 448, the 32 KB prepare table.
    for (int i = 120; i < 452; ++i) many.push_back((i * 37) % 300);
    cases.push_back(Case{"452 small tensors (several launches)", many, kNoMaster, 128});
  }
  {
    Case c{"first step (absmax 0)", sizes, kFp32Master, 256};
    c.zero_state = true;
    cases.push_back(c);
  }
  {
    Case c{"found_inf = 0 runs", sizes, kRemainder, 256};
    c.has_found = true;
    c.grad_scale = true;
    cases.push_back(c);
  }
  for (float fi : {1.f, INFINITY, NAN}) {
    Case c{"found_inf > 0 skips", sizes, kFp32Master, 256};
    c.misalign = c.grad_scale = c.clip = c.has_found = true;
    c.found = fi;
    if (std::isnan(fi)) c.name = "found_inf NaN runs (NaN > 0 is false)";
    cases.push_back(c);
  }
  for (int mode : {kNoMaster, kRemainder8}) {  // no found_inf: the NaN / inf reach the moments
    Case c{"NaN / inf grads and absmax", sizes, mode, 128};
    c.nonfinite = true;
    c.misalign = mode == kRemainder8;
    cases.push_back(c);
  }
  for (int bad : {1, 2, 3}) {
    // 8-bit: unsorted, no +0, +0 at index 0: each poisons absmax. 4-bit: only the unsorted map
    // does (no sign rule: a map without +0 is used as it is).
    Case c{bits == 4 && bad > 1 ? "4-bit map without +0 runs" : "bad map poisons absmax", sizes,
           kFp32Master, 256};
    c.bad_map = bad;
    cases.push_back(c);
  }
  for (size_t i = first; i < cases.size(); ++i) cases[i].bits = bits;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: %s maps.bin [seed]\n", argv[0]);
    return 2;
  }
  Maps maps8, maps4;
  maps4.ncodes = kQuant4Codes;
  std::fill(maps4.m1, maps4.m1 + 256, NAN);  // entries past 16: never read
  std::fill(maps4.m2, maps4.m2 + 256, NAN);
  FILE* f = std::fopen(argv[1], "rb");
  const bool ok = f && std::fread(maps8.m1, sizeof(float), 256, f) == 256 &&
                  std::fread(maps8.m2, sizeof(float), 256, f) == 256 &&
                  std::fread(maps4.m1, sizeof(float), 16, f) == 16 &&
                  std::fread(maps4.m2, sizeof(float), 16, f) == 16;
  if (f) std::fclose(f);
  if (!ok) {
    std::printf("cannot read 544 floats from %s\n", argv[1]);
    return 2;
  }
  std::vector<Case> cases;
  add_cases(cases, 8);
  const size_t cases8 = cases.size();
  add_cases(cases, 4);
  uint64_t seed = emu_test::seed_from(argc, argv, 2);
  mpf_emulation::seed(seed);
  seed *= 1000;
  for (size_t i = 0; i < cases.size(); ++i) {  // 4 KB and 32 KB kernel parameters in turn
    mpf_emulation::large_kernel_params = i % 2 == 1;
    run_case(cases[i], maps8, maps4, seed++);
  }
  const size_t bad_sizes = run_bad_arguments(maps8);
  std::printf("8-bit cases %zu, 4-bit cases %zu, bad-argument cases %zu\n", cases8,
              cases.size() - cases8, bad_sizes);
  std::printf("emulated launches %lld, blocks %lld\n", (long long)mpf_emulation::launch_state.launches,
              (long long)mpf_emulation::launch_state.blocks);
  return emu_test::report(cases.size() + bad_sizes);
}

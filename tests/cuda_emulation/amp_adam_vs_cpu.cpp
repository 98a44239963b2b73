// The CUDA loss-scaling and Adam entry points (amp_cuda.cu, adam_cuda.cu), run whole on the host
// through the CUDA emulation (cuda_runtime.h here) and compared with the CPU kernels:
//   cuda::amp_check     vs cpu::amp_check: found_inf and the unscaled grads byte for byte; the
//                       sums of squares (a different summation order) against an exact double sum;
//   cuda::update_scale  vs amp_math.h's update_scale called directly;
//   cuda::adam_step + cuda::increment_steps vs cpu::adam_step: every operand byte for byte.
// Guard bytes around every buffer must stay untouched (poisoned under ASan). Tensors: mixed
// dtypes, empty ones, sizes around the 64Ki-element chunk, misaligned ones (scalar path), more
// tensors than one launch's metadata holds.
#include <cuda_runtime.h>

#include <algorithm>
#include <random>

#include "../cpu/adam_cpu.h"
#include "../cpu/amp_cpu.h"
#include "adam_cuda.h"
#include "amp_cuda.h"
#include "harness.h"
#include "multi_tensor_apply.cuh"
#include "step_counters_cuda.h"

using namespace mpfused;
using emu_test::Buf;
using emu_test::elem_size;
using emu_test::expect_same_bytes;
using emu_test::get;
using emu_test::put;

namespace {

std::vector<int64_t> standard_sizes() {
  return {1, 3, 0, 64, 4097, 65535, 65536, 65537, 2 * 65536 + 13, 7, 0, 1000};
}

std::vector<int64_t> many_sizes(int n, int mod) {
  std::vector<int64_t> v;
  for (int i = 0; i < n; ++i) v.push_back((i * 37) % mod);
  return v;
}

// ---- amp_check ---------------------------------------------------------------------------------
struct AmpCase {
  const char* name;
  std::vector<int64_t> sizes;
  bool write_back, norm, per_tensor, misalign;
  int poison = 0;  // 0 none, 1 one inf, 2 one NaN, 3 a subnormal scale (inv_scale = inf)
  int64_t max_blocks = int64_t(1) << 30;  // blocks per launch: small ones end launches mid-tensor
};

void run_amp(const AmpCase& k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t n = int64_t(k.sizes.size());
  std::vector<Buf> g(n);
  std::vector<int32_t> dtype(n);
  for (int64_t i = 0; i < n; ++i) {
    dtype[i] = int32_t(i % 3);
    const size_t es = elem_size(dtype[i]);
    g[i].init(size_t(k.sizes[i]) * es, k.misalign && i % 2 ? es : 0);
    for (int64_t j = 0; j < k.sizes[i]; ++j) put(g[i], dtype[i], j, normal(rng) * 512.f);
  }
  if (k.poison == 1 || k.poison == 2) {
    int64_t t = n - 1;
    while (t > 0 && k.sizes[t] == 0) --t;
    if (k.sizes[t] > 0) put(g[t], dtype[t], k.sizes[t] - 1, k.poison == 1 ? INFINITY : NAN);
  }
  const float inv_scale = k.poison == 3 ? INFINITY : 1.f / 1024.f;
  std::vector<Buf> ref = g;

  // Exact sums of squares of the unscaled values (as fp32 unscale_element computes them).
  std::vector<double> exact(n, 0.0);
  double exact_total = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < k.sizes[i]; ++j) {
      const double u = double(get(g[i], dtype[i], j) * inv_scale);
      exact[i] += u * u;
    }
    exact_total += exact[i];
  }

  auto lists = [&](std::vector<Buf>& v, std::vector<void*>& ptrs) {
    ptrs.clear();
    for (auto& b : v) ptrs.push_back(b.ptr());
    TensorLists<1> L{};
    L.data[0] = ptrs.data();
    L.numel = k.sizes.data();
    L.dtype = dtype.data();
    L.size = n;
    return L;
  };
  std::vector<void*> gp, rp;
  const TensorLists<1> GL = lists(g, gp), RL = lists(ref, rp);

  // CPU kernel.
  float cpu_found = 0.f, cpu_norm = 0.25f;
  std::vector<float> cpu_per(n, 0.5f);
  cpu::amp_check(RL, inv_scale, k.write_back, &cpu_found, k.norm ? &cpu_norm : nullptr,
                 k.per_tensor ? cpu_per.data() : nullptr, 2);

  // Emulated CUDA call: device scalars are plain host floats here; the workspace is garbage.
  float dev_inv = inv_scale, dev_found = 0.f, dev_norm = 0.25f;
  std::vector<float> dev_per(n, 0.5f);
  std::vector<float*> per_ptrs(n);
  for (int64_t i = 0; i < n; ++i) per_ptrs[i] = &dev_per[i];
  const int64_t ws_bytes = cuda::amp_check_workspace_bytes(GL, k.norm, k.per_tensor);
  std::vector<double> ws(size_t(ws_bytes / 8 + 1));
  std::memset(ws.data(), 0x7F, ws.size() * 8);
  mpf_emulation::max_blocks_per_launch = k.max_blocks;
  const cudaError_t err = cuda::amp_check(GL, &dev_inv, k.write_back, &dev_found,
                                          k.norm ? &dev_norm : nullptr,
                                          k.per_tensor ? per_ptrs.data() : nullptr,
                                          ws_bytes ? ws.data() : nullptr, nullptr);
  mpf_emulation::max_blocks_per_launch = int64_t(1) << 30;
  EXPECT(err == cudaSuccess, "%s: amp_check returned %d", k.name, int(err));
  EXPECT(cudaGetLastError() == cudaSuccess, "%s: error left behind", k.name);

  EXPECT(dev_found == cpu_found, "%s: found_inf %g vs cpu %g", k.name, dev_found, cpu_found);
  EXPECT((dev_found == 1.f) == (k.poison != 0), "%s: found_inf %g", k.name, dev_found);
  for (int64_t i = 0; i < n; ++i) expect_same_bytes(g[i], ref[i], k.name, "grad", size_t(i));
  if (k.poison) return;  // the sums are inf/NaN then; found_inf is what matters
  // fp32 per-thread partial sums of at most 128 squares, then double: relative error << 1e-5;
  // plus one fp32 rounding of the accumulation into an output that started at 0.25 / 0.5.
  auto close = [](double got, double want) {
    return std::fabs(got - want) <= 1e-5 * std::fabs(want) + 0x1p-24 * (std::fabs(want) + 0.5);
  };
  if (k.norm) {
    EXPECT(close(double(dev_norm) - 0.25, exact_total), "%s: norm_sq %.9g vs exact %.9g", k.name,
           double(dev_norm) - 0.25, exact_total);
    EXPECT(close(double(cpu_norm) - 0.25, exact_total), "%s: cpu norm_sq %.9g vs exact %.9g", k.name,
           double(cpu_norm) - 0.25, exact_total);
  }
  if (k.per_tensor)
    for (int64_t i = 0; i < n; ++i) {
      EXPECT(close(double(dev_per[i]) - 0.5, exact[i]), "%s: tensor %lld norm_sq %.9g vs exact %.9g",
             k.name, (long long)i, double(dev_per[i]) - 0.5, exact[i]);
      if (k.sizes[i] == 0) EXPECT(dev_per[i] == 0.5f, "%s: empty tensor %lld touched", k.name, (long long)i);
    }
}

// ---- update_scale ------------------------------------------------------------------------------
size_t run_update_scale(uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t cases = 0;
  const float founds[] = {0.f, 1.f, NAN, INFINITY, -1.f};
  for (int rep = 0; rep < 200; ++rep) {
    ScaleUpdateParams p{rep % 5 == 0 ? 1e38 : 2.0, 0.5, int64_t(1 + rng() % 4), int32_t(1 + rng() % 3),
                        rep % 4 == 0 ? 64.f : 0.f, rep % 6 == 0 ? 4096.f : INFINITY};
    p.consecutive_hysteresis = rep % 3 == 0;
    float scale = float(1 << (rng() % 20)), found = founds[rng() % 5];
    int32_t growth = int32_t(rng() % 5), hyst = int32_t(rng() % 4);
    float s2 = scale;
    int32_t g2 = growth, h2 = hyst;
    update_scale(&s2, &g2, &h2, found, p);
    EXPECT(cuda::update_scale(&scale, &growth, &hyst, &found, p, nullptr) == cudaSuccess, "update_scale");
    EXPECT(cudaGetLastError() == cudaSuccess, "update_scale error left behind");
    EXPECT(std::memcmp(&scale, &s2, 4) == 0 && growth == g2 && hyst == h2,
           "update_scale rep %d: (%g, %d, %d) vs (%g, %d, %d)", rep, scale, growth, hyst, s2, g2, h2);
    ++cases;
  }
  return cases;
}

// ---- increment_steps at its launch boundaries (500 counters per 4 KB launch, 4000 per 32 KB
// launch in blocks of 500) ----------------------------------------------------------------------
size_t run_increment_steps() {
  size_t cases = 0;
  for (int64_t n : {0, 1, 499, 500, 501, 1000, 1234, 3999, 4000, 4001, 8500}) {
    for (float found : {0.f, 1.f}) {
      mpf_emulation::large_kernel_params = (n + int64_t(found)) % 2 == 1;
      std::vector<float> steps(size_t(n) + 1);
      std::vector<float*> ptrs;
      for (int64_t i = 0; i < n; ++i) {
        steps[i] = float(i % 7);
        ptrs.push_back(&steps[i]);
      }
      steps[n] = -1.f;  // past the list: never touched
      EXPECT(cuda::increment_steps(ptrs.data(), n, &found, nullptr) == cudaSuccess, "increment_steps");
      bool ok = steps[n] == -1.f;
      for (int64_t i = 0; i < n; ++i) ok = ok && steps[i] == float(i % 7) + (found > 0.f ? 0.f : 1.f);
      EXPECT(ok, "increment_steps n=%lld found_inf=%g", (long long)n, found);
      ++cases;
    }
  }
  return cases;
}

// ---- adam_step + increment_steps ---------------------------------------------------------------
struct AdamCase {
  const char* name;
  std::vector<int64_t> sizes;
  int mode;
  bool amsgrad = false, maximize = false, decoupled = true, misalign = false;
  bool grad_scale = false, clip = false, lr_ptr = false, has_found = false;
  float found = 0.f;
  int64_t max_blocks = int64_t(1) << 30;
};

struct AdamTensor {
  int64_t n = 0;
  int dtype = kFloat32;
  Buf p, g, m, v, vmax, master;
  float step = 0.f;
};

void run_adam(const AdamCase& k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t n = int64_t(k.sizes.size());
  std::vector<AdamTensor> ts(n);
  for (int64_t i = 0; i < n; ++i) {
    AdamTensor& t = ts[i];
    t.n = k.sizes[i];
    t.dtype = int(i % 3);
    const size_t es = elem_size(t.dtype);
    const auto mis = emu_test::one_operand_misaligned(k.misalign, i, 6);
    t.p.init(t.n * es, mis(0) * es);
    t.g.init(t.n * es, mis(1) * es);
    t.m.init(t.n * 4, mis(2) * 4);
    t.v.init(t.n * 4, mis(3) * 4);
    if (k.amsgrad) t.vmax.init(t.n * 4, mis(4) * 4);
    const size_t mb = emu_test::master_bytes(k.mode, t.dtype);
    if (mb) t.master.init(t.n * mb, mis(5) * mb);
    const bool fp32_master = mb == 4, remainder = mb == 2;
    for (int64_t j = 0; j < t.n; ++j) {
      const float w = normal(rng) * 0.5f;
      put(t.p, t.dtype, j, w);
      put(t.g, t.dtype, j, normal(rng) * (k.grad_scale ? 1024.f : 1.f));
      t.m.as<float>()[j] = normal(rng) * 1e-2f;
      t.v.as<float>()[j] = std::fabs(normal(rng)) * 1e-4f;
      if (k.amsgrad) t.vmax.as<float>()[j] = t.v.as<float>()[j] * (j % 2 ? 2.f : 0.5f);
      if (fp32_master) t.master.as<float>()[j] = w + normal(rng) * 1e-4f;
      if (remainder) t.master.as<int16_t>()[j] = int16_t(byte(rng) * 256 + byte(rng));
      if (mb == 1) t.master.as<int8_t>()[j] = int8_t(byte(rng));
    }
    t.step = float((3 * i) % 7);
  }
  float grad_scale = 1024.f, found = k.found, lr = 1e-3f, norm_sq = 0.f;
  for (auto& t : ts)
    for (int64_t j = 0; j < t.n; ++j) {
      const float x = get(t.g, t.dtype, j) / (k.grad_scale ? grad_scale : 1.f);
      norm_sq += x * x;
    }
  const double max_grad_norm = k.clip ? 0.3 * std::sqrt(double(norm_sq)) : 0.0;
  std::vector<AdamTensor> ref = ts;
  std::vector<uint64_t> streams;
  for (int64_t i = 0; i < int64_t(ts.size()); ++i) streams.push_back(emu_test::test_stream(i));

  std::vector<int64_t> numel;
  std::vector<int32_t> dtype;
  for (auto& t : ts) {
    numel.push_back(t.n);
    dtype.push_back(t.dtype);
  }
  auto operands = [](AdamTensor& t) {
    return std::vector<void*>{t.p.ptr(), t.g.ptr(), t.m.ptr(), t.v.ptr(), t.vmax.ptr(), t.master.ptr()};
  };
  const bool skip = k.has_found && k.found > 0.f;

  // CPU kernel, with the bindings' host-side grad_mult.
  if (!skip) {
    std::vector<std::vector<void*>> ptrs(6);
    std::vector<double> steps;
    for (auto& t : ref) {
      const auto ops = operands(t);
      for (int d = 0; d < 6; ++d) ptrs[d].push_back(ops[d]);
      steps.push_back(double(t.step) + 1.0);
      t.step += 1.f;
    }
    TensorLists<6> L{};
    for (int d = 0; d < 6; ++d) L.data[d] = ptrs[d].data();
    L.numel = numel.data();
    L.dtype = dtype.data();
    L.size = n;
    float gm = k.grad_scale ? 1.f / grad_scale : 1.f;
    if (k.clip) gm *= float(std::min(1.0, max_grad_norm / (std::sqrt(double(norm_sq)) + 1e-6)));
    using namespace emu_test;
    const cpu::AdamConfig c{lr, kBeta1, kBeta2, kEps, kWeightDecay, gm, k.amsgrad, k.maximize,
                            k.decoupled, k.mode, kSeed, streams.data()};
    cpu::adam_step(L, steps.data(), c, 2);
  }

  // Emulated CUDA calls: the step, then the counters. Operands in the elementwise order
  // (elementwise_step.h): param, grad, master, step, stream, then the moments.
  std::vector<std::vector<void*>> ptrs(cuda::kAdamDepth);
  std::vector<float*> counters;
  for (size_t i = 0; i < ts.size(); ++i) {
    AdamTensor& t = ts[i];
    ptrs[cuda::kEwParam].push_back(t.p.ptr());
    ptrs[cuda::kEwGrad].push_back(t.g.ptr());
    ptrs[cuda::kEwMaster].push_back(t.master.ptr());
    ptrs[cuda::kEwStep].push_back(&t.step);
    ptrs[cuda::kEwStream].push_back(reinterpret_cast<void*>(streams[i]));
    ptrs[cuda::kAdamExpAvg].push_back(t.m.ptr());
    ptrs[cuda::kAdamExpAvgSq].push_back(t.v.ptr());
    ptrs[cuda::kAdamMaxExpAvgSq].push_back(t.vmax.ptr());
    counters.push_back(&t.step);
  }
  TensorLists<cuda::kAdamDepth> L{};
  for (int d = 0; d < cuda::kAdamDepth; ++d) L.data[d] = ptrs[d].data();
  L.numel = numel.data();
  L.dtype = dtype.data();
  L.size = n;
  cuda::AdamConfig cfg{};
  emu_test::fill_step_common(cfg.common, k, {&lr, &grad_scale, &found, &norm_sq, max_grad_norm});
  emu_test::fill_adam_hyperparameters(cfg, k);
  cfg.amsgrad = k.amsgrad;
  mpf_emulation::max_blocks_per_launch = k.max_blocks;
  EXPECT(cuda::adam_step(L, cfg, nullptr) == cudaSuccess, "%s: adam_step", k.name);
  mpf_emulation::max_blocks_per_launch = int64_t(1) << 30;
  EXPECT(cuda::increment_steps(counters.data(), n, cfg.common.found_inf, nullptr) == cudaSuccess,
         "%s: increment_steps", k.name);
  EXPECT(cudaGetLastError() == cudaSuccess, "%s: error left behind", k.name);

  static const char* names[6] = {"param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"};
  for (int64_t i = 0; i < n; ++i) {
    const Buf* got[6] = {&ts[i].p, &ts[i].g, &ts[i].m, &ts[i].v, &ts[i].vmax, &ts[i].master};
    const Buf* exp[6] = {&ref[i].p, &ref[i].g, &ref[i].m, &ref[i].v, &ref[i].vmax, &ref[i].master};
    for (int d = 0; d < 6; ++d) expect_same_bytes(*got[d], *exp[d], k.name, names[d], size_t(i));
    EXPECT(ts[i].step == ref[i].step, "%s: tensor %lld step %g vs %g", k.name, (long long)i,
           ts[i].step, ref[i].step);
  }
}

}  // namespace

// usage: amp_adam_vs_cpu [seed]
int main(int argc, char** argv) {
  size_t cases = 0;
  uint64_t seed = emu_test::seed_from(argc, argv, 1);
  mpf_emulation::seed(seed);
  seed *= 1000;

  std::vector<AmpCase> amp;
  for (int wb = 0; wb < 2; ++wb)
    for (int norm = 0; norm < 2; ++norm)
      for (int per = 0; per < 2; ++per)
        amp.push_back(AmpCase{"amp_check", standard_sizes(), wb == 1, norm == 1, per == 1, per == norm});
  amp.push_back(AmpCase{"amp_check: 400 small tensors", many_sizes(400, 300), true, true, true, true});
  amp.push_back(AmpCase{"amp_check: 400 small tensors, check only", many_sizes(400, 300), false, false, false, false});
  amp.push_back(AmpCase{"amp_check: all empty", {0, 0, 0}, true, true, true, false});
  // > 32 chunks in one tensor: the per-tensor finalize warp strides over its partials.
  amp.push_back(AmpCase{"amp_check: a tensor of 40 chunks", {5, 40 * 65536 - 3, 7}, true, true, true, false});
  // Launches of 3 blocks: tensors (and their per-tensor norm segments) span launches.
  for (int per = 0; per < 2; ++per) {
    AmpCase c{"amp_check: 3 blocks per launch", {5, 40 * 65536 - 3, 7, 2 * 65536 + 1, 0, 65536}, true, true, per == 1, true};
    c.max_blocks = 3;
    amp.push_back(c);
  }
  for (int poison = 1; poison <= 3; ++poison) {
    amp.push_back(AmpCase{"amp_check: non-finite", standard_sizes(), true, true, true, true, poison});
    amp.push_back(AmpCase{"amp_check: non-finite, check only", many_sizes(300, 200), false, false, false, false, poison});
  }
  // Cases alternate between the 4 KB and the 32 KB kernel parameter space.
  for (size_t i = 0; i < amp.size(); ++i) {
    mpf_emulation::large_kernel_params = i % 2 == 1;
    run_amp(amp[i], seed++);
  }
  cases += amp.size();

  cases += run_update_scale(seed++);
  cases += run_increment_steps();

  std::vector<AdamCase> adam;
  for (int mode : {kNoMaster, kFp32Master, kRemainder, kStochastic, kRemainder8})
    for (int ams = 0; ams < 2; ++ams) {
      AdamCase c{"adam_step", standard_sizes(), mode};
      c.amsgrad = ams == 1;
      c.misalign = ams == 1;
      c.maximize = mode == kRemainder;
      c.decoupled = mode != kStochastic;
      c.grad_scale = mode != kNoMaster;
      c.clip = mode == kFp32Master || mode == kStochastic;
      c.lr_ptr = ams == 0;
      adam.push_back(c);
    }
  {
    AdamCase c{"adam_step: 700 small tensors (several launches, 2 step launches)", many_sizes(700, 90), kFp32Master};
    c.grad_scale = c.misalign = true;
    adam.push_back(c);
  }
  for (int mode : {kFp32Master, kStochastic}) {
    AdamCase c{"adam_step: 2 blocks per launch (tensors span launches)", standard_sizes(), mode};
    c.max_blocks = 2;
    c.amsgrad = c.grad_scale = true;
    adam.push_back(c);
  }
  {
    AdamCase c{"adam_step: found_inf = 0 runs", standard_sizes(), kRemainder};
    c.has_found = c.grad_scale = true;
    adam.push_back(c);
  }
  for (float fi : {1.f, INFINITY, NAN}) {
    AdamCase c{"adam_step: found_inf > 0 skips", standard_sizes(), kFp32Master};
    c.has_found = c.grad_scale = c.clip = c.amsgrad = true;
    c.found = fi;
    if (std::isnan(fi)) c.name = "adam_step: found_inf NaN runs (NaN > 0 is false)";
    adam.push_back(c);
  }
  for (size_t i = 0; i < adam.size(); ++i) {
    mpf_emulation::large_kernel_params = i % 2 == 0;
    run_adam(adam[i], seed++);
  }
  cases += adam.size();

  // Launches per call, 4 KB vs 32 KB parameter space: 1000 tiny tensors.
  for (int large = 0; large < 2; ++large) {
    mpf_emulation::large_kernel_params = large == 1;
    AdamCase c{"adam_step: 1000 tiny tensors, launch count", many_sizes(1000, 5), kNoMaster};
    const long long before = mpf_emulation::launch_state.launches;
    run_adam(c, seed++);
    const long long got = mpf_emulation::launch_state.launches - before;
    // Without AMSGrad a launch carries no max_exp_avg_sq operand: kAdamDepth - 1 per tensor.
    constexpr int kDepth = cuda::kAdamDepth - 1;
    const long long per = large ? cuda::MtaMeta<kDepth, cuda::kMaxParamBytesLarge>::kMaxTensors
                                : cuda::MtaMeta<kDepth>::kMaxTensors;
    const long long steps = large ? 4000 : 500;
    const long long want = (1000 + per - 1) / per + (1000 + steps - 1) / steps;
    EXPECT(got == want, "%s (%s params): %lld launches, expected %lld", c.name,
           large ? "32 KB" : "4 KB", got, want);
    std::printf("1000 tensors: %lld launches with %s kernel parameters (%lld tensors each)\n", got,
                large ? "32 KB" : "4 KB", per);
    ++cases;
  }
  std::printf("emulated launches %lld, blocks %lld\n", (long long)mpf_emulation::launch_state.launches,
              (long long)mpf_emulation::launch_state.blocks);
  return emu_test::report(cases);
}

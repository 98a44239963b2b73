// The CUDA SGD and Lion entry points (sgd_cuda.cu, lion_cuda.cu: elementwise_cuda.cuh's kernel)
// and cuda::increment_steps, run whole on the host through the CUDA emulation and compared byte
// for byte, guard bytes included, with the same step computed on the CPU: every dtype x master
// mode, SGD without / with / Nesterov momentum, dampening, weight decay, maximize, first steps,
// sizes around the 64Ki-element chunk, misaligned operands (the scalar loop), launches that end
// mid-tensor, grad_scale, clipping, a device lr, found_inf skips (nothing written, counters
// included), zeros and non-finite gradients, launch counts.
//
// The CPU side is cpu::sgd_step / cpu::lion_step (csrc/cpu/sgd_cpu.h, lion_cpu.h) with the CPU
// bindings' host-side grad_mult and lr. In a tree without those kernels it is a scalar loop over
// the same shared per-element functions (sgd_element / lion_element between load_weight and
// store_weight, cpu::pick_elementwise_chunk's per-dtype modes); the program says which it used.
//
// usage: sgd_lion_vs_cpu [seed]
#include <cuda_runtime.h>

#include <random>
#include <type_traits>

#if __has_include("../cpu/sgd_cpu.h") && __has_include("../cpu/lion_cpu.h")
#define MPF_TEST_CPU_KERNELS 1
#include "../cpu/lion_cpu.h"
#include "../cpu/sgd_cpu.h"
#endif
#include "harness.h"
#include "lion_cuda.h"
#include "multi_tensor_apply.cuh"
#include "sgd_cuda.h"
#include "step_counters_cuda.h"

using namespace mpfused;
using namespace mpfused::cuda;
using emu_test::Buf;
using emu_test::elem_size;
using emu_test::expect_same_bytes;
using emu_test::get;
using emu_test::put;

namespace {

constexpr double kLionBeta1 = 0.9, kLionBeta2 = 0.99;
constexpr uint64_t kSeed = 4321;
constexpr int64_t kNoLimit = int64_t(1) << 30;

std::vector<int64_t> standard_sizes() {
  return {1, 3, 0, 64, 4097, 65535, 65536, 65537, 2 * 65536 + 13, 7, 0, 1000};
}

std::vector<int64_t> many_sizes(int n, int mod) {
  std::vector<int64_t> v;
  for (int i = 0; i < n; ++i) v.push_back((i * 37) % mod);
  return v;
}

struct Case {
  const char* name;
  std::vector<int64_t> sizes;
  bool lion;
  int mode;
  double momentum = 0.9, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false, maximize = false, misalign = false;
  bool grad_scale = false, clip = false, lr_ptr = false, has_found = false;
  double clip_ratio = 0.3;  // max_grad_norm / norm: > 1 leaves the grads as they are (coef 1)
  float found = 0.f;
  bool first = false;    // every counter 0: the first step (SGD: buffer = gradient)
  bool special = false;  // zero gradients and moments (Lion: sign(0) = 0), inf and NaN gradients
  int64_t max_blocks = kNoLimit;
};

struct Tensor {
  int64_t n = 0;
  int dtype = kFloat32;
  Buf p, g, state, master;  // state: momentum buffer (SGD with momentum) or exp_avg (Lion)
  float step = 0.f;
};

bool has_state(const Case& k) { return k.lion || k.momentum != 0.0; }

#ifdef MPF_TEST_CPU_KERNELS
constexpr const char* kExpected = "cpu::sgd_step / cpu::lion_step";

// The CPU kernels on `ref` (counters not advanced here).
void expected_step(std::vector<Tensor>& ref, const Case& k, double lr, float gm,
                   const std::vector<uint64_t>& streams) {
  std::vector<std::vector<void*>> ptrs(4);
  std::vector<int64_t> numel;
  std::vector<int32_t> dtype;
  std::vector<double> steps;
  const int state_op = k.lion ? int(cpu::kLionExpAvg) : int(cpu::kSgdMomentumBuffer);
  const int master_op = k.lion ? int(cpu::kLionMaster) : int(cpu::kSgdMaster);
  for (Tensor& t : ref) {
    ptrs[0].push_back(t.p.ptr());
    ptrs[1].push_back(t.g.ptr());
    ptrs[state_op].push_back(t.state.ptr());
    ptrs[master_op].push_back(t.master.ptr());
    numel.push_back(t.n);
    dtype.push_back(t.dtype);
    steps.push_back(double(t.step) + 1.0);
  }
  TensorLists<4> L{};
  for (int d = 0; d < 4; ++d) L.data[d] = ptrs[d].data();
  L.numel = numel.data();
  L.dtype = dtype.data();
  L.size = int64_t(ref.size());
  if (k.lion) {
    const cpu::LionConfig c{lr, kLionBeta1, kLionBeta2, k.weight_decay, k.maximize, gm, k.mode,
                            kSeed, streams.data()};
    cpu::lion_step(L, steps.data(), c, 2);
  } else {
    const cpu::SgdConfig c{lr, k.momentum, k.dampening, k.weight_decay, k.nesterov, k.maximize,
                           gm, k.mode, kSeed, streams.data()};
    cpu::sgd_step(L, steps.data(), c, 2);
  }
}
#else
constexpr const char* kExpected = "the per-element loop (no cpu::sgd_step / lion_step here)";

// cpu::pick_elementwise_chunk's choice: f(T{}, integral_constant<MODE>) with the effective
// storage type and master mode of a tensor.
template <typename F>
void dispatch(int dtype, int mode, F&& f) {
  dispatch_master_mode(dtype, mode, f);
}

// The expected step of one tensor (the CPU kernels' loop).
template <typename T, int MODE>
void expect_tensor(Tensor& t, const Case& k, double lr, float gm, uint64_t stream) {
  const double step = double(t.step) + 1.0;
  const uint64_t seed = step_seed(kSeed, step);
  T* p = t.p.as<T>();
  const T* g = t.g.as<T>();
  float* st = t.state.as<float>();
  master_t<MODE>* mst = master_operand<MODE>(t.master.ptr(), 0);
  const LionScalars ls = lion_scalars(lr, kLionBeta1, kLionBeta2, k.weight_decay, k.maximize, gm);
  const SgdScalars ss =
      sgd_scalars(lr, k.momentum, k.dampening, k.weight_decay, k.maximize, gm, step);
  for (int64_t i = 0; i < t.n; ++i) {
    float w = load_weight<T, MODE>(p, mst, i);
    float none = 0.f;
    float& s = st ? st[i] : none;
    const float gi = to_f32(g[i]);
    if (k.lion) lion_element(w, gi, s, ls);
    else if (k.momentum == 0.0) sgd_element<false, false>(w, gi, s, ss);
    else if (k.nesterov) sgd_element<true, true>(w, gi, s, ss);
    else sgd_element<true, false>(w, gi, s, ss);
    store_weight<T, MODE>(w, p, mst, i, seed, stream, i);
  }
}

void expected_step(std::vector<Tensor>& ref, const Case& k, double lr, float gm,
                   const std::vector<uint64_t>& streams) {
  for (size_t i = 0; i < ref.size(); ++i)
    dispatch(ref[i].dtype, k.mode, [&](auto tag, auto mode) {
      expect_tensor<decltype(tag), decltype(mode)::value>(ref[i], k, lr, gm, streams[i]);
    });
}
#endif

void run_case(const Case& k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t n = int64_t(k.sizes.size());
  const bool state = has_state(k);
  std::vector<Tensor> ts(n);
  for (int64_t i = 0; i < n; ++i) {
    Tensor& t = ts[i];
    t.n = k.sizes[i];
    t.dtype = int(i % 3);
    const size_t es = elem_size(t.dtype);
    const auto mis = emu_test::one_operand_misaligned(k.misalign, i, 4);
    t.p.init(t.n * es, mis(0) * es);
    t.g.init(t.n * es, mis(1) * es);
    if (state) t.state.init(t.n * 4, mis(2) * 4);
    const size_t mb = emu_test::master_bytes(k.mode, t.dtype);
    if (mb) t.master.init(t.n * mb, mis(3) * mb);
    for (int64_t j = 0; j < t.n; ++j) {
      const float w = normal(rng) * 0.5f;
      put(t.p, t.dtype, j, w);
      float g = normal(rng) * (k.grad_scale ? 1024.f : 1.f);
      float m = normal(rng) * (k.lion ? 1e-2f : 1e-1f);
      if (k.special && j % 13 == 5) g = m = 0.f;  // Lion: c = 0, no move
      if (k.special && j % 997 == 11) g = j % 2 ? INFINITY : NAN;
      put(t.g, t.dtype, j, g);
      if (state) t.state.as<float>()[j] = m;
      if (mb == 4) t.master.as<float>()[j] = w + normal(rng) * 1e-4f;
      if (mb == 2) t.master.as<int16_t>()[j] = int16_t(byte(rng) * 256 + byte(rng));
      if (mb == 1) t.master.as<int8_t>()[j] = int8_t(byte(rng));
    }
    t.step = k.first ? 0.f : float((3 * i) % 7);  // mixes first (0) and later steps
  }
  float grad_scale = 1024.f, found = k.found, dev_lr = 1e-2f, norm_sq = 0.f;
  const double host_lr = k.lion ? 1e-4 / 3 : 0.1 / 3;  // not a float: derived in double
  for (auto& t : ts)
    for (int64_t j = 0; j < t.n; ++j) {
      const float x = get(t.g, t.dtype, j) / (k.grad_scale ? grad_scale : 1.f);
      if (std::isfinite(x)) norm_sq += x * x;
    }
  const double max_grad_norm = k.clip ? k.clip_ratio * std::sqrt(double(norm_sq)) : 0.0;
  std::vector<uint64_t> streams;
  for (int64_t i = 0; i < n; ++i) streams.push_back(emu_test::test_stream(i));
  std::vector<Tensor> ref = ts;
  const bool skip = k.has_found && k.found > 0.f;

  // Expected: the CPU bindings' host-side grad_mult and lr, then each tensor's loop.
  if (!skip) {
    float gm = k.grad_scale ? 1.f / grad_scale : 1.f;
    if (k.clip) gm *= float(std::min(1.0, max_grad_norm / (std::sqrt(double(norm_sq)) + 1e-6)));
    expected_step(ref, k, k.lr_ptr ? double(dev_lr) : host_lr, gm, streams);
    for (Tensor& t : ref) t.step += 1.f;
  }

  // Emulated CUDA calls: the step, then the counters.
  std::vector<std::vector<void*>> ptrs(kEwFixed + 1);
  std::vector<int64_t> numel;
  std::vector<int32_t> dtype;
  std::vector<float*> counters;
  for (int64_t i = 0; i < n; ++i) {
    Tensor& t = ts[i];
    ptrs[kEwParam].push_back(t.p.ptr());
    ptrs[kEwGrad].push_back(t.g.ptr());
    ptrs[kEwMaster].push_back(t.master.ptr());
    ptrs[kEwStep].push_back(&t.step);
    ptrs[kEwStream].push_back(reinterpret_cast<void*>(streams[i]));
    ptrs[kEwState].push_back(t.state.ptr());  // null without momentum
    numel.push_back(t.n);
    dtype.push_back(t.dtype);
    counters.push_back(&t.step);
  }
  TensorLists<kEwFixed + 1> L{};
  for (int d = 0; d < kEwFixed + 1; ++d) L.data[d] = ptrs[d].data();
  L.numel = numel.data();
  L.dtype = dtype.data();
  L.size = n;
  cuda::StepCommon common{};
  common.lr = k.lr_ptr ? 0.0 : host_lr;
  common.lr_ptr = k.lr_ptr ? &dev_lr : nullptr;
  common.grad_scale = k.grad_scale ? &grad_scale : nullptr;
  common.found_inf = k.has_found ? &found : nullptr;
  common.norm_sq = k.clip ? &norm_sq : nullptr;
  common.max_grad_norm = max_grad_norm;
  common.maximize = k.maximize;
  common.master_mode = k.mode;
  common.seed = kSeed;
  mpf_emulation::max_blocks_per_launch = k.max_blocks;
  cudaError_t err;
  if (k.lion) {
    const cuda::LionConfig cfg{common, kLionBeta1, kLionBeta2, k.weight_decay};
    err = cuda::lion_step(L, cfg, nullptr);
  } else {
    const cuda::SgdConfig cfg{common, k.momentum, k.dampening, k.weight_decay, k.nesterov};
    err = cuda::sgd_step(L, cfg, nullptr);
  }
  mpf_emulation::max_blocks_per_launch = kNoLimit;
  EXPECT(err == cudaSuccess, "%s: step returned %d", k.name, int(err));
  EXPECT(cuda::increment_steps(counters.data(), n, common.found_inf, nullptr) == cudaSuccess,
         "%s: increment_steps", k.name);
  EXPECT(cudaGetLastError() == cudaSuccess, "%s: error left behind", k.name);

  const char* state_name = k.lion ? "exp_avg" : "momentum_buffer";
  for (int64_t i = 0; i < n; ++i) {
    expect_same_bytes(ts[i].p, ref[i].p, k.name, "param", size_t(i));
    expect_same_bytes(ts[i].g, ref[i].g, k.name, "grad", size_t(i));
    expect_same_bytes(ts[i].state, ref[i].state, k.name, state_name, size_t(i));
    expect_same_bytes(ts[i].master, ref[i].master, k.name, "master", size_t(i));
    EXPECT(ts[i].step == ref[i].step, "%s: tensor %lld step %g vs %g", k.name, (long long)i,
           ts[i].step, ref[i].step);
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const int modes[] = {kNoMaster, kFp32Master, kRemainder, kStochastic, kRemainder8};
  // SGD: 4 variants x 4 master modes, the options spread over them.
  for (int mode : modes)
    for (int var = 0; var < 4; ++var) {
      Case c{"sgd", standard_sizes(), false, mode};
      c.momentum = var == 0 ? 0.0 : 0.9;
      c.nesterov = var == 2 || (var == 0 && mode == kStochastic);  // ignored without momentum
      c.dampening = var == 3 ? 0.25 : 0.0;
      c.weight_decay = (var + mode) % 2 ? 1e-2 : 0.0;
      c.maximize = mode == kRemainder || var == 3;
      c.misalign = (var + mode) % 2 == 0;
      c.grad_scale = mode != kNoMaster;
      c.clip = mode == kFp32Master || mode == kStochastic || var == 1;
      c.clip_ratio = var == 1 ? 3.0 : 0.3;
      c.lr_ptr = var % 2 == 1;
      v.push_back(c);
    }
  for (int mode : modes)
    for (int var = 0; var < 2; ++var) {
      Case c{"lion", standard_sizes(), true, mode};
      c.weight_decay = var ? 0.1 : 0.0;
      c.maximize = mode == kRemainder;
      c.misalign = var == 1;
      c.grad_scale = mode != kNoMaster;
      c.clip = mode == kFp32Master || mode == kStochastic;
      c.clip_ratio = var == 1 ? 3.0 : 0.3;
      c.lr_ptr = var == 0;
      v.push_back(c);
    }
  for (int nesterov = 0; nesterov < 2; ++nesterov) {
    Case c{"sgd: first step (every counter 0: buffer = gradient, dampening not applied)",
           standard_sizes(), false, kFp32Master};
    c.first = true;
    c.nesterov = nesterov == 1;
    c.dampening = nesterov ? 0.0 : 0.5;
    c.weight_decay = 1e-2;
    v.push_back(c);
  }
  for (int lion = 0; lion < 2; ++lion) {
    Case c{"zeros, inf and NaN gradients", standard_sizes(), lion == 1, kRemainder};
    c.special = true;
    c.weight_decay = 1e-2;
    v.push_back(c);
  }
  for (int lion = 0; lion < 2; ++lion) {
    Case c{"300 small tensors, misaligned (several launches)", many_sizes(300, 90), lion == 1,
           kFp32Master};
    c.misalign = c.grad_scale = true;
    v.push_back(c);
  }
  for (int var = 0; var < 3; ++var) {
    Case c{"2 blocks per launch (tensors span launches)", standard_sizes(), var == 2,
           var == 1 ? kStochastic : kFp32Master};
    c.max_blocks = 2;
    c.momentum = var == 0 ? 0.0 : 0.9;
    c.grad_scale = true;
    v.push_back(c);
  }
  for (int lion = 0; lion < 2; ++lion) {
    Case c{"found_inf = 0 runs", standard_sizes(), lion == 1, kRemainder};
    c.has_found = c.grad_scale = true;
    v.push_back(c);
    for (float fi : {1.f, INFINITY, NAN}) {
      Case s{std::isnan(fi) ? "found_inf NaN runs (NaN > 0 is false)" : "found_inf > 0 skips",
             standard_sizes(), lion == 1, kFp32Master};
      s.has_found = s.grad_scale = s.clip = true;
      s.found = fi;
      s.weight_decay = 1e-2;
      v.push_back(s);
    }
  }
  return v;
}

// Launches per call with 700 tiny tensors: SGD without momentum carries one operand less per
// tensor (kEwFixed), so more tensors fit a launch (4 KB: 10 launches instead of 12).
size_t run_launch_counts(uint64_t& seed) {
  size_t n = 0;
  for (int large = 0; large < 2; ++large)
    for (int var = large; var < 2; ++var) {  // 32 KB: with momentum only (2 launches)
      mpf_emulation::large_kernel_params = large == 1;
      Case c{"700 tiny tensors, launch count", many_sizes(700, 5), false, kNoMaster};
      c.momentum = var == 0 ? 0.0 : 0.9;
      const long long before = mpf_emulation::launch_state.launches;
      run_case(c, seed++);
      const long long got = mpf_emulation::launch_state.launches - before;
      const long long per =
          large ? (var ? cuda::MtaMeta<kEwFixed + 1, cuda::kMaxParamBytesLarge>::kMaxTensors
                       : cuda::MtaMeta<kEwFixed, cuda::kMaxParamBytesLarge>::kMaxTensors)
                : (var ? cuda::MtaMeta<kEwFixed + 1>::kMaxTensors
                       : cuda::MtaMeta<kEwFixed>::kMaxTensors);
      const long long steps = large ? 4000 : 500;
      const long long want = (700 + per - 1) / per + (700 + steps - 1) / steps;
      EXPECT(got == want, "%s (%s, %s): %lld launches, expected %lld", c.name,
             var ? "momentum" : "no momentum", large ? "32 KB" : "4 KB", got, want);
      std::printf("sgd (%s), 700 tensors: %lld launches with %s kernel parameters (%lld "
                  "tensors each)\n", var ? "momentum" : "no momentum", got,
                  large ? "32 KB" : "4 KB", per);
      ++n;
    }
  static_assert(cuda::MtaMeta<kEwFixed>::kMaxTensors > cuda::MtaMeta<kEwFixed + 1>::kMaxTensors,
                "a launch without the momentum operand holds more tensors");
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = emu_test::seed_from(argc, argv, 1);
  std::printf("expected: %s\n", kExpected);
  mpf_emulation::seed(seed);
  seed *= 1000;
  const std::vector<Case> all = cases();
  // Cases alternate between the 4 KB and the 32 KB kernel parameter space.
  for (size_t i = 0; i < all.size(); ++i) {
    mpf_emulation::large_kernel_params = i % 2 == 1;
    run_case(all[i], seed++);
  }
  size_t n = all.size() + run_launch_counts(seed);
  std::printf("emulated launches %lld, blocks %lld\n",
              (long long)mpf_emulation::launch_state.launches,
              (long long)mpf_emulation::launch_state.blocks);
  return emu_test::report(n);
}

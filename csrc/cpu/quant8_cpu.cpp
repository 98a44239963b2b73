#include "quant8_cpu.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace mpfused::cpu {

const Encoder& encoder_for(const float* map, int32_t zero_code, int ncodes) {
  static std::mutex mu;
  static std::vector<std::tuple<std::vector<float>, int32_t, std::unique_ptr<Encoder>>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [key, zc, enc] : cache)
    if (zc == zero_code && key.size() == size_t(ncodes) &&
        std::memcmp(key.data(), map, sizeof(float) * size_t(ncodes)) == 0)
      return *enc;
  auto enc = std::make_unique<Encoder>();
  quant8_build_lut(map, enc->lut, zero_code, ncodes);
  quant8_thresholds(map, enc->thr, ncodes);
  // a 16-entry map is padded with its last entry: codes never exceed 15, so never read it
  for (int i = 0; i < kQuantCodes; ++i)
    for (int k = 0; k < 4; ++k)
      enc->planes[k][i] = uint8_t(f32_bits(map[i < ncodes ? i : ncodes - 1]) >> (8 * k));
  cache.emplace_back(std::vector<float>(map, map + ncodes), zero_code, std::move(enc));
  return *std::get<2>(cache.back());
}

#if MPF_8BIT_ISAS
int isa_level() {
  static const int level = [] {
    int l = __builtin_cpu_supports("x86-64-v4") ? (__builtin_cpu_supports("avx512vbmi") ? 5 : 4)
            : __builtin_cpu_supports("x86-64-v3") ? 3 : 0;
    if (const char* cap = std::getenv("MPFUSED_CPU_ISA")) {
      const std::string c(cap);
      const int want = c == "base" ? 0 : c == "v3" ? 3 : c == "v4" ? 4 : c == "vbmi" ? 5 : l;
      l = want < l ? want : l;
    }
    return l;
  }();
  return level;
}
#endif

}  // namespace mpfused::cpu

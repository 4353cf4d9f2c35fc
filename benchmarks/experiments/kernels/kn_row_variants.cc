// Does the float32 dense op's split-K pass read weights as fast as memory gives them? A
// standalone microbenchmark (no TensorFlow) of acc[:] += x[k .. k+P) @ W[k .. k+P, :] at one
// row of x over GPT-2-small's 48 block matrices (340 MB of float32, far past any cache), on
// 2 threads that each take one half of every matrix's rows, against a loop that only reads:
//
//   read           four independent sums of every 8 floats: what the memory gives
//   pass 8         KnPassAvx2<1, 8> in src/tokenserve/kernels/dense_kn.h before it prefetched:
//                  eight weight rows side by side, the hardware prefetcher alone
//   pass 8 + L2    the op's: the next pass's eight rows prefetched into L2, spread over this
//                  pass (8 * P floats a step)
//   pass 8 + L2x2  the same, two passes ahead
//   pass 16        sixteen rows a pass, two accumulator chains, no prefetch
//
// The variants alternate within each round (the order reversed every other round), and the
// table gives medians over rounds of GB/s and of the ratio to `read` in the same round.
//
//   g++ -O3 -std=c++17 -pthread -o /tmp/kn_row_variants \
//       benchmarks/experiments/kernels/kn_row_variants.cc
//   /tmp/kn_row_variants [rounds]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using int64 = int64_t;
#define AVX2_FN __attribute__((target("avx2,fma")))

struct Matrix {
  int64 K, N;
  float* w;  // [K, N], row-major
};

std::vector<float> x_row(4096, 0.01f);
volatile float sink;

// acc[:] += x[k .. k+P) @ W[k .. k+P, :]; with `ahead`, the P * N floats there are prefetched
// into L2 as the pass goes (8 * P of them for every 8 columns)
template <int P, bool kTwoChains = false>
AVX2_FN void Pass(const Matrix& m, int64 k, float* acc, const float* ahead) {
  const float* rows[P];
  __m256 xs[P];
  for (int i = 0; i < P; ++i) {
    rows[i] = m.w + (k + i) * m.N;
    xs[i] = _mm256_set1_ps(x_row[k + i]);
  }
  for (int64 j = 0; j < m.N; j += 8) {
    if (ahead != nullptr) {
      const char* line = reinterpret_cast<const char*>(ahead + j * P);
      for (int i = 0; i < P * 32; i += 64) _mm_prefetch(line + i, _MM_HINT_T1);
    }
    __m256 s = _mm256_loadu_ps(acc + j), t = _mm256_setzero_ps();
    for (int i = 0; i < P; ++i) {
      const __m256 v = _mm256_loadu_ps(rows[i] + j);
      if (kTwoChains && (i & 1)) {
        t = _mm256_fmadd_ps(xs[i], v, t);
      } else {
        s = _mm256_fmadd_ps(xs[i], v, s);
      }
    }
    _mm256_storeu_ps(acc + j, kTwoChains ? _mm256_add_ps(s, t) : s);
  }
}

AVX2_FN float Read(const float* p, int64 n) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (int64 i = 0; i + 32 <= n; i += 32) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(p + i));
    b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + 8));
    c = _mm256_add_ps(c, _mm256_loadu_ps(p + i + 16));
    d = _mm256_add_ps(d, _mm256_loadu_ps(p + i + 24));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
  return out[0];
}

enum Variant { kRead, kPass8, kPass8L2, kPass8L2x2, kPass16, kVariants };
const char* const kNames[kVariants] = {"read", "pass 8", "pass 8 + L2", "pass 8 + L2x2",
                                       "pass 16"};

// one thread's share of one matrix: rows [k0, k1)
void Rows(Variant v, const Matrix& m, int64 k0, int64 k1, float* acc) {
  if (v == kRead) {
    sink = Read(m.w + k0 * m.N, (k1 - k0) * m.N);
    return;
  }
  int64 k = k0;
  if (v == kPass16) {
    for (; k + 16 <= k1; k += 16) Pass<16, true>(m, k, acc, nullptr);
  } else {
    const int64 passes_ahead = v == kPass8L2x2 ? 2 : 1;
    for (; k + 8 <= k1; k += 8) {
      const bool prefetch = v != kPass8 && k + 8 * (passes_ahead + 1) <= k1;
      Pass<8>(m, k, acc, prefetch ? m.w + (k + 8 * passes_ahead) * m.N : nullptr);
    }
  }
  for (; k + 8 <= k1; k += 8) Pass<8>(m, k, acc, nullptr);
  for (; k < k1; ++k) Pass<1>(m, k, acc, nullptr);
}

double Seconds(Variant v, const std::vector<Matrix>& matrices) {
  std::vector<float> acc0(4096), acc1(4096);
  const auto start = std::chrono::steady_clock::now();
  std::thread helper([&] {
    for (const Matrix& m : matrices) Rows(v, m, m.K / 2, m.K, acc1.data());
  });
  for (const Matrix& m : matrices) Rows(v, m, 0, m.K / 2, acc0.data());
  helper.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 8;
  const int64 d = 768;
  std::vector<Matrix> matrices;  // per block: attention out, MLP up, MLP down, next QKV
  double bytes = 0;
  for (int layer = 0; layer < 12; ++layer) {
    for (const auto& [K, N] : {std::pair<int64, int64>{d, d}, {d, 4 * d}, {4 * d, d},
                               {d, 3 * d}}) {
      auto* w = static_cast<float*>(std::aligned_alloc(64, K * N * sizeof(float)));
      for (int64 i = 0; i < K * N; ++i) w[i] = 0.001f * static_cast<float>(i % 7);
      matrices.push_back({K, N, w});
      bytes += K * N * sizeof(float);
    }
  }
  std::vector<std::vector<double>> rate(kVariants), ratio(kVariants);
  for (int round = 0; round < rounds; ++round) {
    double round_rate[kVariants];
    for (int i = 0; i < kVariants; ++i) {
      const auto v = static_cast<Variant>(round % 2 ? kVariants - 1 - i : i);
      std::vector<double> reps;
      for (int rep = 0; rep < 7; ++rep) reps.push_back(bytes / Seconds(v, matrices) / 1e9);
      round_rate[v] = Median(reps);
    }
    for (int v = 0; v < kVariants; ++v) {
      rate[v].push_back(round_rate[v]);
      ratio[v].push_back(round_rate[v] / round_rate[kRead]);
    }
  }
  for (int v = 0; v < kVariants; ++v) {
    const auto [lo, hi] = std::minmax_element(ratio[v].begin(), ratio[v].end());
    std::printf("%-14s %5.1f GB/s   / read %.2f (%.2f-%.2f)\n", kNames[v], Median(rate[v]),
                Median(ratio[v]), *lo, *hi);
  }
  for (Matrix& m : matrices) std::free(m.w);
  return 0;
}

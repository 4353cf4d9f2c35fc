// Is the int8 op's one-row kernel bound by memory or by its instructions? A standalone
// microbenchmark (no TensorFlow) of three ways to take y = W x for one row of x, W int8 [N, K]
// with x quantized to int8 per block of 32 (the op's scheme), against a loop that only reads
// W, each on 2 threads splitting N:
//
//   rows      the op's AVX2 path at 1-8 rows of x before it prefetched into L2: one weight
//             row at a time, prefetched 1 KB ahead into L1, four accumulators; per 32
//             weights sign + maddubs + madd + cvt + fma
//   L2 16K    the same, also prefetching 16 KB (32 KB, 64 KB) ahead into L2; 32 KB is the
//             op's (Int8RowsAvx2 in src/tokenserve/kernels/int8_rows_avx2.h)
//   2 rows    two weight rows per pass sharing each load of x
//   int16     x widened to int16 once, W widened per block, madd only (no sign trick)
//   read      xor of every 32 bytes of W: what the memory gives
//
// "dram": W is GPT-2's LM head (768 x 50257, 38.6 MB) in two copies, so it comes from DRAM;
// "hot": a 768 x 512 matrix (384 KB) that stays in the L2 caches, run 5,000 times.
//
//   g++ -O3 -march=native -std=c++17 -pthread -o /tmp/int8_row_variants \
//       benchmarks/experiments/kernels/int8_row_variants.cc && /tmp/int8_row_variants
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
constexpr int64 kBlock = 32;
constexpr int64 kPrefetch = 1024;

struct X {  // one row of x, quantized per block of 32
  std::vector<int8_t> q, abs_q;
  std::vector<int16_t> wide;
  std::vector<float> d;
};

float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__m256i Pairs(const int8_t* w, const int8_t* x, const int8_t* ax) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax));
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(wv, xv)),
                           _mm256_set1_epi16(1));
}

// The op's one-row loop: one weight row at a time, prefetched kPrefetch bytes ahead, four
// accumulators over consecutive blocks; `dot` turns one 32-block of the row and of x into
// its 8 int32 partial sums.
template <int64 kL2Ahead = 0, typename BlockDot>
void OneRowAtATime(const int8_t* q, int64 n0, int64 n1, int64 K, const X& x, float* y,
                   BlockDot dot) {
  for (int64 n = n0; n < n1; ++n) {
    const int8_t* w = q + n * K;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64 j = 0; j + 4 <= K / kBlock; j += 4) {
      const char* ahead = reinterpret_cast<const char*>(w + j * kBlock) + kPrefetch;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      if (kL2Ahead > 0) {
        const char* far = reinterpret_cast<const char*>(w + j * kBlock) + kL2Ahead;
        _mm_prefetch(far, _MM_HINT_T1);
        _mm_prefetch(far + 64, _MM_HINT_T1);
      }
      for (int i = 0; i < 4; ++i) {
        const int64 o = (j + i) * kBlock;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(w + o, o)),
                                 _mm256_set1_ps(x.d[j + i]), acc[i]);
      }
    }
    y[n] = HorizontalSum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                       _mm256_add_ps(acc[2], acc[3])));
  }
}

void Rows(const int8_t* q, int64 n0, int64 n1, int64 K, const X& x, float* y) {
  OneRowAtATime(q, n0, n1, K, x, y, [&x](const int8_t* w, int64 o) {
    return Pairs(w, &x.q[o], &x.abs_q[o]);
  });
}

template <int64 kL2Ahead>
void RowsL2(const int8_t* q, int64 n0, int64 n1, int64 K, const X& x, float* y) {
  OneRowAtATime<kL2Ahead>(q, n0, n1, K, x, y, [&x](const int8_t* w, int64 o) {
    return Pairs(w, &x.q[o], &x.abs_q[o]);
  });
}

void TwoRows(const int8_t* q, int64 n0, int64 n1, int64 K, const X& x, float* y) {
  for (int64 n = n0; n + 2 <= n1; n += 2) {
    const int8_t* w0 = q + n * K;
    const int8_t* w1 = w0 + K;
    __m256 a0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 a1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64 j = 0; j + 2 <= K / kBlock; j += 2) {
      const char* ahead = reinterpret_cast<const char*>(w0 + j * kBlock) + kPrefetch;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + K, _MM_HINT_T0);
      for (int i = 0; i < 2; ++i) {
        const int64 o = (j + i) * kBlock;
        const __m256 d = _mm256_set1_ps(x.d[j + i]);
        a0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Pairs(w0 + o, &x.q[o], &x.abs_q[o])), d, a0[i]);
        a1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Pairs(w1 + o, &x.q[o], &x.abs_q[o])), d, a1[i]);
      }
    }
    y[n] = HorizontalSum(_mm256_add_ps(a0[0], a0[1]));
    y[n + 1] = HorizontalSum(_mm256_add_ps(a1[0], a1[1]));
  }
}

void Int16(const int8_t* q, int64 n0, int64 n1, int64 K, const X& x, float* y) {
  OneRowAtATime(q, n0, n1, K, x, y, [&x](const int8_t* w, int64 o) {
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16)));
    return _mm256_add_epi32(
        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)&x.wide[o])),
        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)&x.wide[o + 16])));
  });
}

void Read(const int8_t* q, int64 n0, int64 n1, int64 K, const X&, float* y) {
  __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                  _mm256_setzero_si256()};
  for (const int8_t* p = q + n0 * K; p + 128 <= q + n1 * K; p += 128) {
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_xor_si256(a[i], _mm256_loadu_si256((const __m256i*)(p + 32 * i)));
    }
  }
  const __m256i all = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
  y[n0] = static_cast<float>(_mm256_extract_epi32(all, 0));
}

using Kernel = void (*)(const int8_t*, int64, int64, int64, const X&, float*);

// Median GB/s of 7 timings of `loops` passes over `matrices` (2 threads split N).
double Measure(Kernel kernel, const std::vector<int8_t*>& matrices, int64 N, int64 K,
               const X& x, int loops) {
  std::vector<float> y(N);
  std::vector<double> rates;
  for (int rep = 0; rep < 7; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int8_t* q : matrices) {
      std::thread helper([&] {
        for (int l = 0; l < loops; ++l) kernel(q, N / 2, N, K, x, y.data());
      });
      for (int l = 0; l < loops; ++l) kernel(q, 0, N / 2, K, x, y.data());
      helper.join();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                         .count();
    rates.push_back(double(N) * K * matrices.size() * loops / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[3];
}

}  // namespace

int main() {
  const int64 K = 768;
  X x;
  for (int64 i = 0; i < K; ++i) {
    x.q.push_back(static_cast<int8_t>(i % 200 - 100));
    x.abs_q.push_back(static_cast<int8_t>(std::abs(x.q.back())));
    x.wide.push_back(x.q.back());
  }
  x.d.assign(K / kBlock, 0.01f);
  const struct { const char* name; Kernel kernel; } kernels[] = {
      {"rows", Rows},         {"L2 16K", RowsL2<16384>}, {"L2 32K", RowsL2<32768>},
      {"L2 64K", RowsL2<65536>}, {"2 rows", TwoRows},       {"int16", Int16},
      {"read", Read}};
  const struct { const char* name; int64 N; int copies, loops; } cases[] = {
      {"dram", 50257, 2, 1}, {"hot", 512, 1, 5000}};
  for (const auto& c : cases) {
    std::vector<int8_t*> matrices;
    for (int m = 0; m < c.copies; ++m) {
      auto* q = static_cast<int8_t*>(std::aligned_alloc(64, c.N * K));
      for (int64 i = 0; i < c.N * K; ++i) q[i] = static_cast<int8_t>((i * 7 + m) % 255 - 127);
      matrices.push_back(q);
    }
    for (const auto& k : kernels) {
      std::printf("%-5s %-7s %6.1f GB/s of int8 weights\n", c.name, k.name,
                  Measure(k.kernel, matrices, c.N, K, x, c.loops));
    }
    for (int8_t* q : matrices) std::free(q);
  }
  return 0;
}

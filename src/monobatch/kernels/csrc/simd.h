// Small AVX2 helpers shared by quant_cpu.cpp and cpu_ops.cpp (one definition; both files include it).
// The extension builder's ninja rules record header dependencies (g++ -MMD, deps = gcc), so a
// changed header rebuilds both objects in the next process that loads the module.
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace mb_simd {
// Sum of 8 lanes in a fixed order: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
}  // namespace mb_simd
#endif

// Packed-weight matmuls for CPU (monobatch.kernels.quant_cpu builds and loads this file).
//
// Two resident layouts, both "w = q * scale + min" per group of G consecutive input columns
// (monobatch.quant.formats repacks every GGUF type into one of them, exactly):
//   Q4: q in 0..15, two per byte: qs uint8 [N, K/2]; in each 32-column group, byte j holds
//       column j (low nibble) and column j + 16 (high nibble) (ggml's Q4_0 order); G = 32.
//   Q8: q int8 [N, K]; G = 16 or 32.
//   scale, min: float32 [N, K/G].
//
// gemm:      out[M, N] = x[M, K] @ W^T for few rows (decode), with int16 activations and an integer
//            dot product per group (2026-12-01; before, every weight was converted to float):
//              sx[m, g] = amax_j |x[m, gG + j]| / 32767   (0, or non-finite: see below)
//              xi[m, k] = nearbyint(x[m, k] / sx[m, g])   int16, |xi| <= 32767
//              out[m, n] = sum_g (scale[n, g] * sx[m, g]) * idot(q[n, g], xi[m, g]) + sum_g min[n, g] * xsum[m, g]
//            idot is exact int32 arithmetic (weights widened to int16, _mm256_madd_epi16: Q4
//            15 * 32767 * 2 and Q8 128 * 32767 * 2 a pair, never overflowing), and so is its
//            conversion to float: a lane of a group holds 4 products (Q4: < 2^21; Q8: <= 2^24).
//            Each group's 8 int32 lanes are converted once and FMA'd with the broadcast float
//            scale[n, g] * sx[m, g] into two float accumulators (even and odd groups), summed by
//            hsum at the end. xsum[m, g] is the float sum of the ORIGINAL x over the group (in
//            column order), so the min term is as exact as before; it is summed in 8 lanes
//            (g mod 8) and hsum, then the tail groups in order (min_dot).
//            Error: |x - sx * xi| <= sx / 2 = amax / 65534 per element (the rounding of x / sx
//            aside, ~2^-24 of it), so a group's product moves by at most
//            |scale| * sum_j |q_j| * amax / 65534: ~1.5e-5 of the group's magnitude (float32's own
//            rounding is ~6e-8 a term). That holds where sx and scale * sx are normal floats
//            (amax >= 32767 * FLT_MIN ~ 3.9e-34); below, xi saturates at [-32768, 32767] and the
//            group's error is absolute, < 1e-33 of its weights. A group of zeros has sx = 0 and xi
//            = 0; a group holding NaN or Inf has sx = NaN, so the output row is NaN, as a float
//            product would be. The scalar fallback (no AVX2) runs the same operations lane for
//            lane, so its bits equal the AVX2 path's (checked on random data with a -mno-avx2
//            build); int8 activations (llama.cpp's Q8_0/Q8_1) are not used: see ADR 0006.
//            Each output row is computed by the same sequence of operations whatever M is and
//            whatever the other rows hold (x is quantized per row; batch invariance:
//            --deterministic relies on it).
// dequant:   W[n0:n1, :] as float32, fma(q, scale, min) per element: one rounding, the bits of
//            gguf-py's dequantization (see formats.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "simd.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MB_AVX2 1
#endif

namespace mb_cpu_ops {
// Least work (weights x rows) a thread is given (cpu_ops.cpp holds it, Python sets it): a parallel
// region costs a wake-up of the other threads, which on a busy machine can take a whole scheduler
// slice (ms); the default (128K, see cpu_ops.cpp) splits a decode step's GEMVs, a thread at least
// ~20 us of work.
extern int64_t min_thread_work;
}

namespace {

constexpr int MT = 4;  // x rows per pass over a weight row

#ifdef MB_AVX2
using mb_simd::hsum;  // simd.h

// One 32-column Q4 group as 4 x 8 floats.
inline void unpack_q4(const uint8_t* p, __m256 w[4]) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, m);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// 8 int8 weights as 8 floats.
inline __m256 unpack_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif


// One row of x as int16 per group of G: xi [K] and sx [K / G] (the header's formula).
template <int G>
inline void quant_row(const float* x, int64_t K, int16_t* xi, float* sx) {
  const int64_t ng = K / G;
  for (int64_t g = 0; g < ng; ++g) {
    const float* p = x + g * G;
    float amax = 0.f;
#ifdef MB_AVX2
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 vm = _mm256_and_ps(_mm256_loadu_ps(p), absmask);
    for (int v = 1; v < G / 8; ++v) vm = _mm256_max_ps(vm, _mm256_and_ps(_mm256_loadu_ps(p + 8 * v), absmask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    amax = _mm_cvtss_f32(h);
    // max_ps returns its second operand where either is NaN, so a NaN can be lost: checked apart
    __m256 nanv = _mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p), _CMP_UNORD_Q);
    for (int v = 1; v < G / 8; ++v) nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(_mm256_loadu_ps(p + 8 * v), _mm256_loadu_ps(p + 8 * v), _CMP_UNORD_Q));
    if (_mm256_movemask_ps(nanv)) amax = NAN;
#else
    for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(p[j]));
    for (int j = 0; j < G; ++j)
      if (std::isnan(p[j])) amax = NAN;
#endif
    const float s = amax / 32767.f;
    const bool ok = s > 0.f && amax <= FLT_MAX;  // false: all zeros (or s underflowing), NaN or Inf
    sx[g] = amax <= FLT_MAX ? s : NAN;
#ifdef MB_AVX2
    if (!ok) { std::memset(xi + g * G, 0, G * sizeof(int16_t)); continue; }
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-32768.f), hi = _mm256_set1_ps(32767.f);
    for (int v = 0; v < G / 16; ++v) {
      const __m256 a = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(p + 16 * v), vs), lo), hi);
      const __m256 b = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(p + 16 * v + 8), vs), lo), hi);
      const __m256i q = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xi + g * G + 16 * v), _mm256_permute4x64_epi64(q, 0xD8));
    }
#else
    for (int j = 0; j < G; ++j) {
      const float r = ok ? std::nearbyint(std::min(std::max(p[j] / s, -32768.f), 32767.f)) : 0.f;
      xi[g * G + j] = static_cast<int16_t>(r);
    }
#endif
  }
}

#ifdef MB_AVX2
// One group of weights widened to int16: Q4 2 x 16 (columns 0-15: the low nibbles, 16-31: the
// high), Q8 G / 16 x 16.
template <bool Q4, int G>
inline void wload(const uint8_t* qrow, int64_t g, __m256i w[G / 16]) {
  if (Q4) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * 16)));
    w[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    w[1] = _mm256_srli_epi16(v, 4);
  } else {
    for (int v = 0; v < G / 16; ++v)
      w[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * G + 16 * v)));
  }
}
#endif

// sum_g mn[g] * xs[g]: 8 lanes (g mod 8), hsum, then the tail groups in order.
inline float min_dot(const float* mn, const float* xs, int64_t ng) {
  int64_t g = 0;
  float b;
#ifdef MB_AVX2
  __m256 v = _mm256_setzero_ps();
  for (; g + 8 <= ng; g += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(xs + g), v);
  b = hsum(v);
#else
  float v[8] = {};
  for (; g + 8 <= ng; g += 8) for (int l = 0; l < 8; ++l) v[l] = std::fma(mn[g + l], xs[g + l], v[l]);
  b = mb_simd::hsum8(v);
#endif
  for (; g < ng; ++g) b = std::fma(mn[g], xs[g], b);
  return b;
}

// out rows [m0, m0 + mt) of column n. d: scratch of mt * K / G floats.
template <bool Q4, int G, int mt>
inline void row_dot(const uint8_t* qrow, const float* sc, const float* mn, const int16_t* xi, const float* sx,
                    const float* xsum, int64_t K, int64_t m0, float* out, int64_t N, int64_t n, float* d) {
  const int64_t ng = K / G;
  float acc_s[mt];
#ifdef MB_AVX2
  __m256 acc[2][mt];
  for (int i = 0; i < mt; ++i) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
  // d[i * ng + g] = scale[g] * sx[m0 + i, g]
  for (int i = 0; i < mt; ++i) {
    const float* s = sx + (m0 + i) * ng;
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) _mm256_storeu_ps(d + i * ng + g, _mm256_mul_ps(_mm256_loadu_ps(sc + g), _mm256_loadu_ps(s + g)));
    for (; g < ng; ++g) d[i * ng + g] = sc[g] * s[g];
  }
  auto step = [&](int64_t g, __m256* a) __attribute__((always_inline)) {
    __m256i w[G / 16];
    wload<Q4, G>(qrow, g, w);
    for (int i = 0; i < mt; ++i) {
      const int16_t* xp = xi + (m0 + i) * K + g * G;
      __m256i t = _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
      if (G == 32) t = _mm256_add_epi32(t, _mm256_madd_epi16(w[G / 16 - 1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16))));
      a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_broadcast_ss(d + i * ng + g), a[i]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= ng; g += 2) {
    step(g, acc[0]);
    step(g + 1, acc[1]);
  }
  if (g < ng) step(g, acc[0]);
  for (int i = 0; i < mt; ++i) acc_s[i] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));
#else
  for (int i = 0; i < mt; ++i) {
    float acc[2][8] = {};
    const int16_t* xr = xi + (m0 + i) * K;
    const float* s = sx + (m0 + i) * ng;
    for (int64_t g = 0; g < ng; ++g) {
      const float dg = sc[g] * s[g];
      for (int l = 0; l < 8; ++l) {
        int32_t t = 0;
        for (int h = 0; h < G / 16; ++h)
          for (int e = 0; e < 2; ++e) {
            const int64_t j = h * 16 + 2 * l + e;
            int32_t q;
            if (Q4) { const uint8_t b = qrow[g * 16 + (j % 16)]; q = j < 16 ? (b & 0x0F) : (b >> 4); }
            else q = reinterpret_cast<const int8_t*>(qrow)[g * G + j];
            t += q * xr[g * G + j];
          }
        acc[g & 1][l] = std::fma(static_cast<float>(t), dg, acc[g & 1][l]);
      }
    }
    float v[8];
    for (int l = 0; l < 8; ++l) v[l] = acc[0][l] + acc[1][l];
    acc_s[i] = mb_simd::hsum8(v);
  }
#endif
  for (int i = 0; i < mt; ++i) out[(m0 + i) * N + n] = acc_s[i] + min_dot(mn, xsum + (m0 + i) * ng, ng);
}

// Scalar q of column k in a row of the given layout.
template <bool Q4>
inline float q_at(const uint8_t* row, int64_t k) {
  if (Q4) {
    const uint8_t b = row[(k / 32) * 16 + (k % 16)];
    return static_cast<float>((k % 32) < 16 ? (b & 0x0F) : (b >> 4));
  }
  return static_cast<float>(reinterpret_cast<const int8_t*>(row)[k]);
}

template <bool Q4, int G>
void gemm_impl(const float* x, const uint8_t* qs, const float* sc, const float* mn, float* out,
               int64_t M, int64_t N, int64_t K) {
  const int64_t ng = K / G;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  std::vector<float> xsum(M * ng), sx(M * ng);
  std::vector<int16_t> xi(M * K);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.f;
      for (int j = 0; j < G; ++j) s += x[m * K + g * G + j];
      xsum[m * ng + g] = s;
    }
    quant_row<G>(x + m * K, K, xi.data() + m * K, sx.data() + m * ng);
  }
  const float *xs = xsum.data(), *s = sx.data();
  const int16_t* xq = xi.data();
  const int64_t grain = std::max<int64_t>(1, mb_cpu_ops::min_thread_work / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> d(MT * ng);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qrow = qs + n * row_bytes;
      int64_t m0 = 0;
      for (; m0 + MT <= M; m0 += MT) row_dot<Q4, G, MT>(qrow, sc + n * ng, mn + n * ng, xq, s, xs, K, m0, out, N, n, d.data());
      for (; m0 < M; ++m0) row_dot<Q4, G, 1>(qrow, sc + n * ng, mn + n * ng, xq, s, xs, K, m0, out, N, n, d.data());
    }
  });
}

template <bool Q4, int G>
void dequant_impl(const uint8_t* qs, const float* sc, const float* mn, float* out, int64_t N, int64_t K) {
  const int64_t ng = K / G;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qrow = qs + n * row_bytes;
      float* o = out + n * K;
      for (int64_t g = 0; g < ng; ++g) {
        const float s = sc[n * ng + g], m = mn[n * ng + g];
#ifdef MB_AVX2
        __m256 w[G / 8];
        if (Q4) {
          unpack_q4(qrow + g * 16, w);
        } else {
          for (int v = 0; v < G / 8; ++v) w[v] = unpack_q8(reinterpret_cast<const int8_t*>(qrow) + g * G + v * 8);
        }
        const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
        for (int v = 0; v < G / 8; ++v) _mm256_storeu_ps(o + g * G + 8 * v, _mm256_fmadd_ps(w[v], vs, vm));
#else
        for (int j = 0; j < G; ++j) o[g * G + j] = std::fma(q_at<Q4>(qrow, g * G + j), s, m);
#endif
      }
    }
  });
}

void check(const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn, int64_t K, int64_t G, bool q4) {
  TORCH_CHECK(qs.is_contiguous() && sc.is_contiguous() && mn.is_contiguous(), "packed tensors must be contiguous");
  TORCH_CHECK(sc.scalar_type() == at::kFloat && mn.scalar_type() == at::kFloat, "scale/min must be float32");
  TORCH_CHECK(K % G == 0 && (G == 16 || G == 32) && (!q4 || G == 32), "bad group size");
  TORCH_CHECK(qs.size(1) == (q4 ? K / 2 : K) && sc.size(1) == K / G && mn.sizes() == sc.sizes(), "bad packed shapes");
}

// out = x @ W^T: x float32 [M, K] -> float32 [M, N].
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn,
                   int64_t group, bool q4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = qs.size(0);
  check(qs, sc, mn, K, group, q4);
  auto out = torch::empty({M, N}, xc.options());
  auto q = static_cast<const uint8_t*>(qs.data_ptr());
  if (q4) {
    gemm_impl<true, 32>(xc.data_ptr<float>(), q, sc.data_ptr<float>(), mn.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
  } else if (group == 32) {
    gemm_impl<false, 32>(xc.data_ptr<float>(), q, sc.data_ptr<float>(), mn.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
  } else {
    gemm_impl<false, 16>(xc.data_ptr<float>(), q, sc.data_ptr<float>(), mn.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
  }
  return out;
}

// W as float32 into out [N, K] (contiguous).
void dequant(const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn, int64_t group, bool q4,
             torch::Tensor& out) {
  const int64_t N = qs.size(0), K = out.size(1);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == N, "bad out");
  check(qs, sc, mn, K, group, q4);
  auto q = static_cast<const uint8_t*>(qs.data_ptr());
  if (q4) {
    dequant_impl<true, 32>(q, sc.data_ptr<float>(), mn.data_ptr<float>(), out.data_ptr<float>(), N, K);
  } else if (group == 32) {
    dequant_impl<false, 32>(q, sc.data_ptr<float>(), mn.data_ptr<float>(), out.data_ptr<float>(), N, K);
  } else {
    dequant_impl<false, 16>(q, sc.data_ptr<float>(), mn.data_ptr<float>(), out.data_ptr<float>(), N, K);
  }
}

}  // namespace

namespace mb_cpu_ops {
void register_ops(pybind11::module& m);  // cpu_ops.cpp: the fused ops of a decode step
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &gemm, "out[M, N] = x[M, K] @ W^T for a packed W (float32)");
  m.def("dequant", &dequant, "W as float32 into out [N, K]");
  mb_cpu_ops::register_ops(m);
  m.def("has_avx2", []() {
#ifdef MB_AVX2
    return true;
#else
    return false;
#endif
  });
}

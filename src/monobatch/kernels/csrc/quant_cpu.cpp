// Packed-weight matmuls for CPU (monobatch.kernels.quant_cpu builds and loads this file).
//
// Two resident layouts, both "w = q * scale + min" per group of G consecutive input columns
// (monobatch.quant.formats repacks every GGUF type into one of them, exactly):
//   Q4: q in 0..15, two per byte: qs uint8 [N, K/2]; in each 32-column group, byte j holds
//       column j (low nibble) and column j + 16 (high nibble) (ggml's Q4_0 order); G = 32.
//   Q8: q int8 [N, K]; G = 16 or 32.
//   scale, min: float32 [N, K/G], or both float16 (the loader narrows a tensor's where every value
//       is exact in fp16, as the file's own fp16 d and m are: 2 bytes a group instead of 4). The
//       kernels widen them to float32 (exactly) before use, so a product is the same bits with
//       either storage.
//
// gemm:      out[M, N] = x[M, K] @ W^T for few rows (decode), float32 accumulation:
//            out[m, n] = sum_g scale[n, g] * dot(q[n, g], x[m, g]) + sum_g min[n, g] * xsum[m, g].
//            Each output row is computed by the same sequence of operations whatever M is and
//            whatever the other rows hold (batch invariance; --deterministic relies on it).
// dequant:   W[n0:n1, :] as float32, fma(q, scale, min) per element: one rounding, the bits of
//            gguf-py's dequantization (see formats.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "packed.h"
#include "simd.h"
#if defined(__AVX2__) && defined(__FMA__)
#define MB_AVX2 1
#endif
#if defined(MB_AVX2) || defined(__F16C__)
#include <immintrin.h>
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

// Scalar q of column k in a row of the given layout.
template <bool Q4>
inline float q_at(const uint8_t* row, int64_t k) {
  if (Q4) {
    const uint8_t b = row[(k / 32) * 16 + (k % 16)];
    return static_cast<float>((k % 32) < 16 ? (b & 0x0F) : (b >> 4));
  }
  return static_cast<float>(reinterpret_cast<const int8_t*>(row)[k]);
}

// A scale or min as float32 (float16 widened exactly: F16C's conversion where the machine has it;
// c10::Half's in software is several times slower).
inline float to_f32(float v) { return v; }
inline float to_f32(at::Half v) {
#if defined(__F16C__)
  return _cvtsh_ss(v.x);
#else
  return static_cast<float>(v);
#endif
}

// n float16 scales or mins as float32 into buf, 8 at a time.
inline void widen(const at::Half* p, int64_t n, float* buf) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < n; ++i) buf[i] = to_f32(p[i]);
}

// out rows [m0, m0 + mt) of column n. G: group size; V = G / 8 vectors a group.
template <bool Q4, int G, int mt>
inline void row_dot(const uint8_t* qrow, const float* sc, const float* mn, const float* x, const float* xsum,
                    int64_t K, int64_t m0, float* out, int64_t N, int64_t n) {
  const int64_t ng = K / G;
  float acc_s[mt];
#ifdef MB_AVX2
  // Two accumulators (even and odd groups) and a tree-shaped dot a group: short dependency chains.
  __m256 acc[2][mt];
  for (int i = 0; i < mt; ++i) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 w[G / 8];
    if (Q4) {
      unpack_q4(qrow + g * 16, w);
    } else {
      for (int v = 0; v < G / 8; ++v) w[v] = unpack_q8(reinterpret_cast<const int8_t*>(qrow) + g * G + v * 8);
    }
    const __m256 s = _mm256_broadcast_ss(sc + g);
    for (int i = 0; i < mt; ++i) {
      const float* xp = x + (m0 + i) * K + g * G;
      __m256 t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xp)));
      if (G == 32) {
        const __m256 u = _mm256_fmadd_ps(w[G / 8 - 1], _mm256_loadu_ps(xp + 24), _mm256_mul_ps(w[2 % (G / 8)], _mm256_loadu_ps(xp + 16)));
        t = _mm256_add_ps(t, u);
      }
      acc[g & 1][i] = _mm256_fmadd_ps(t, s, acc[g & 1][i]);
    }
  }
  for (int i = 0; i < mt; ++i) acc_s[i] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));
#else
  for (int i = 0; i < mt; ++i) {
    float a = 0.f;
    const float* xp = x + (m0 + i) * K;
    for (int64_t g = 0; g < ng; ++g) {
      float t = 0.f;
      for (int j = 0; j < G; ++j) t += q_at<Q4>(qrow, g * G + j) * xp[g * G + j];
      a += t * sc[g];
    }
    acc_s[i] = a;
  }
#endif
  for (int i = 0; i < mt; ++i) {
    const float* xs = xsum + (m0 + i) * ng;
    float b = 0.f;
    for (int64_t g = 0; g < ng; ++g) b += mn[g] * xs[g];
    out[(m0 + i) * N + n] = acc_s[i] + b;
  }
}

template <bool Q4, int G, typename S>
void gemm_impl(const float* x, const uint8_t* qs, const S* sc, const S* mn, float* out,
               int64_t M, int64_t N, int64_t K) {
  const int64_t ng = K / G;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  std::vector<float> xsum(M * ng);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.f;
      for (int j = 0; j < G; ++j) s += x[m * K + g * G + j];
      xsum[m * ng + g] = s;
    }
  const float* xs = xsum.data();
  const int64_t grain = std::max<int64_t>(1, mb_cpu_ops::min_thread_work / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // float16 scales and mins are widened WIDEN_ROWS rows at a time into a buffer, well before the
    // rows read them: widening each row just before its dot cost 2-23 % of a GEMV on this Zen 1
    // machine (the fresh 32-byte stores read back at once as 4-byte loads: not forwarded), this
    // 3-7 % (2026-12-03, docs/benchmarks/data/2026-12-03-cpu-rss/speed.txt).
    constexpr int64_t WIDEN_ROWS = 16;
    std::vector<float> wide(std::is_same_v<S, float> ? 0 : 2 * WIDEN_ROWS * ng);
    for (int64_t nb = n0; nb < n1; nb += WIDEN_ROWS) {
      const int64_t ne = std::min(nb + WIDEN_ROWS, n1);
      const float* sb;  // row n's scales: sb + (n - nb) * ng; its mins: mb + (n - nb) * ng
      const float* mb;
      if constexpr (std::is_same_v<S, float>) {
        sb = sc + nb * ng;
        mb = mn + nb * ng;
      } else {
        widen(sc + nb * ng, (ne - nb) * ng, wide.data());
        widen(mn + nb * ng, (ne - nb) * ng, wide.data() + WIDEN_ROWS * ng);
        sb = wide.data();
        mb = wide.data() + WIDEN_ROWS * ng;
      }
      for (int64_t n = nb; n < ne; ++n) {
        const uint8_t* qrow = qs + n * row_bytes;
        const float* s = sb + (n - nb) * ng;
        const float* m = mb + (n - nb) * ng;
        int64_t m0 = 0;
        for (; m0 + MT <= M; m0 += MT) row_dot<Q4, G, MT>(qrow, s, m, x, xs, K, m0, out, N, n);
        for (; m0 < M; ++m0) row_dot<Q4, G, 1>(qrow, s, m, x, xs, K, m0, out, N, n);
      }
    }
  });
}

template <bool Q4, int G, typename S>
void dequant_impl(const uint8_t* qs, const S* sc, const S* mn, float* out, int64_t N, int64_t K) {
  const int64_t ng = K / G;
  const int64_t row_bytes = Q4 ? K / 2 : K;
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qrow = qs + n * row_bytes;
      float* o = out + n * K;
      for (int64_t g = 0; g < ng; ++g) {
        const float s = to_f32(sc[n * ng + g]), m = to_f32(mn[n * ng + g]);
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
  TORCH_CHECK(qs.dim() == 2 && sc.dim() == 2 && (qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar) && sc.size(0) == qs.size(0),
              "packed weights must be (u)int8 [N, bytes] with scales [N, groups]");
  TORCH_CHECK(qs.is_contiguous() && sc.is_contiguous() && mn.is_contiguous(), "packed tensors must be contiguous");
  TORCH_CHECK((sc.scalar_type() == at::kFloat || sc.scalar_type() == at::kHalf) && mn.scalar_type() == sc.scalar_type(),
              "scale/min must be both float32 or both float16");
  TORCH_CHECK(K % G == 0 && (G == 16 || G == 32) && (!q4 || G == 32), "bad group size");
  TORCH_CHECK(qs.size(1) == (q4 ? K / 2 : K) && sc.size(1) == K / G && mn.sizes() == sc.sizes(), "bad packed shapes");
}

}  // namespace

namespace mb_quant {
// out = x @ W^T: x float32 [M, K] -> float32 [M, N].
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn,
                   int64_t group, bool q4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = qs.size(0);
  check(qs, sc, mn, K, group, q4);
  auto out = torch::empty({M, N}, xc.options());
  auto q = static_cast<const uint8_t*>(qs.data_ptr());
  auto run = [&](auto* s, auto* m) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    if (q4) {
      gemm_impl<true, 32, S>(xc.data_ptr<float>(), q, s, m, out.data_ptr<float>(), M, N, K);
    } else if (group == 32) {
      gemm_impl<false, 32, S>(xc.data_ptr<float>(), q, s, m, out.data_ptr<float>(), M, N, K);
    } else {
      gemm_impl<false, 16, S>(xc.data_ptr<float>(), q, s, m, out.data_ptr<float>(), M, N, K);
    }
  };
  if (sc.scalar_type() == at::kHalf) {
    run(sc.data_ptr<at::Half>(), mn.data_ptr<at::Half>());
  } else {
    run(sc.data_ptr<float>(), mn.data_ptr<float>());
  }
  return out;
}

}  // namespace mb_quant

namespace {
// W as float32 into out [N, K] (contiguous).
void dequant(const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn, int64_t group, bool q4,
             torch::Tensor& out) {
  const int64_t N = qs.size(0), K = out.size(1);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == N, "bad out");
  check(qs, sc, mn, K, group, q4);
  auto q = static_cast<const uint8_t*>(qs.data_ptr());
  auto run = [&](auto* s, auto* m) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    if (q4) {
      dequant_impl<true, 32, S>(q, s, m, out.data_ptr<float>(), N, K);
    } else if (group == 32) {
      dequant_impl<false, 32, S>(q, s, m, out.data_ptr<float>(), N, K);
    } else {
      dequant_impl<false, 16, S>(q, s, m, out.data_ptr<float>(), N, K);
    }
  };
  if (sc.scalar_type() == at::kHalf) {
    run(sc.data_ptr<at::Half>(), mn.data_ptr<at::Half>());
  } else {
    run(sc.data_ptr<float>(), mn.data_ptr<float>());
  }
}

}  // namespace

namespace mb_cpu_ops {
void register_ops(pybind11::module& m);  // cpu_ops.cpp: the fused ops of a decode step
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &mb_quant::gemm, "out[M, N] = x[M, K] @ W^T for a packed W (float32)");
  pybind11::class_<mb_quant::PackedMat>(m, "PackedMat", "a packed weight's tensors and layout, for the fused ops")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, bool>());
  m.def("gemm_mat", [](const torch::Tensor& x, const mb_quant::PackedMat& w) { return w.gemm(x); },
        "gemm with a bound PackedMat");
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

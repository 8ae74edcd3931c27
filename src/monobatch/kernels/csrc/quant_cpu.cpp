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
// gemm:      out[M, N] = x[M, K] @ W^T for few rows (decode), with x rounded to int16 per group
//            (the int16-activation GEMV below: exact integer group dots, float32 accumulation):
//            out[m, n] = sum_g scale[n, g] sx[m, g] * idot(q[n, g], xi[m, g]) + sum_g min[n, g] * xsum[m, g],
//            within ~amax/65534 per activation of the float product (bound below; ADR 0006,
//            "int16 activations"). Each output row is computed by the same sequence of operations
//            whatever M is and whatever the other rows hold (batch invariance; --deterministic
//            relies on it).
// gemm_pieces: the deterministic mode's row-parallel pieces (weights over consecutive column
//            ranges of x): each piece's gemm product, summed in piece order, in one pass.
// dequant:   W[n0:n1, :] as float32, fma(q, scale, min) per element: one rounding, the bits of
//            gguf-py's dequantization (see formats.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
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

// ---- The int16-activation GEMV ----------------------------------------------------------------
// Each x row is rounded per weight group (G columns) to int16 (quantize_rows), so a group's dot
// with the small integer weights is exact integer arithmetic (AVX2: _mm256_madd_epi16) and only
// one conversion and one FMA a group and row are float:
//   sx[m, g] = amax_g / 32767 (amax_g = max |x[m, j]| over the group's columns j; float32 division),
//   xi[m, j] = nearbyint(x[m, j] / sx[m, g]) clamped to [-32767, 32767] (round-half-even),
//   out[m, n] = sum_g fl(scale[n, g] * sx[m, g]) * idot(q[n, g], xi[m, g]) + sum_g min[n, g] * xsum[m, g],
// where xsum[m, g] is the float32 sum of the unrounded x over the group (left to right, as the
// float GEMV had it), so the min term sees x exactly.
// Error (ADR 0006, "int16 activations"): |x - sx xi| <= (1/2 + 2^-9) sx per element (the
// division's rounding included), sx <= (amax_g / 32767)(1 + 2^-23) + 2^-150, so the int16 term of
// out[m, n] moves by at most sum_j |scale q_j| (amax_g / 65534 (1 + 2^-7) + 2^-134): ~1.5e-5 of a
// group's magnitude, against float32's ~6e-8 a term. Then float32 rounding of the group products
// and the sums, as any float32 dot: within 2 K 2^-24 sum_j (|scale q_j| + |min|) |x_j|
// (tests/test_quant.py::test_int16_gemv_error_bound checks both against float64 on adversarial rows).
// Exactness of the integer part: |q| <= 128, |xi| <= 32767, so an int32 lane (at most 4 products:
// columns 2l, 2l+1, 16+2l, 17+2l of the group) is below 4 * 128 * 32767 < 2^24: exact in int32
// and in its float32 conversion.
// Edge cases: a group of zeros (or with amax below ~2^-135, where sx rounds to 0) gets sx = 0 and
// xi = 0: its int16 term is 0, an error of at most 32 amax (< 2^-129). A group holding NaN or Inf
// gets sx = 0 and xi = 0 too, and its float sum xsum is NaN or +-Inf, so the row's outputs are
// non-finite (NaN or +-Inf), as the float GEMV's are. Groups below 32767 FLT_MIN (subnormal sx)
// lose sx's relative precision; the clamp keeps xi in int16 and the error within the absolute
// 2^-134 term.
// Float order a row (the same in the 1-row and 4-row passes, and in the scalar fallback, lane for
// lane: batch invariance and one set of bits whatever the build): 8 int32 lanes a group (lane l:
// columns 2l, 2l+1, 16+2l, 17+2l), each converted and FMA'd with the group's fl(scale sx) into
// one of two 8-lane accumulators (even groups, odd groups); hsum(acc_even + acc_odd) (simd.h's
// order); plus the min term: 8-lane FMA sums over groups 8c + l, hsum, then the remaining groups by
// scalar FMA in order.
// The convention follows llama.cpp's quantized activations (ggml's Q8_0/Q8_1 "vec_dot_type": x
// rounded per block with scale amax / 127), with 16 bits instead of 8.

constexpr float I16_MAX = 32767.f;

// Scalar sum of 8 lanes in simd.h's hsum order.
inline float hsum8(const float* v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// x float32 [M, K] -> xi int16 [M, K], sx float32 [M, K/G], xsum float32 [M, K/G] (the header's
// formulas). The AVX2 and scalar paths compute the same bits (elementwise IEEE division, min/max
// and round-to-nearest-even conversion; max is exact in any order).
template <int G, bool V>
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xi, float* sx, float* xsum) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float* p = x + m * K + g * G;
      int16_t* q = xi + m * K + g * G;
      float s = 0.f, amax = 0.f;
      for (int j = 0; j < G; ++j) {
        s += p[j];
        amax = std::max(amax, std::fabs(p[j]));
      }
      xsum[m * ng + g] = s;
      const float d = amax / I16_MAX;
      if (!(amax <= FLT_MAX) || s != s || d == 0.f) {  // Inf (amax), NaN (the sum), zeros / below ~2^-135
        sx[m * ng + g] = 0.f;
        std::memset(q, 0, G * sizeof(int16_t));
        continue;
      }
      sx[m * ng + g] = d;
#ifdef MB_AVX2
      if constexpr (V) {
      const __m256 vd = _mm256_set1_ps(d), hi = _mm256_set1_ps(I16_MAX), lo = _mm256_set1_ps(-I16_MAX);
      for (int v = 0; v < G / 16; ++v) {
        __m256 a = _mm256_div_ps(_mm256_loadu_ps(p + 16 * v), vd);
        __m256 b = _mm256_div_ps(_mm256_loadu_ps(p + 16 * v + 8), vd);
        a = _mm256_min_ps(_mm256_max_ps(a, lo), hi);
        b = _mm256_min_ps(_mm256_max_ps(b, lo), hi);
        const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));  // a0-3 b0-3 a4-7 b4-7
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * v), _mm256_permute4x64_epi64(ab, 0xD8));
      }
      continue;
      }
#endif
      for (int j = 0; j < G; ++j)
        q[j] = static_cast<int16_t>(std::nearbyint(std::min(std::max(p[j] / d, -I16_MAX), I16_MAX)));
    }
}

// The min term of row m: sum_g mn[g] * xs[g] (the header's order).
template <bool V>
inline float min_term(const float* mn, const float* xs, int64_t ng) {
  int64_t g = 0;
  float b;
#ifdef MB_AVX2
  if constexpr (V) {
    __m256 bv = _mm256_setzero_ps();
    for (; g + 8 <= ng; g += 8) bv = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(xs + g), bv);
    b = hsum(bv);
  } else
#endif
  {
    float bv[8] = {};
    for (; g + 8 <= ng; g += 8)
      for (int l = 0; l < 8; ++l) bv[l] = std::fma(mn[g + l], xs[g + l], bv[l]);
    b = hsum8(bv);
  }
  for (; g < ng; ++g) b = std::fma(mn[g], xs[g], b);
  return b;
}

// Integer weight of column j of group g in a row (scalar path).
template <bool Q4, int G>
inline int32_t q_int(const uint8_t* row, int64_t g, int j) {
  if (Q4) {
    const uint8_t b = row[g * 16 + (j % 16)];
    return j < 16 ? (b & 0x0F) : (b >> 4);
  }
  return reinterpret_cast<const int8_t*>(row)[g * G + j];
}

#ifdef MB_AVX2
// Group g's weights as int16: w0 = columns 0..15, w1 = 16..31 (G = 32).
template <bool Q4, int G>
inline void load_w16(const uint8_t* qrow, int64_t g, __m256i& w0, __m256i& w1) {
  if (Q4) {
    // The 16 bytes widened once; each 16-bit lane holds one byte: its low nibble is column j,
    // its high nibble (the lane >> 4, nothing above it) column j + 16.
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * 16)));
    w0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    w1 = _mm256_srli_epi16(v, 4);
  } else {
    const int8_t* p = reinterpret_cast<const int8_t*>(qrow) + g * G;
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (G == 32) w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
}

// acc[i] += cvt(idot(group g, row m0 + i)) * fl(scale sx) for the mt rows. xq, sx: the rows'
// int16 values and group scales from the weight's first column on, ldx and ldg elements a row.
template <bool Q4, int G, int mt>
__attribute__((always_inline)) inline void group_i16(const uint8_t* qrow, const float* sc, const int16_t* xq,
                                                     const float* sx, int64_t ldx, int64_t ldg, int64_t m0, int64_t g,
                                                     __m256 (&acc)[mt]) {
  __m256i w0, w1 = _mm256_setzero_si256();
  load_w16<Q4, G>(qrow, g, w0, w1);
  const float s = sc[g];
  for (int i = 0; i < mt; ++i) {
    const int16_t* xp = xq + (m0 + i) * ldx + g * G;
    __m256i d = _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
    if (G == 32) d = _mm256_add_epi32(d, _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16))));
    const float ws = s * sx[(m0 + i) * ldg + g];
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(ws), acc[i]);
  }
}
#endif

// res[i] = row m0 + i's product with weight row qrow over its ng groups by the int16 GEMV (the
// header's formula and order). xq, sx, xsum: from the weight's first column (group) on, ldx
// (ldg) a row. V: the AVX2 path (where built); else the scalar one, the same bits.
template <bool Q4, int G, int mt, bool V>
inline void row_dot(const uint8_t* qrow, const float* sc, const float* mn, const int16_t* xq, const float* sx,
                    const float* xsum, int64_t ng, int64_t ldx, int64_t ldg, int64_t m0, float* res) {
  float acc_s[mt];
#ifdef MB_AVX2
  if constexpr (V) {
    __m256 a0[mt], a1[mt];
    for (int i = 0; i < mt; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) {  // two groups a step: both accumulators stay in registers
      group_i16<Q4, G, mt>(qrow, sc, xq, sx, ldx, ldg, m0, g, a0);
      group_i16<Q4, G, mt>(qrow, sc, xq, sx, ldx, ldg, m0, g + 1, a1);
    }
    if (g < ng) group_i16<Q4, G, mt>(qrow, sc, xq, sx, ldx, ldg, m0, g, a0);
    for (int i = 0; i < mt; ++i) acc_s[i] = hsum(_mm256_add_ps(a0[i], a1[i]));
  } else
#endif
  {
    for (int i = 0; i < mt; ++i) {
      float a[2][8] = {};
      const int16_t* xr = xq + (m0 + i) * ldx;
      for (int64_t g = 0; g < ng; ++g) {
        const float ws = sc[g] * sx[(m0 + i) * ldg + g];
        for (int l = 0; l < 8; ++l) {
          int32_t d = 0;
          for (int c : {2 * l, 2 * l + 1, 16 + 2 * l, 17 + 2 * l})
            if (c < G) d += q_int<Q4, G>(qrow, g, c) * int32_t(xr[g * G + c]);
          a[g & 1][l] = std::fma(static_cast<float>(d), ws, a[g & 1][l]);
        }
      }
      float v[8];
      for (int l = 0; l < 8; ++l) v[l] = a[0][l] + a[1][l];
      acc_s[i] = hsum8(v);
    }
  }
  for (int i = 0; i < mt; ++i) res[i] = acc_s[i] + min_term<V>(mn, xsum + (m0 + i) * ldg, ng);
}

// One packed weight over input columns [k0, k0 + k) of x (a whole weight: k0 = 0, k = K).
template <typename S>
struct Piece {
  const uint8_t* qs;
  const S* sc;
  const S* mn;
  int64_t k0, k;
};

// out[M, N] = sum over the pieces, in order, of x[:, k0:k0+k] @ W_p^T: each piece's product by the
// int16 GEMV, the first written, each next one added to it in float32 (((p0 + p1) + p2) + ...:
// the bits of the separate products summed by torch's add). x is rounded to int16 once for the
// whole row: its groups are the pieces' groups (every k0 falls on a group), the same values.
template <bool Q4, int G, typename S, bool V>
void gemm_impl(const float* x, const std::vector<Piece<S>>& pieces, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t ng = K / G;
  std::vector<int16_t> xq(M * K);
  std::vector<float> sx(M * ng), xsum(M * ng);
  quantize_rows<G, V>(x, M, K, xq.data(), sx.data(), xsum.data());
  const int64_t np = static_cast<int64_t>(pieces.size());
  const int64_t grain = std::max<int64_t>(1, mb_cpu_ops::min_thread_work / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // float16 scales and mins are widened WIDEN_ROWS rows at a time into a buffer, well before the
    // rows read them: widening each row just before its dot cost 2-23 % of a GEMV on this Zen 1
    // machine (the fresh 32-byte stores read back at once as 4-byte loads: not forwarded), this
    // 3-7 % (2026-12-03, docs/benchmarks/data/2026-12-03-cpu-rss/speed.txt).
    constexpr int64_t WIDEN_ROWS = 16;
    std::vector<float> wide(std::is_same_v<S, float> ? 0 : 2 * WIDEN_ROWS * ng);
    float res[MT];
    for (int64_t nb = n0; nb < n1; nb += WIDEN_ROWS) {
      const int64_t ne = std::min(nb + WIDEN_ROWS, n1);
      for (int64_t pi = 0; pi < np; ++pi) {
        const Piece<S>& P = pieces[pi];
        const int64_t pg = P.k / G, g0 = P.k0 / G, row_bytes = Q4 ? P.k / 2 : P.k;
        const float* sb;  // row n's scales: sb + (n - nb) * pg; its mins: mb + (n - nb) * pg
        const float* mb;
        if constexpr (std::is_same_v<S, float>) {
          sb = P.sc + nb * pg;
          mb = P.mn + nb * pg;
        } else {
          widen(P.sc + nb * pg, (ne - nb) * pg, wide.data());
          widen(P.mn + nb * pg, (ne - nb) * pg, wide.data() + WIDEN_ROWS * ng);
          sb = wide.data();
          mb = wide.data() + WIDEN_ROWS * ng;
        }
        const int16_t* xi = xq.data() + P.k0;
        const float* xd = sx.data() + g0;
        const float* xs = xsum.data() + g0;
        for (int64_t n = nb; n < ne; ++n) {
          const uint8_t* qrow = P.qs + n * row_bytes;
          const float* s = sb + (n - nb) * pg;
          const float* m = mb + (n - nb) * pg;
          int64_t m0 = 0;
          auto put = [&](int mt) {
            for (int i = 0; i < mt; ++i) {
              float& o = out[(m0 + i) * N + n];
              o = pi ? o + res[i] : res[i];
            }
          };
          for (; m0 + MT <= M; m0 += MT) {
            row_dot<Q4, G, MT, V>(qrow, s, m, xi, xd, xs, pg, K, ng, m0, res);
            put(MT);
          }
          for (; m0 < M; ++m0) {
            row_dot<Q4, G, 1, V>(qrow, s, m, xi, xd, xs, pg, K, ng, m0, res);
            put(1);
          }
        }
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

namespace {
// gemm's body; vec: the AVX2 path where built (false: the scalar fallback, for the tests' bitwise
// comparison of the two).
// The pieces' common layout checked, then their product (gemm_impl). K: x's width = the pieces'.
torch::Tensor gemm_any(const torch::Tensor& x, const std::vector<mb_quant::PieceArgs>& ps, int64_t group, bool q4,
                       bool vec) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(!ps.empty(), "no weight");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = ps[0].qs.size(0);
  const bool half = ps[0].sc.scalar_type() == at::kHalf;
  int64_t k0 = 0;
  for (const auto& p : ps) {
    check(p.qs, p.sc, p.mn, p.k, group, q4);
    TORCH_CHECK(p.qs.size(0) == N && (p.sc.scalar_type() == at::kHalf) == half, "pieces differ in rows or scale type");
    k0 += p.k;
  }
  TORCH_CHECK(k0 == K, "the pieces' widths must add up to x's width");
  auto out = torch::empty({M, N}, xc.options());
  auto run = [&](auto tag, auto v) {
    using S = decltype(tag);
    constexpr bool V = decltype(v)::value;
    std::vector<Piece<S>> pieces;
    int64_t lo = 0;
    for (const auto& p : ps) {
      pieces.push_back({static_cast<const uint8_t*>(p.qs.data_ptr()), p.sc.template data_ptr<S>(),
                        p.mn.template data_ptr<S>(), lo, p.k});
      lo += p.k;
    }
    if (q4) {
      gemm_impl<true, 32, S, V>(xc.data_ptr<float>(), pieces, out.data_ptr<float>(), M, N, K);
    } else if (group == 32) {
      gemm_impl<false, 32, S, V>(xc.data_ptr<float>(), pieces, out.data_ptr<float>(), M, N, K);
    } else {
      gemm_impl<false, 16, S, V>(xc.data_ptr<float>(), pieces, out.data_ptr<float>(), M, N, K);
    }
  };
  auto pick = [&](auto v) {
    if (half) {
      run(at::Half{}, v);
    } else {
      run(float{}, v);
    }
  };
  if (vec) {
    pick(std::true_type{});
  } else {
    pick(std::false_type{});
  }
  return out;
}
}  // namespace

namespace mb_quant {
// out = x @ W^T: x float32 [M, K] -> float32 [M, N], by the int16-activation GEMV (the header's
// formula, error bound and order; every row alone: batch invariant).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn,
                   int64_t group, bool q4) {
  TORCH_CHECK(x.dim() == 2, "x must be float32 [M, K]");
  return gemm_any(x, {{qs, sc, mn, x.size(1)}}, group, q4, true);
}

// The sum of pieces' products over consecutive column ranges of x, in piece order, in one pass
// (gemm_impl); the pieces share one layout.
torch::Tensor gemm_pieces(const torch::Tensor& x, const std::vector<PieceArgs>& pieces, int64_t group, bool q4) {
  return gemm_any(x, pieces, group, q4, true);
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
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, bool>())
      .def_static("concat", [](std::vector<mb_quant::PackedMat> parts) {
        return mb_quant::PackedMat(mb_quant::PackedMat::CONCAT, std::move(parts), {});
      }, "parts over consecutive output rows: their products concatenated")
      .def_static("pieces", [](std::vector<mb_quant::PackedMat> parts, std::vector<int64_t> widths) {
        return mb_quant::PackedMat(mb_quant::PackedMat::PIECES, std::move(parts), std::move(widths));
      }, "pieces over consecutive input columns of these widths: their products summed in order");
  m.def("gemm_mat", [](const torch::Tensor& x, const mb_quant::PackedMat& w) { return w.gemm(x); },
        "gemm with a bound PackedMat");
  m.def("gemm_scalar", [](const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc,
                          const torch::Tensor& mn, int64_t group, bool q4) {
    TORCH_CHECK(x.dim() == 2, "x must be float32 [M, K]");
    return gemm_any(x, {{qs, sc, mn, x.size(1)}}, group, q4, false);
  }, "gemm by the scalar fallback (the no-AVX2 build's path), in any build: its bits are gemm's");
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

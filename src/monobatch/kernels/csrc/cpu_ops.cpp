// Fused float32 CPU ops of a decode step (monobatch.kernels.cpu_ops wraps them; built into the
// same extension as quant_cpu.cpp, which registers them).
//
// A B=1 decode step of a small model is hundreds of tiny torch ops (RMSNorm is six, RoPE five a
// tensor, a paged-KV attention a gather of every key and value plus a flash-attention call): each
// costs microseconds of dispatch for nanoseconds of arithmetic. These do each job in one call:
//   rms_norm / add_rms_norm: y = w * (x / sqrt(mean(x^2) + eps)) (Zhang & Sennrich 2019), with the
//       residual add s = x + d folded in;
//   rope_qk_: HF's rotate_half RoPE of q and k in place, inside the packed qkv projection;
//   silu_mul: silu(g) * u of the packed gate/up projection (SwiGLU, Shazeer 2020);
//   gelu_tanh_mul: gelu_tanh(g) * u of it (GeGLU: Gemma);
//   attention: store a step's new K/V rows in the cache, then causal attention of query rows
//       over their sequence's keys read in place through a block table (no gather, no copy).
// Every output row is computed alone, by the same operations in the same order whatever the
// other rows are (the deterministic mode's batch invariance, ADR 0002): an attention row
// depends only on its query and the keys it sees, never on its chunk or step.
//
// exp: Cephes' expf (S. Moshier): e^x = 2^n e^r, r = x - n ln2 (ln2 in two parts), e^r = 1 + r +
// r^2 P(r) with P of degree 5; about 1 ulp in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include "packed.h"
#include "simd.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MBO_AVX2 1
#endif

namespace mb_cpu_ops {

// Least multiply-adds (weights x rows for the GEMV) a thread is given, here and in quant_cpu.cpp:
// a parallel region's wake-up can cost more than a small op takes on one core (a scheduler slice
// on a busy machine). 128K (~20 us of GEMV on one core): on an idle 2-core machine with libgomp's
// spin-then-sleep wait, splitting every decode GEMV made -t 2 decode 1.3-1.5x faster than 2M did
// (which kept them on one thread; ADR 0006). Set from Python (MONOBATCH_CPU_MIN_THREAD_WORK).
int64_t min_thread_work = int64_t(1) << 17;

namespace {

constexpr float EXP_HI = 88.0f, EXP_LO = -87.3365478515625f;
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

inline float exp_scalar(float x) {
  x = std::min(std::max(x, EXP_LO), EXP_HI);
  const float n = std::nearbyint(x * LOG2E);
  float r = std::fma(-n, LN2_HI, x);
  r = std::fma(-n, LN2_LO, r);
  float p = std::fma(std::fma(std::fma(std::fma(std::fma(P0, r, P1), r, P2), r, P3), r, P4), r, P5);
  p = std::fma(p, r * r, r + 1.0f);
  return std::ldexp(p, static_cast<int>(n));
}

#ifdef MBO_AVX2
using mb_simd::hsum;  // simd.h

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp_scalar on 8 lanes (the same operations, so a lane equals exp_scalar of it).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(P0), r, _mm256_set1_ps(P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// sum_i a[i] * b[i], float32, 8 lanes then a fixed tree (n any).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef MBO_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// y += a * x (n any).
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef MBO_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

// One row: y = w * (s / sqrt(mean(s^2) + eps)).
inline void norm_row(const float* s, const float* w, float* y, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(dot(s, s, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
#ifdef MBO_AVX2
  const __m256 vi = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(s + i), vi)));
#endif
  for (; i < n; ++i) y[i] = w[i] * (s[i] * inv);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              " must be float32 [T, n] with contiguous rows");
}

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, min_thread_work / std::max<int64_t>(1, work_per_item));
}

}  // namespace

// RMSNorm of each row: x float32 [T, D] (rows contiguous), w [D] -> new [T, D].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(1), "bad norm weight");
  const int64_t T = x.size(0), D = x.size(1), sx = x.stride(0);
  auto y = torch::empty({T, D}, x.options());
  const float *px = x.data_ptr<float>(), *pw = w.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, T, grain_for(3 * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(px + t * sx, pw, py + t * D, D, static_cast<float>(eps));
  });
  return y;
}

// Residual add then RMSNorm: x, d float32 [T, D] -> (s = x + d, rms_norm(s)), both new [T, D].
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& d, const torch::Tensor& w,
                                        double eps) {
  check_rows(x, "x");
  check_rows(d, "delta");
  TORCH_CHECK(d.sizes() == x.sizes(), "x and delta differ in shape");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(1), "bad norm weight");
  const int64_t T = x.size(0), D = x.size(1), sx = x.stride(0), sd = d.stride(0);
  auto s = torch::empty({T, D}, x.options());
  auto y = torch::empty({T, D}, x.options());
  const float *px = x.data_ptr<float>(), *pd = d.data_ptr<float>(), *pw = w.data_ptr<float>();
  float *ps = s.data_ptr<float>(), *py = y.data_ptr<float>();
  at::parallel_for(0, T, grain_for(4 * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* srow = ps + t * D;
      for (int64_t i = 0; i < D; ++i) srow[i] = px[t * sx + i] + pd[t * sd + i];
      norm_row(srow, pw, py + t * D, D, static_cast<float>(eps));
    }
  });
  return {s, y};
}

// RoPE (HF rotate_half layout) of the first `heads` head_dim-wide column blocks of each row of
// qkv float32 [T, W] (q's heads then k's), in place: for i < hd/2, with c = cos[t], s = sin[t]:
//   x'[i] = x[i] c[i] - x[i + hd/2] s[i],   x'[i + hd/2] = x[i + hd/2] c[i + hd/2] + x[i] s[i + hd/2].
void rope_qk_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t hd) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t T = qkv.size(0), half = hd / 2;
  TORCH_CHECK(hd % 2 == 0 && heads * hd <= qkv.size(1) && cos.size(0) == T && sin.size(0) == T &&
              cos.size(1) == hd && sin.size(1) == hd, "bad RoPE shapes");
  float* p = qkv.data_ptr<float>();
  const float *pc = cos.data_ptr<float>(), *psn = sin.data_ptr<float>();
  const int64_t sq = qkv.stride(0), sc = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, grain_for(3 * heads * hd), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = pc + t * sc, *s = psn + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = p + t * sq + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// A gated product: gate_up float32 [T, 2F] (gate then up) -> act(gate) * up, new [T, F], where
// Act::lanes (8 AVX2 lanes) and Act::one (the scalar tail) compute act by the same operations, so an
// element's bits do not depend on its place in the row or on the row count; Act::work: the flops an
// element (the parallel grain).
template <class Act>
torch::Tensor gated_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2, sg = gate_up.stride(0);
  TORCH_CHECK(gate_up.size(1) == 2 * F, "gate_up must have an even width");
  auto y = torch::empty({T, F}, gate_up.options());
  const float* pg = gate_up.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, T, grain_for(Act::work * F), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = pg + t * sg, *u = g + F;
      float* o = py + t * F;
      int64_t i = 0;
#ifdef MBO_AVX2
      for (; i + 8 <= F; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(Act::lanes(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
#endif
      for (; i < F; ++i) o[i] = Act::one(g[i]) * u[i];
    }
  });
  return y;
}

// SiLU (SwiGLU's gate): silu(g) = g / (1 + e^-g).
struct Silu {
  static constexpr int64_t work = 8;
#ifdef MBO_AVX2
  static __m256 lanes(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  }
#endif
  static float one(float g) { return g / (1.0f + exp_scalar(-g)); }
};

// gelu_tanh (Gemma's GeGLU gate, HF's gelu_pytorch_tanh): g / 2 (1 + tanh(u)) = g / (1 + e^(-2u)),
// u = sqrt(2/pi) (g + 0.044715 g^3) (1/2 (1 + tanh(u)) = sigmoid(2u) exactly, so e^ is the only
// function); -2u = K0 * (g + K1 * g^3): g^3 as (g * g) * g, then the multiply-add and the multiply.
struct GeluTanh {
  static constexpr int64_t work = 16;
  static constexpr float K0 = -1.5957691216057308f, K1 = 0.044715f;  // -2 sqrt(2/pi), the cubic's coefficient
#ifdef MBO_AVX2
  static __m256 lanes(__m256 g) {
    const __m256 c = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(K0), _mm256_fmadd_ps(_mm256_set1_ps(K1), c, g)));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  }
#endif
  static float one(float g) { return g / (1.0f + exp_scalar(K0 * std::fma(K1, (g * g) * g, g))); }
};

// SwiGLU's product: gate_up float32 [T, 2F] (gate then up) -> silu(gate) * up, new [T, F].
torch::Tensor silu_mul(const torch::Tensor& gate_up) { return gated_mul<Silu>(gate_up); }

// GeGLU's product (Gemma): gate_up float32 [T, 2F] (gate then up) -> gelu_tanh(gate) * up, new [T, F].
torch::Tensor gelu_tanh_mul(const torch::Tensor& gate_up) { return gated_mul<GeluTanh>(gate_up); }

// Store a step's new K/V rows, then attend query rows over the cache in place.
//   q      float32 [T, H, hd] (head rows contiguous; any token stride), H = g * KV heads;
//   k, v   float32 [T, K, hd] new rows (same layout rules), written to slots `write` (int64 [T]);
//   k_cache, v_cache float32 [slots, K, hd] contiguous;
//   rows   int64 [R, 3]: (row of q, its position p, offset of its sequence's block table in
//          `tables`); tables int32: block ids; position j of that sequence is at slot
//          tables[off + j / block_size] * block_size + j % block_size;
//   window 0: the row sees positions 0..p; > 0: max(0, p - window + 1)..p;
//   out    float32 [T, H, hd] contiguous: the rows in `rows` are written; None: a new one
//          (torch::empty; every row of it should be in `rows`). Returned.
// Softmax scale 1/sqrt(hd). Per (row, KV head): the g query heads' scores over every key, their
// max, e^(s - max), the sum, then sum_j e_j v_j / sum — one fixed order whatever else runs.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                        torch::Tensor& v_cache, const torch::Tensor& write, const torch::Tensor& rows,
                        const torch::Tensor& tables, int64_t block_size, int64_t window,
                        const c10::optional<torch::Tensor>& out_) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "q, k, v and the caches are [*, heads, head_dim]");
  torch::Tensor out = out_.has_value() ? *out_ : torch::empty(q.sizes(), q.options());
  const std::vector<const torch::Tensor*> all = {&q, &k, &v, &k_cache, &v_cache, &out};
  for (const torch::Tensor* t : all)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "attention tensors must be float32 with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(), "caches and out contiguous");
  const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), KV = k_cache.size(1);
  TORCH_CHECK(H % KV == 0 && k_cache.size(2) == hd && k.size(1) == KV && k.size(2) == hd && v.sizes() == k.sizes() &&
              v_cache.sizes() == k_cache.sizes() && out.sizes() == q.sizes() && k.size(0) == T, "attention shapes");
  TORCH_CHECK(write.scalar_type() == at::kLong && write.is_contiguous() && write.numel() == T, "write: int64 [T]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 2 && rows.size(1) == 3,
              "rows: int64 [R, 3]");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous(), "tables: int32");
  TORCH_CHECK(block_size > 0 && window >= 0, "bad block size or window");
  const int64_t slots = k_cache.size(0), g = H / KV, R = rows.size(0), nt = tables.numel();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>(), *po = out.data_ptr<float>();
  const float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
  const int64_t *pw = write.data_ptr<int64_t>(), *pr = rows.data_ptr<int64_t>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int64_t row_elems = KV * hd;
  int64_t max_keys = 0;  // every index checked before anything is written
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pw[t] >= 0 && pw[t] < slots, "write slot out of range");
  for (int64_t r = 0; r < R; ++r) {
    const int64_t p = pr[3 * r + 1], lo = window ? std::max<int64_t>(0, p - window + 1) : 0;
    TORCH_CHECK(pr[3 * r] >= 0 && pr[3 * r] < T && p >= 0 && pr[3 * r + 2] >= 0 &&
                pr[3 * r + 2] + p / block_size < nt, "attention row out of range");
    for (int64_t b = lo / block_size; b <= p / block_size; ++b) {
      const int64_t blk = tb[pr[3 * r + 2] + b];
      TORCH_CHECK(blk >= 0 && (blk + 1) * block_size <= slots, "block id out of range");
    }
    max_keys = std::max(max_keys, p + 1 - lo);
  }
  for (int64_t t = 0; t < T; ++t) {  // the step's keys and values first: rows attend to their own
    std::copy(pk + t * k.stride(0), pk + t * k.stride(0) + row_elems, kc + pw[t] * row_elems);
    std::copy(pv + t * v.stride(0), pv + t * v.stride(0) + row_elems, vc + pw[t] * row_elems);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, R * KV, grain_for(2 * g * hd * std::max<int64_t>(1, max_keys)), [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(g * max_keys), inv(g);
    std::vector<int64_t> slot(max_keys);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / KV, kh = item % KV;
      const int64_t row = pr[3 * r], p = pr[3 * r + 1], off = pr[3 * r + 2];
      const int64_t lo = window ? std::max<int64_t>(0, p - window + 1) : 0, S = p + 1 - lo;
      for (int64_t j = 0; j < S; ++j) {
        const int64_t pos = lo + j;
        slot[j] = int64_t(tb[off + pos / block_size]) * block_size + pos % block_size;
      }
      const float* q0 = pq + row * q.stride(0) + kh * g * hd;  // query head kh * g + h at q0 + h * hd
      for (int64_t j = 0; j < S; ++j) {  // scores: each key read once for the group's g heads
        const float* kj = kc + slot[j] * row_elems + kh * hd;
        for (int64_t h = 0; h < g; ++h) sc[h * S + j] = dot(q0 + h * hd, kj, hd) * scale;
      }
      for (int64_t h = 0; h < g; ++h) {  // softmax of query head kh * g + h
        float* srow = sc.data() + h * S;
        float m = -INFINITY;
        int64_t j = 0;
#ifdef MBO_AVX2
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= S; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(srow + j));
        m = hmax(vm);
#endif
        for (; j < S; ++j) m = std::max(m, srow[j]);
        float sum = 0.f;
        j = 0;
#ifdef MBO_AVX2
        const __m256 vmax = _mm256_set1_ps(m);
        __m256 vs = _mm256_setzero_ps();
        for (; j + 8 <= S; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + j), vmax));
          _mm256_storeu_ps(srow + j, e);
          vs = _mm256_add_ps(vs, e);
        }
        sum = hsum(vs);
#endif
        for (; j < S; ++j) {
          srow[j] = exp_scalar(srow[j] - m);
          sum += srow[j];
        }
        inv[h] = 1.0f / sum;
      }
      // o_h = sum_j e_hj v_j, each element by fma in key order (axpy's operations), then * 1/sum
      float* o0 = po + (row * H + kh * g) * hd;  // head kh * g + h at o0 + h * hd
      const float* v0 = vc + kh * hd;
      int64_t d0 = 0;
#ifdef MBO_AVX2
      // 32 columns of up to 3 heads in registers while the keys stream by: each value row read
      // once for the heads, no load and store of o a key
      for (; d0 + 32 <= hd; d0 += 32)
        for (int64_t h0 = 0; h0 < g; h0 += 3) {
          const int64_t nh = std::min<int64_t>(3, g - h0);
          __m256 acc[3][4];
          for (int a = 0; a < 3; ++a)
            for (int c = 0; c < 4; ++c) acc[a][c] = _mm256_setzero_ps();
          for (int64_t j = 0; j < S; ++j) {
            const float* vj = v0 + slot[j] * row_elems + d0;
            const __m256 x0 = _mm256_loadu_ps(vj), x1 = _mm256_loadu_ps(vj + 8), x2 = _mm256_loadu_ps(vj + 16),
                         x3 = _mm256_loadu_ps(vj + 24);
            for (int64_t a = 0; a < nh; ++a) {
              const __m256 e = _mm256_set1_ps(sc[(h0 + a) * S + j]);
              acc[a][0] = _mm256_fmadd_ps(e, x0, acc[a][0]);
              acc[a][1] = _mm256_fmadd_ps(e, x1, acc[a][1]);
              acc[a][2] = _mm256_fmadd_ps(e, x2, acc[a][2]);
              acc[a][3] = _mm256_fmadd_ps(e, x3, acc[a][3]);
            }
          }
          for (int64_t a = 0; a < nh; ++a)
            for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o0 + (h0 + a) * hd + d0 + 8 * c, acc[a][c]);
        }
#endif
      for (int64_t h = 0; h < g; ++h) {  // the columns left (all of them without AVX2)
        float* o = o0 + h * hd;
        std::fill(o + d0, o + hd, 0.f);
        for (int64_t j = 0; j < S; ++j) axpy(sc[h * S + j], v0 + slot[j] * row_elems + d0, o + d0, hd - d0);
        for (int64_t d = 0; d < hd; ++d) o[d] *= inv[h];
      }
    }
  });
  return out;
}

// Fused entry points of a Llama-style decode layer (issue 17's host work: a B=1 step was ~30 small
// calls a layer, each microseconds of Python and dispatch). Each runs the functions above and the
// packed GEMV (mb_quant::gemm) in the order the unfused layer calls them, on the same values: the
// results are bitwise those of the separate calls; only the intermediates stay in C++.
//
// add_norm_qkv_rope: s = x + d (d given) or x, h = rms_norm(s), qkv = h @ Wqkv^T, RoPE of q's and
// k's heads (H + K) of qkv in place -> (s [T, D], q [T, H, hd], k, v [T, K, hd]): q, k, v views
// of qkv's columns (as the unfused layer's split and views).
std::vector<torch::Tensor> add_norm_qkv_rope(const torch::Tensor& x, const c10::optional<torch::Tensor>& d,
                                             const torch::Tensor& w, double eps, const mb_quant::PackedMat& qkv_w,
                                             const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads,
                                             int64_t n_kv, int64_t hd) {
  torch::Tensor s = x, h;
  if (d.has_value()) {
    auto sy = add_rms_norm(x, *d, w, eps);
    s = sy[0];
    h = sy[1];
  } else {
    h = rms_norm(x, w, eps);
  }
  torch::Tensor qkv = qkv_w.gemm(h);
  TORCH_CHECK(qkv.size(1) == (n_heads + 2 * n_kv) * hd, "qkv width is not (H + 2K) hd");
  rope_qk_(qkv, cos, sin, n_heads + n_kv, hd);
  const int64_t T = qkv.size(0);
  return {s, qkv.narrow(1, 0, n_heads * hd).view({T, n_heads, hd}),
          qkv.narrow(1, n_heads * hd, n_kv * hd).view({T, n_kv, hd}),
          qkv.narrow(1, (n_heads + n_kv) * hd, n_kv * hd).view({T, n_kv, hd})};
}

// o_add_norm_mlp: o = a @ Wo^T, (s, h) = add_rms_norm(x, o), y = silu_mul(h @ Wgu^T) @ Wdown^T
// -> (s, y) ([T, D] each): o_proj, the attention line's add, the post-attention norm, SwiGLU.
// a: [T, H*hd], or the attention's [T, H, hd] (flattened here).
std::vector<torch::Tensor> o_add_norm_mlp(const torch::Tensor& x, const torch::Tensor& a,
                                          const mb_quant::PackedMat& o_w, const torch::Tensor& w, double eps,
                                          const mb_quant::PackedMat& gate_up_w, const mb_quant::PackedMat& down_w) {
  auto sh = add_rms_norm(x, o_w.gemm(a.dim() == 3 ? a.flatten(1) : a), w, eps);
  return {sh[0], down_w.gemm(silu_mul(gate_up_w.gemm(sh[1])))};
}

// LayerChain: a model's decode layers, each add_norm_qkv_rope -> attention -> o_add_norm_mlp as
// the Python layer calls them (DecoderLayer.forward: the residual add folded into each norm), run
// one after another in one call. The layers' fixed arguments (weights, norms, shapes, the layer's
// KV cache and window) are bound once (add); a call passes the step's residual stream, RoPE rows
// and the attention's per-group inputs. The calls, their order and their arguments are the
// per-layer route's, so the bits are too; what goes is ~3 Python calls a layer (issue 17: a B=1
// step's host time, ~2 ms of a ~9 ms CPU decode step of the bundled model).
struct ChainLayer {
  torch::Tensor attn_norm;
  double attn_eps;
  mb_quant::PackedMat qkv;
  int64_t n_heads, n_kv, hd, group;
  torch::Tensor k_cache, v_cache;
  int64_t window;
  mb_quant::PackedMat o;
  torch::Tensor mlp_norm;
  double mlp_eps;
  mb_quant::PackedMat gate_up, down;
};

struct LayerChain {
  std::vector<ChainLayer> layers;

  void add(torch::Tensor attn_norm, double attn_eps, mb_quant::PackedMat qkv, int64_t n_heads, int64_t n_kv,
           int64_t hd, int64_t group, torch::Tensor k_cache, torch::Tensor v_cache, int64_t window,
           mb_quant::PackedMat o, torch::Tensor mlp_norm, double mlp_eps, mb_quant::PackedMat gate_up,
           mb_quant::PackedMat down) {
    TORCH_CHECK(group >= 0 && window >= 0, "bad layer group or window");
    layers.push_back({std::move(attn_norm), attn_eps, std::move(qkv), n_heads, n_kv, hd, group, std::move(k_cache),
                      std::move(v_cache), window, std::move(o), std::move(mlp_norm), mlp_eps, std::move(gate_up),
                      std::move(down)});
  }

  // x: [T, D] the embeddings (the first layer's residual, nothing to add); cos, sin: [T, hd];
  // write, rows, tables: per layer group, attention's arguments of the same names. -> (s, y):
  // the last layer's residual stream and MLP output, [T, D] each (the final norm adds them).
  std::vector<torch::Tensor> run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const std::vector<torch::Tensor>& write, const std::vector<torch::Tensor>& rows,
                                 const std::vector<torch::Tensor>& tables, int64_t block_size) {
    TORCH_CHECK(!layers.empty(), "an empty layer chain");
    TORCH_CHECK(write.size() == rows.size() && rows.size() == tables.size(), "one write, rows, tables a group");
    torch::Tensor s = x;
    c10::optional<torch::Tensor> d;
    for (ChainLayer& L : layers) {
      TORCH_CHECK(L.group < static_cast<int64_t>(write.size()), "layer group out of range");
      auto p = add_norm_qkv_rope(s, d, L.attn_norm, L.attn_eps, L.qkv, cos, sin, L.n_heads, L.n_kv, L.hd);
      auto a = attention(p[1], p[2], p[3], L.k_cache, L.v_cache, write[L.group], rows[L.group], tables[L.group],
                         block_size, L.window, c10::nullopt);
      auto sy = o_add_norm_mlp(p[0], a, L.o, L.mlp_norm, L.mlp_eps, L.gate_up, L.down);
      s = sy[0];
      d = sy[1];
    }
    return {s, *d};
  }
};

void register_ops(pybind11::module& m) {
  m.def("set_min_thread_work", [](int64_t n) { min_thread_work = std::max<int64_t>(1, n); },
        "least work (multiply-adds) per thread of a parallel op");
  m.def("min_thread_work", []() { return min_thread_work; });
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32)");
  m.def("add_rms_norm", &add_rms_norm, "(x + d, RMSNorm(x + d)) (float32)");
  m.def("rope_qk_", &rope_qk_, "RoPE of q and k inside the packed qkv rows, in place (float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of the packed gate/up rows (float32)");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up of the packed gate/up rows (float32)");
  m.def("add_norm_qkv_rope", &add_norm_qkv_rope, "(x + d or x, RoPE(rms_norm(.) @ Wqkv^T)) (float32)");
  m.def("o_add_norm_mlp", &o_add_norm_mlp, "(x + a @ Wo^T, SwiGLU MLP of its RMSNorm) (float32)");
  m.def("attention", &attention, "store new K/V, then causal attention over a block-table cache (float32)");
  pybind11::class_<LayerChain>(m, "LayerChain", "a model's decode layers run in one call (the fused routes in order)")
      .def(pybind11::init<>())
      .def("add", &LayerChain::add, "bind one more layer's fixed arguments")
      // the GIL is released for the step (only tensors are touched): the server's event loop and
      // tokenizer threads run meanwhile, as they did between the per-layer calls
      .def("run", &LayerChain::run, "the layers over a step's rows -> (residual, MLP output)",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("__len__", [](const LayerChain& c) { return c.layers.size(); });
}

}  // namespace mb_cpu_ops

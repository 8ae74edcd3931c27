// The packed GEMV as cpu_ops.cpp's fused decode-step entry points call it (one definition, in
// quant_cpu.cpp), and the handle those entry points take for a weight.
#pragma once
#include <torch/extension.h>
#include <vector>

namespace mb_quant {
// out = x @ W^T: x float32 [M, K] -> new float32 [M, N] (quant_cpu.cpp's header: layouts, numerics).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn,
                   int64_t group, bool q4);

// One piece of a row-parallel product: a packed weight [N, k] over k consecutive columns of x.
struct PieceArgs {
  torch::Tensor qs, sc, mn;
  int64_t k;
};
// out = ((x[:, 0:k0] @ W0^T + x[:, k0:k0+k1] @ W1^T) + ...): the pieces (one layout, widths adding
// up to x's) in one pass, each product gemm's bits and the sums in piece order (quant_cpu.cpp).
torch::Tensor gemm_pieces(const torch::Tensor& x, const std::vector<PieceArgs>& pieces, int64_t group, bool q4);

// One packed weight's tensors and layout, bound once (Python: monobatch_quant_cpu.PackedMat), so a
// fused call passes one argument a weight instead of five. Or a weight made of several, as the
// unfused Python layer computes it (same calls, same order, so the same bits):
//   CONCAT: parts over consecutive output rows (a fused projection of mixed types, e.g. a Q4_K_M
//       file's Q4_K q/k beside its Q6_K v): each part's product, concatenated (PackedWeight.matmul);
//   PIECES: parts over consecutive input columns of `widths` (the deterministic mode's row-parallel
//       pieces, monobatch.distributed.sharding.RowParallelLinear): each piece's product of its
//       columns of x, summed in piece order ((p0 + p1) + p2) + ... (ADR 0007).
struct PackedMat {
  enum Kind { ONE, CONCAT, PIECES };
  Kind kind = ONE;
  torch::Tensor qs, scale, minimum;
  int64_t group = 0;
  bool q4 = false;
  std::vector<PackedMat> parts;
  std::vector<int64_t> widths;
  PackedMat(torch::Tensor qs_, torch::Tensor scale_, torch::Tensor minimum_, int64_t group_, bool q4_)
      : qs(std::move(qs_)), scale(std::move(scale_)), minimum(std::move(minimum_)), group(group_), q4(q4_) {}
  PackedMat(Kind kind_, std::vector<PackedMat> parts_, std::vector<int64_t> widths_)
      : kind(kind_), parts(std::move(parts_)), widths(std::move(widths_)) {
    TORCH_CHECK(!parts.empty(), "a combined PackedMat needs parts");
    TORCH_CHECK(kind != PIECES || widths.size() == parts.size(), "one width a piece");
  }
  torch::Tensor gemm(const torch::Tensor& x) const {
    if (kind == ONE) return mb_quant::gemm(x, qs, scale, minimum, group, q4);
    if (kind == CONCAT) {
      std::vector<torch::Tensor> ys;
      for (const PackedMat& p : parts) ys.push_back(p.gemm(x));
      return torch::cat(ys, 1);
    }
    bool one_pass = true;  // pieces of one layout and scale type: one pass (gemm_pieces), the same bits
    for (const PackedMat& p : parts)
      one_pass = one_pass && p.kind == ONE && p.group == parts[0].group && p.q4 == parts[0].q4 &&
                 p.scale.scalar_type() == parts[0].scale.scalar_type();
    if (one_pass) {
      std::vector<PieceArgs> args;
      for (size_t i = 0; i < parts.size(); ++i)
        args.push_back({parts[i].qs, parts[i].scale, parts[i].minimum, widths[i]});
      return gemm_pieces(x, args, parts[0].group, parts[0].q4);
    }
    torch::Tensor y;
    int64_t lo = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      TORCH_CHECK(lo + widths[i] <= x.size(1), "pieces wider than x");
      torch::Tensor p = parts[i].gemm(x.narrow(1, lo, widths[i]));
      y = i ? y + p : p;
      lo += widths[i];
    }
    TORCH_CHECK(lo == x.size(1), "pieces narrower than x");
    return y;
  }
};
}  // namespace mb_quant

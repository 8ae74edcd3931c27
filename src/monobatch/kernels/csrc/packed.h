// The packed GEMV as cpu_ops.cpp's fused decode-step entry points call it (one definition, in
// quant_cpu.cpp), and the handle those entry points take for a weight.
#pragma once
#include <torch/extension.h>

namespace mb_quant {
// out = x @ W^T: x float32 [M, K] -> new float32 [M, N] (quant_cpu.cpp's header: layouts, numerics).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, const torch::Tensor& mn,
                   int64_t group, bool q4);

// One packed weight's tensors and layout, bound once (Python: monobatch_quant_cpu.PackedMat), so a
// fused call passes one argument a weight instead of five.
struct PackedMat {
  torch::Tensor qs, scale, minimum;
  int64_t group;
  bool q4;
  PackedMat(torch::Tensor qs_, torch::Tensor scale_, torch::Tensor minimum_, int64_t group_, bool q4_)
      : qs(std::move(qs_)), scale(std::move(scale_)), minimum(std::move(minimum_)), group(group_), q4(q4_) {}
  torch::Tensor gemm(const torch::Tensor& x) const { return mb_quant::gemm(x, qs, scale, minimum, group, q4); }
};
}  // namespace mb_quant

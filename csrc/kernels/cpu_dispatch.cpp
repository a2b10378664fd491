// The fused ops' CPU kernels: each calls the copy of csrc/kernels/cpu/ built for the widest
// instruction set torch itself runs on this CPU (kernels/cpu/kernels.h).
#include <ATen/Version.h>
#include <torch/library.h>

#include "kernels/cpu/kernels.h"

namespace torchpar::kernels::cpu {

const CpuKernels& kernels() {
  static const CpuKernels* const chosen = [] {
#if defined(TORCHPAR_HAVE_AVX512)
    if (at::get_cpu_capability() == "AVX512") return &AVX512::kKernels;
#endif
    return &AVX2::kKernels;
  }();
  return *chosen;
}

namespace {

using at::Tensor;

Tensor3 layer_norm_fwd(const Tensor& input, c10::IntArrayRef shape, const OptTensor& weight,
                       const OptTensor& bias, double eps) {
  return kernels().layer_norm_fwd(input, shape, weight, bias, eps);
}

Tensor3 layer_norm_bwd(const Tensor& grad_out, const Tensor& input, c10::IntArrayRef shape,
                       const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                       const OptTensor& bias) {
  return kernels().layer_norm_bwd(grad_out, input, shape, mean, rstd, weight, bias);
}

Tensor bias_gelu(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  return kernels().bias_gelu(input, bias, approximate);
}

Tensor2 bias_gelu_bwd(const Tensor& grad_out, const Tensor& input, const Tensor& bias,
                      c10::string_view approximate) {
  return kernels().bias_gelu_bwd(grad_out, input, bias, approximate);
}

Tensor2 bias_dropout_add_fwd(const Tensor& input, const Tensor& bias, const Tensor& residual,
                             double p, bool training) {
  return kernels().bias_dropout_add_fwd(input, bias, residual, p, training);
}

Tensor2 bias_dropout_add_bwd(const Tensor& grad_out, const Tensor& seed, double p, bool training) {
  return kernels().bias_dropout_add_bwd(grad_out, seed, p, training);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpar, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("bias_gelu", &bias_gelu);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd);
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd);
  m.impl("bias_dropout_add_bwd", &bias_dropout_add_bwd);
}

}  // namespace torchpar::kernels::cpu

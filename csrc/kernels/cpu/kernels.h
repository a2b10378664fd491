// The CPU kernels' entry points, one table of them per instruction set.
//
// setup.py compiles csrc/kernels/cpu/*.cpp once per instruction set (AVX2, and AVX-512 where
// the compiler has it), each copy with at::vec at that width and in its own namespace,
// cpu::AVX2 or cpu::AVX512 (the CPU_CAPABILITY macro, as in ATen's own kernel files). The
// dispatch (kernels/cpu_dispatch.cpp) registers one CPU kernel per op, which calls the table
// for the instruction set torch's own kernels use: at::get_cpu_capability(), so
// ATEN_CPU_CAPABILITY=avx2 turns ours down along with torch's.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace torchpar::kernels::cpu {

using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

struct CpuKernels {
  const char* isa;  // "AVX2", "AVX512"
  Tensor3 (*layer_norm_fwd)(const at::Tensor& input, c10::IntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps);
  Tensor3 (*layer_norm_bwd)(const at::Tensor& grad_out, const at::Tensor& input,
                            c10::IntArrayRef normalized_shape, const at::Tensor& mean,
                            const at::Tensor& rstd, const OptTensor& weight,
                            const OptTensor& bias);
  at::Tensor (*bias_gelu)(const at::Tensor& input, const at::Tensor& bias,
                          c10::string_view approximate);
  Tensor2 (*bias_gelu_bwd)(const at::Tensor& grad_out, const at::Tensor& input,
                           const at::Tensor& bias, c10::string_view approximate);
  Tensor2 (*bias_dropout_add_fwd)(const at::Tensor& input, const at::Tensor& bias,
                                  const at::Tensor& residual, double p, bool training);
  Tensor2 (*bias_dropout_add_bwd)(const at::Tensor& grad_out, const at::Tensor& seed, double p,
                                  bool training);
};

// Each instruction set's table (cpu/table.cpp, compiled per instruction set).
namespace AVX2 {
extern const CpuKernels kKernels;
}
namespace AVX512 {
extern const CpuKernels kKernels;
}

// The entry points of the instruction set this file is being compiled for.
#if defined(TORCHPAR_KERNEL_ISA)
namespace CPU_CAPABILITY {
Tensor3 layer_norm_fwd(const at::Tensor& input, c10::IntArrayRef normalized_shape,
                       const OptTensor& weight, const OptTensor& bias, double eps);
Tensor3 layer_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                       c10::IntArrayRef normalized_shape, const at::Tensor& mean,
                       const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias);
at::Tensor bias_gelu(const at::Tensor& input, const at::Tensor& bias,
                     c10::string_view approximate);
Tensor2 bias_gelu_bwd(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& bias,
                      c10::string_view approximate);
Tensor2 bias_dropout_add_fwd(const at::Tensor& input, const at::Tensor& bias,
                             const at::Tensor& residual, double p, bool training);
Tensor2 bias_dropout_add_bwd(const at::Tensor& grad_out, const at::Tensor& seed, double p,
                             bool training);
}  // namespace CPU_CAPABILITY
#endif

// The table the CPU kernels run: AVX-512 when it was built and torch runs AVX-512 on
// this CPU, else AVX2 (the extension's baseline).
const CpuKernels& kernels();

}  // namespace torchpar::kernels::cpu

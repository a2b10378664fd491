// The CPU kernels' entry points, one table of them per instruction set.
//
// setup.py compiles csrc/kernels/cpu/*.cpp once per instruction set, each copy with at::vec
// at that width and in its own namespace (the CPU_CAPABILITY macro, as in ATen's own kernel
// files): cpu::AVX2; cpu::AVX512; and cpu::AVX512_BF16, the same plus the AVX512-BF16
// conversion instructions (Zen 4 and later, Sapphire Rapids and later). The dispatch
// (kernels/cpu_dispatch.cpp) registers one CPU kernel per op, which calls the table chosen
// for this CPU: the widest one at most as wide as torch's own kernels run
// (at::get_cpu_capability(), so ATEN_CPU_CAPABILITY=avx2 turns ours down along with torch's).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace torchpar::kernels::cpu {

using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using OptTensor = std::optional<at::Tensor>;
using Mask3 = std::array<bool, 3>;

struct CpuKernels {
  const char* isa;  // "AVX2", "AVX512", "AVX512_BF16"
  Tensor3 (*layer_norm_fwd)(const at::Tensor& input, c10::IntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps);
  Tensor3 (*layer_norm_bwd)(const at::Tensor& grad_out, const at::Tensor& input,
                            c10::IntArrayRef normalized_shape, const at::Tensor& mean,
                            const at::Tensor& rstd, const OptTensor& weight,
                            const OptTensor& bias, Mask3 output_mask);
  at::Tensor (*bias_gelu)(const at::Tensor& input, const at::Tensor& bias,
                          c10::string_view approximate);
  Tensor2 (*bias_gelu_bwd)(const at::Tensor& grad_out, const at::Tensor& input,
                           const at::Tensor& bias, c10::string_view approximate, bool bias_grad);
  Tensor2 (*bias_dropout_add_fwd)(const at::Tensor& input, const at::Tensor& bias,
                                  const at::Tensor& residual, double p, bool training);
  Tensor2 (*bias_dropout_add_bwd)(const at::Tensor& grad_out, const at::Tensor& seed, double p,
                                  bool training, bool bias_grad);
  void (*copy_streaming)(at::Tensor& dst, const at::Tensor& src);
};

// Each instruction set's table (cpu/table.cpp, compiled per instruction set).
namespace AVX2 {
extern const CpuKernels kKernels;
}
namespace AVX512 {
extern const CpuKernels kKernels;
}
namespace AVX512_BF16 {
extern const CpuKernels kKernels;
}
namespace DEFAULT {  // builds for other architectures: at::vec's generic or NEON code
extern const CpuKernels kKernels;
}

// The entry points of the instruction set this file is being compiled for.
#if defined(TORCHPAR_KERNEL_ISA)
namespace CPU_CAPABILITY {
Tensor3 layer_norm_fwd(const at::Tensor& input, c10::IntArrayRef normalized_shape,
                       const OptTensor& weight, const OptTensor& bias, double eps);
Tensor3 layer_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                       c10::IntArrayRef normalized_shape, const at::Tensor& mean,
                       const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias,
                       Mask3 output_mask);
at::Tensor bias_gelu(const at::Tensor& input, const at::Tensor& bias,
                     c10::string_view approximate);
Tensor2 bias_gelu_bwd(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& bias,
                      c10::string_view approximate, bool bias_grad);
Tensor2 bias_dropout_add_fwd(const at::Tensor& input, const at::Tensor& bias,
                             const at::Tensor& residual, double p, bool training);
Tensor2 bias_dropout_add_bwd(const at::Tensor& grad_out, const at::Tensor& seed, double p,
                             bool training, bool bias_grad);
void copy_streaming(at::Tensor& dst, const at::Tensor& src);
}  // namespace CPU_CAPABILITY
#endif

// The table the fused ops run (chosen on first use).
const CpuKernels& kernels();

// Outputs of at least this many bytes are written with non-temporal stores, which go to memory
// without first reading each line into cache (kernels/cpu/vec.h, VecIO::store2). The default is
// half the last-level cache: an output that large, with the inputs it was computed from, fills
// the cache, so its consumer would find little of it there anyway.
int64_t streaming_store_bytes();
// Sets that threshold (0: every output streams; INT64_MAX: none does); a negative value restores
// the default. For tests and benchmarks that compare the two kinds of store.
void set_streaming_store_bytes(int64_t bytes);

// Makes the fused ops run `isa`'s table from now on ("AVX2", "AVX512", "AVX512_BF16"): for
// tests and benchmarks that compare them. Throws if this build or this CPU lacks it.
void use_kernels(const std::string& isa);

}  // namespace torchpar::kernels::cpu

// The fused ops' CPU kernels: each calls the copy of csrc/kernels/cpu/ built for the widest
// instruction set torch itself runs on this CPU (kernels/cpu/kernels.h).
#include <ATen/Version.h>
#include <torch/library.h>

#include <cpuinfo.h>

// cpuinfo is torch's own dependency, whose symbols libc10 exports in the torch releases built
// against here (2.11-2.14). Weak references keep the extension loading into a torch that does
// not export them: the functions' addresses are then null, and the default cache size serves.
#pragma weak cpuinfo_initialize
#pragma weak cpuinfo_get_max_cache_size

#include <atomic>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace torchpar::kernels::cpu {

namespace {

// Every table this build has, narrowest first, each with whether this CPU can run it.
std::vector<std::pair<const CpuKernels*, bool>> tables() {
#if defined(TORCHPAR_KERNELS_X86)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return {{&AVX2::kKernels, true},
          {&AVX512::kKernels, avx512},
          {&AVX512_BF16::kKernels, avx512 && __builtin_cpu_supports("avx512bf16")}};
#else
  return {{&DEFAULT::kKernels, true}};
#endif
}

const CpuKernels* default_table() {
  const bool torch_avx512 = at::get_cpu_capability() == "AVX512";
  const auto all = tables();
  const CpuKernels* chosen = all.front().first;
  for (const auto& [table, runs] : all) {
    if (runs && (torch_avx512 || std::string_view(table->isa).find("AVX512") == std::string_view::npos)) {
      chosen = table;
    }
  }
  return chosen;
}

std::atomic<const CpuKernels*> current{nullptr};

}  // namespace

const CpuKernels& kernels() {
  const CpuKernels* table = current.load(std::memory_order_acquire);
  if (table == nullptr) {
    // First use from several threads: all choose the same table; the first store stays.
    current.compare_exchange_strong(table, default_table(), std::memory_order_acq_rel);
    table = current.load(std::memory_order_acquire);
  }
  return *table;
}

void use_kernels(const std::string& isa) {
  std::string have;
  for (const auto& [table, runs] : tables()) {
    if (isa == table->isa) {
      TORCH_CHECK(runs, "torchpar: this CPU cannot run the ", isa, " kernels");
      current.store(table, std::memory_order_release);
      return;
    }
    have += std::string(have.empty() ? "" : ", ") + table->isa;
  }
  TORCH_CHECK(false, "torchpar: no ", isa, " CPU kernels in this build; it has ", have);
}

namespace {

// The last-level cache's size, from cpuinfo (which torch ships and initialises itself): the
// cache that a core shares with its neighbours, 32 MiB on this machine's Zen 5, where glibc's
// sysconf gives the sum over every core complex of the host (384 MiB). 32 MiB when unknown.
int64_t last_level_cache_bytes() {
  const bool have = cpuinfo_initialize != nullptr && cpuinfo_get_max_cache_size != nullptr;
  const uint32_t bytes = have && cpuinfo_initialize() ? cpuinfo_get_max_cache_size() : 0;
  return bytes > 0 ? int64_t(bytes) : int64_t(32) << 20;
}

// The threshold set by set_streaming_store_bytes; negative: the default, half the last-level
// cache, read from cpuinfo on first use rather than while the library loads.
std::atomic<int64_t> streaming_bytes{-1};

}  // namespace

int64_t streaming_store_bytes() {
  const int64_t bytes = streaming_bytes.load(std::memory_order_relaxed);
  if (bytes >= 0) return bytes;
  static const int64_t kDefault = last_level_cache_bytes() / 2;
  return kDefault;
}

void set_streaming_store_bytes(int64_t bytes) {
  streaming_bytes.store(bytes < 0 ? -1 : bytes, std::memory_order_relaxed);
}

namespace {

using at::Tensor;

Tensor3 layer_norm_fwd(const Tensor& input, c10::IntArrayRef shape, const OptTensor& weight,
                       const OptTensor& bias, double eps) {
  return kernels().layer_norm_fwd(input, shape, weight, bias, eps);
}

Tensor3 layer_norm_bwd(const Tensor& grad_out, const Tensor& input, c10::IntArrayRef shape,
                       const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                       const OptTensor& bias, Mask3 output_mask) {
  return kernels().layer_norm_bwd(grad_out, input, shape, mean, rstd, weight, bias, output_mask);
}

Tensor bias_gelu(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  return kernels().bias_gelu(input, bias, approximate);
}

Tensor2 bias_gelu_bwd(const Tensor& grad_out, const Tensor& input, const Tensor& bias,
                      c10::string_view approximate, bool bias_grad) {
  return kernels().bias_gelu_bwd(grad_out, input, bias, approximate, bias_grad);
}

Tensor2 bias_dropout_add_fwd(const Tensor& input, const Tensor& bias, const Tensor& residual,
                             double p, bool training) {
  return kernels().bias_dropout_add_fwd(input, bias, residual, p, training);
}

Tensor2 bias_dropout_add_bwd(const Tensor& grad_out, const Tensor& seed, double p, bool training,
                             bool bias_grad) {
  return kernels().bias_dropout_add_bwd(grad_out, seed, p, training, bias_grad);
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

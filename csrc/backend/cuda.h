// The CUDA half of the backend, for calls whose tensors are on a GPU: NcclBackend
// (backend/nccl/) in a build with CUDA, made on a group's first CUDA operation. A build
// without CUDA has none, and says what to build instead.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace torchpar {

c10::intrusive_ptr<c10d::Backend> make_cuda_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, const std::string& group_name);

namespace detail {
inline void count_devices(int& cpu, int& cuda, const at::Tensor& t) {
  if (!t.defined()) return;
  (t.is_cuda() ? cuda : cpu) += 1;
}
inline void count_devices(int& cpu, int& cuda, const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) count_devices(cpu, cuda, t);
}
inline void count_devices(int& cpu, int& cuda, const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& ts : lists) count_devices(cpu, cuda, ts);
}
}  // namespace detail

// Whether a call's tensors are CUDA tensors (the CUDA half carries it) rather than CPU ones;
// a call mixing the two is an error naming the operation.
template <typename... Tensors>
bool on_cuda(const char* op, const Tensors&... tensors) {
  int cpu = 0, cuda = 0;
  (detail::count_devices(cpu, cuda, tensors), ...);
  TORCH_CHECK(cpu == 0 || cuda == 0, "torchpar ", op, ": the call mixes CPU and CUDA tensors; pass tensors of one ",
              "device (", cpu, " on the CPU, ", cuda, " on a GPU)");
  return cuda > 0;
}

}  // namespace torchpar

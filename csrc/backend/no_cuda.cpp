// The CPU-only build's answer to a CUDA tensor (backend/cuda.h).
#ifndef TORCHPAR_WITH_CUDA
#include "backend/cuda.h"

namespace torchpar {

c10::intrusive_ptr<c10d::Backend> make_cuda_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds, const std::string&) {
  TORCH_CHECK(false,
              "torchpar: this build moves CPU tensors only; CUDA tensors go through NCCL in the CUDA build "
              "(`make build-cuda`, or TORCHPAR_CUDA=1 with a CUDA build of torch and the nvidia-nccl wheel: "
              "see the README)");
}

}  // namespace torchpar
#endif

// torch moved its CUDA event from ATen (at::cuda::CUDAEvent, older releases) to c10
// (c10::cuda::CUDAEvent); the backend builds against both.
#pragma once

#if __has_include(<c10/cuda/CUDAEvent.h>)
#include <c10/cuda/CUDAEvent.h>
namespace torchpar {
using CudaEvent = c10::cuda::CUDAEvent;
}
#else
#include <ATen/cuda/CUDAEvent.h>
namespace torchpar {
using CudaEvent = at::cuda::CUDAEvent;
}
#endif

// Large buffers that live for one step or less: a sharded DDP bucket (ZeRO-2), a fully_shard
// unit's gathered parameters and its packed gradients.
//
// On CPU there is no caching allocator: each step's fresh buffer is fresh memory from the
// kernel, and its first touch costs a page fault per 4 KiB page. For a 55M-parameter model's
// ZeRO-2 buckets that was a third of the backward (docs/zero.md, "Huge pages for the step's
// buffers"). Mapped in transparent huge pages (madvise, where the kernel offers them) a
// buffer faults 512x less often, and it is still returned to the kernel when freed, so the
// memory peak is unchanged. Fresh pages come zeroed from the kernel: nothing to clear.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstddef>

namespace torchpar {

// `nbytes` on `device` for a storage whose allocator is `fallback`: on CPU from 2 MiB up,
// mapped in huge pages (zeroed); otherwise, or if mapping fails, fallback->allocate(nbytes)
// (contents unspecified).
c10::DataPtr step_buffer_data(size_t nbytes, c10::Device device, c10::Allocator* fallback);

// A 1-D tensor of `numel` zeros, as at::zeros({numel}, options), backed as above on CPU.
at::Tensor step_buffer_zeros(int64_t numel, const at::TensorOptions& options);

}  // namespace torchpar

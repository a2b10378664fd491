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

// Whether buffers above 32 MiB are mapped in huge pages: TORCHPAR_HUGE_PAGES (1, the default;
// 0 turns it off). Throws torchpar's usage error for another value: the reducer and
// fully_shard read it when they are built, so a bad value fails set-up, not a backward.
bool step_buffers_in_huge_pages();

// `nbytes` on `device` for a storage whose allocator is `fallback`: on CPU above 32 MiB,
// mapped in huge pages (zeroed); otherwise, or if mapping fails, fallback->allocate(nbytes)
// (contents unspecified).
c10::DataPtr step_buffer_data(size_t nbytes, c10::Device device, c10::Allocator* fallback);

// 1-D tensors of `numel` elements backed as above on CPU: zeros (as at::zeros), or contents
// unspecified (as at::empty; zeros where mapped).
at::Tensor step_buffer_zeros(int64_t numel, const at::TensorOptions& options);
at::Tensor step_buffer_empty(int64_t numel, const at::TensorOptions& options);

// Bytes mapped by this process so far, in all (for tests: that a buffer took the mapped path).
size_t step_buffer_bytes_mapped_total();

}  // namespace torchpar

#include "common/step_buffer.h"

#include "common/env.h"

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <atomic>

namespace torchpar {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// Smaller buffers stay with the allocator: glibc's malloc serves them from its heap once its
// mmap threshold has risen past them (it does up to 32 MiB on 64-bit), reusing pages that are
// already mapped, which beats fresh pages of any size (measured: fully_shard's 12.6 MB units
// were 10 % slower mapped here). Larger ones are fresh mappings every time, in 4 KiB pages.
constexpr size_t kMapFrom = size_t{32} << 20;

struct Mapping {
  void* data;
  size_t bytes;
};

// Mapped here and not yet unmapped: what the profiler's memory events report as allocated, as
// the CPU allocator reports its own (so torch.profiler's profile_memory sees these buffers).
std::atomic<size_t> mapped_bytes{0};

void report(void* p, int64_t delta) {
  const size_t total = delta > 0 ? mapped_bytes.fetch_add(static_cast<size_t>(delta)) + static_cast<size_t>(delta)
                                 : mapped_bytes.fetch_sub(static_cast<size_t>(-delta)) - static_cast<size_t>(-delta);
  if (c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(p, delta, total, total, c10::Device(c10::kCPU));
  }
}

void unmap(void* ctx) {
  auto* m = static_cast<Mapping*>(ctx);
  report(m->data, -static_cast<int64_t>(m->bytes));
  ::munmap(m->data, m->bytes);
  delete m;
}

// Zeroed memory in huge pages, or a null DataPtr where that is not worth it or not possible.
c10::DataPtr map_huge(size_t nbytes) {
  // TORCHPAR_HUGE_PAGES=0: the allocator's memory, as torch's own tensors get (an A/B switch,
  // and a way out where huge pages misbehave, e.g. compaction stalls on a fragmented host).
  static const bool enabled = env_int("TORCHPAR_HUGE_PAGES", 1) != 0;
  if (!enabled || nbytes <= kMapFrom) {
    return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
  }
  const size_t bytes = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
  }
  // Advice only: without transparent huge pages (or with them off) this is plain anonymous
  // memory, as the allocator would have mapped for a buffer this large anyway.
  ::madvise(p, bytes, MADV_HUGEPAGE);
  report(p, static_cast<int64_t>(bytes));
  return c10::DataPtr(p, new Mapping{p, bytes}, &unmap, c10::Device(c10::kCPU));
}

}  // namespace

c10::DataPtr step_buffer_data(size_t nbytes, c10::Device device, c10::Allocator* fallback) {
  if (device.is_cpu()) {
    if (c10::DataPtr huge = map_huge(nbytes)) {
      return huge;
    }
  }
  return fallback->allocate(nbytes);
}

at::Tensor step_buffer_zeros(int64_t numel, const at::TensorOptions& options) {
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (options.device().is_cpu()) {
    if (c10::DataPtr huge = map_huge(nbytes)) {
      c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(huge), /*allocator=*/nullptr,
                           /*resizable=*/false);
      return at::empty({0}, options).set_(std::move(storage), 0, {numel}, {1});
    }
  }
  return at::zeros({numel}, options);
}

}  // namespace torchpar

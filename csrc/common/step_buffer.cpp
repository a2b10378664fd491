#include "common/step_buffer.h"

#include "common/env.h"
#include "common/error.h"

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

// Mapped here and not yet unmapped: the running total the profiler's memory events carry
// for these buffers (the deltas are what torch.profiler's profile_memory adds up; the CPU
// allocator's events carry its own total, and likewise 0 reserved). And all bytes ever mapped.
std::atomic<size_t> mapped_bytes{0};
std::atomic<size_t> mapped_total{0};

void report(void* p, int64_t delta) {
  const size_t total = delta > 0 ? mapped_bytes.fetch_add(static_cast<size_t>(delta)) + static_cast<size_t>(delta)
                                 : mapped_bytes.fetch_sub(static_cast<size_t>(-delta)) - static_cast<size_t>(-delta);
  if (c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(p, delta, total, 0, c10::Device(c10::kCPU));
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
  if (nbytes <= kMapFrom || !step_buffers_in_huge_pages()) {
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
  mapped_total.fetch_add(bytes);
  return c10::DataPtr(p, new Mapping{p, bytes}, &unmap, c10::Device(c10::kCPU));
}

// A tensor on mapped memory, or an undefined one where the buffer is not mapped.
at::Tensor mapped_tensor(int64_t numel, const at::TensorOptions& options) {
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (options.device().is_cpu()) {
    if (c10::DataPtr huge = map_huge(nbytes)) {
      c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(huge), /*allocator=*/nullptr,
                           /*resizable=*/false);
      return at::empty({0}, options).set_(std::move(storage), 0, {numel}, {1});
    }
  }
  return at::Tensor();
}

}  // namespace

bool step_buffers_in_huge_pages() {
  // 0: the allocator's memory, as torch's own tensors get (an A/B switch, and a way out where
  // huge pages misbehave, e.g. compaction stalls on a fragmented host).
  static const bool enabled = [] {
    const std::string value = env_str("TORCHPAR_HUGE_PAGES", "1");
    TP_CHECK_USAGE(value == "0" || value == "1", "torchpar: TORCHPAR_HUGE_PAGES must be 0 or 1, not '", value, "'");
    return value == "1";
  }();
  return enabled;
}

size_t step_buffer_bytes_mapped_total() { return mapped_total.load(); }

c10::DataPtr step_buffer_data(size_t nbytes, c10::Device device, c10::Allocator* fallback) {
  if (device.is_cpu()) {
    if (c10::DataPtr huge = map_huge(nbytes)) {
      return huge;
    }
  }
  return fallback->allocate(nbytes);
}

at::Tensor step_buffer_zeros(int64_t numel, const at::TensorOptions& options) {
  at::Tensor t = mapped_tensor(numel, options);
  return t.defined() ? t : at::zeros({numel}, options);
}

at::Tensor step_buffer_empty(int64_t numel, const at::TensorOptions& options) {
  at::Tensor t = mapped_tensor(numel, options);
  return t.defined() ? t : at::empty({numel}, options);
}

}  // namespace torchpar

#include "transport/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "common/error.h"

namespace torchpar::shm {

Segment Segment::create(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TP_CHECK_ERRNO(fd >= 0, "cannot create shared-memory segment ", name);
  // posix_fallocate reserves the pages now, so a full /dev/shm is a clear error here
  // rather than a SIGBUS on first touch in the middle of a collective.
  int rc = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0
               ? ::posix_fallocate(fd, 0, static_cast<off_t>(bytes))
               : errno;
  if (rc != 0) {
    int err = rc;
    ::close(fd);
    ::shm_unlink(name.c_str());
    TP_THROW("cannot size shared-memory segment ", name, " to ", bytes,
             " bytes: ", std::strerror(err), " (is /dev/shm large enough?)");
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    TP_THROW("cannot map shared-memory segment ", name, ": ", std::strerror(err));
  }
  return Segment(name, base, bytes, /*owner=*/true);
}

Segment Segment::open(const std::string& name) {
  int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  TP_CHECK_ERRNO(fd >= 0, "cannot open shared-memory segment ", name);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    TP_THROW("cannot stat shared-memory segment ", name, ": ", std::strerror(err));
  }
  size_t bytes = static_cast<size_t>(st.st_size);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  TP_CHECK(base != MAP_FAILED, "cannot map shared-memory segment ", name, ": ", std::strerror(err));
  return Segment(name, base, bytes, /*owner=*/false);
}

Segment::Segment(Segment&& other) noexcept { *this = std::move(other); }

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

Segment::~Segment() { release(); }

void Segment::unlink() {
  if (linked_) {
    ::shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void Segment::release() {
  unlink();
  if (base_ != nullptr) {
    ::munmap(base_, bytes_);
    base_ = nullptr;
  }
}

}  // namespace torchpar::shm

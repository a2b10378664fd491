// A POSIX shared-memory segment: created (0600, exclusive) by one rank, opened by the
// others, unlinked as soon as all have mapped it so that a crash leaves nothing behind.
#pragma once

#include <cstddef>
#include <string>

namespace torchpar::shm {

class Segment {
 public:
  // Creates `name` with `bytes` bytes; fails if it exists (names are unique per run).
  static Segment create(const std::string& name, size_t bytes);
  // Opens and maps an existing segment, whose size is read from the file.
  static Segment open(const std::string& name);

  Segment() = default;
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Removes the name; the mapping stays valid. Idempotent.
  void unlink();

  char* data() const { return static_cast<char*>(base_); }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  Segment(std::string name, void* base, size_t bytes, bool owner)
      : name_(std::move(name)), base_(base), bytes_(bytes), linked_(owner) {}
  void release();

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  bool linked_ = false;  // this process created the name and has not unlinked it yet
};

}  // namespace torchpar::shm

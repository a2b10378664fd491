// libFuzzer target for what torchpar reads from other processes (issue 21): the store's
// records, the TCP handshake's messages and the point-to-point frame stream. Every input
// must end in a value or a torchpar::Error, never a crash, a sanitizer report or a hang.
// `make fuzz` builds it with clang (-fsanitize=fuzzer,address,undefined) and runs it for
// FUZZ_SECONDS.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/env.h"
#include "common/error.h"
#include "transport/link.h"
#include "transport/p2p_engine.h"
#include "transport/records.h"
#include "transport/tcp/handshake.h"

namespace {

using namespace torchpar;

// A peer (rank 0) whose pipe to this rank carries the fuzzer's bytes, a few at a time.
class FuzzLink : public Link {
 public:
  FuzzLink(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t write_some(int, const void*, size_t n) override { return n; }
  size_t read_some(int peer, void* out, size_t n) override {
    if (peer != 0) return 0;
    size_t at = pos_.load();
    size_t k = std::min({n, size_ - at, size_t{1} + at % 13});  // odd pieces: split headers
    std::memcpy(out, data_ + at, k);
    pos_.store(at + k);
    return k;
  }
  void notify(int) override {}
  uint32_t activity() const override { return ++activity_; }
  void sleep_until_activity(uint32_t, std::chrono::microseconds) override { std::this_thread::yield(); }
  void check_peer(int) override {}
  void abort(const std::string&) override { aborted_.store(true); }

  bool drained() const { return pos_.load() == size_ || aborted_.load(); }

 private:
  const uint8_t* data_;
  size_t size_;
  std::atomic<size_t> pos_{0};
  mutable std::atomic<uint32_t> activity_{0};
  std::atomic<bool> aborted_{false};
};

void fuzz_records(const std::string& text) {
  auto quietly = [](auto fn) {
    try {
      fn();
    } catch (const Error&) {
    }
  };
  quietly([&] { HostIdentity::decode(text); });
  quietly([&] { Contact::decode(text); });
  quietly([&] { AbortNotice::decode(text); });
  quietly([&] { tcp::parse_secret(text); });
  int64_t size = 0;
  parse_size(text, &size);
}

void fuzz_handshake(const uint8_t* data, size_t n) {
  using namespace tcp;
  static const Secret secret = random_secret();
  Hello hello{};
  Challenge challenge{};
  Proof proof{};
  std::memcpy(&hello, data, std::min(n, sizeof(hello)));
  std::memcpy(&challenge, data, std::min(n, sizeof(challenge)));
  std::memcpy(&proof, data + std::min(n, sizeof(hello)), std::min(n - std::min(n, sizeof(hello)), sizeof(proof)));
  const Nonce nonce{};
  for (int size : {1, 2, 4}) {
    for (int me = 0; me < size; ++me) {
      if (check_hello(hello, me, size).empty()) check_proof(proof, secret, me, hello, nonce);
      check_challenge(challenge, secret, me, (me + 1) % size, size, nonce);
    }
  }
}

void fuzz_frames(const uint8_t* data, size_t n) {
  FuzzLink link(data, n);
  std::vector<std::vector<char>> buffers = {std::vector<char>(0), std::vector<char>(8), std::vector<char>(64)};
  {
    P2PEngine engine(1, 2, link, std::chrono::microseconds(0), std::chrono::microseconds(0), 4096);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    std::vector<std::shared_ptr<Request>> posted;
    for (size_t i = 0; i < buffers.size(); ++i) {
      posted.push_back(engine.irecv(0, i, buffers[i].data(), buffers[i].size(), deadline));
    }
    const auto give_up = Clock::now() + std::chrono::milliseconds(500);
    while (!link.drained() && Clock::now() < give_up) std::this_thread::yield();
    // Whatever the frames said, a receive may still take an early arrival.
    std::vector<char> late(16);
    engine.irecv(-1, 1, late.data(), late.size(), deadline);
    engine.stop();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  switch (data[0] % 3) {
    case 0:
      fuzz_records(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
      break;
    case 1:
      fuzz_handshake(data + 1, size - 1);
      break;
    default:
      fuzz_frames(data + 1, size - 1);
  }
  return 0;
}

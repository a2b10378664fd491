// Hardening the wire (issue 21): bytes from a socket, a shared-memory segment or the store
// are untrusted. Bad ones give a clear torchpar::Error on every live rank, never a crash,
// an unbounded allocation or a hang.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/env.h"
#include "common/error.h"
#include "ranks.h"
#include "transport/records.h"
#include "transport/shm/layout.h"
#include "transport/shm/ring.h"

namespace torchpar {
namespace {

using tptest::run_ranks;
using tptest::small_config;

// What a message header looks like on the wire (P2PEngine's WireHeader).
struct RawHeader {
  uint64_t tag;
  uint64_t bytes;
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& word) { return text.find(word) != std::string::npos; }

// ---------------------------------------------------------------------------------------
// Lengths read from a pipe

class Frames : public ::testing::TestWithParam<std::string> {};

// A header announcing 2^64-1 bytes used to reach std::vector::resize on the progress thread
// (std::length_error, nothing catching it: std::terminate). Now it fails the group, on this
// rank and the sender's, naming the peer and the sizes.
TEST_P(Frames, HugeLengthFailsTheGroupOnEveryRank) {
  run_ranks(2, [&](int rank, Transport& t) {
    const auto deadline = Clock::now() + std::chrono::seconds(8);
    if (rank == 0) {
      RawHeader bad{5, ~uint64_t{0}};
      ASSERT_EQ(t.write_some(1, &bad, sizeof(bad)), sizeof(bad));  // nothing else is queued to rank 1
      t.notify(1);
      int never = 0;
      auto start = Clock::now();
      std::string why = error_of([&] { t.p2p().irecv(1, 6, &never, sizeof(never), deadline)->wait(); });
      EXPECT_NE(why, "");
      EXPECT_LT(Clock::now() - start, std::chrono::seconds(6)) << "the sender must hear of it, not time out";
    } else {
      int got = 0;
      std::string why = error_of([&] { t.p2p().irecv(0, 6, &got, sizeof(got), deadline)->wait(); });
      EXPECT_TRUE(contains(why, "rank 0")) << why;
      EXPECT_TRUE(contains(why, "18446744073709551615 bytes")) << why;
      EXPECT_TRUE(contains(why, "TORCHPAR_UNEXPECTED_MAX_BYTES")) << why;
    }
  }, std::chrono::milliseconds(10000), GetParam());
}

// An isend before its irecv is buffered by the receiver, but only up to
// TORCHPAR_UNEXPECTED_MAX_BYTES in all; past that the group fails with the sizes named.
TEST_P(Frames, EarlyArrivalsPastTheCapFailTheGroup) {
  Config config = small_config();
  config.unexpected_max_bytes = 64 << 10;
  run_ranks(2, [&](int rank, Transport& t) {
    const auto deadline = Clock::now() + std::chrono::seconds(8);
    std::vector<char> big(100 << 10, 'x');
    if (rank == 0) {
      // Over TCP the send may complete into the socket's buffers before rank 1 gives up;
      // the next operation then hears of it, long before its deadline.
      auto start = Clock::now();
      std::string why = error_of([&] {
        t.p2p().isend(1, 1, big.data(), big.size(), deadline)->wait();
        int never = 0;
        t.p2p().irecv(1, 2, &never, sizeof(never), deadline)->wait();
      });
      EXPECT_NE(why, "");
      EXPECT_LT(Clock::now() - start, std::chrono::seconds(6));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let it arrive first
      std::string why = error_of([&] { t.p2p().irecv(0, 1, big.data(), big.size(), deadline)->wait(); });
      EXPECT_TRUE(contains(why, "rank 0")) << why;
      EXPECT_TRUE(contains(why, "102400 bytes")) << why;
      EXPECT_TRUE(contains(why, "TORCHPAR_UNEXPECTED_MAX_BYTES=65536")) << why;
    }
  }, std::chrono::milliseconds(10000), GetParam(), config);
}

// A posted receive whose message is of another size and past the cap: the receive fails
// with the size error (it had been taken off the posted list before the cap's check threw,
// and nothing completed it: its wait() never returned).
TEST_P(Frames, AMismatchedMessagePastTheCapFailsItsReceive) {
  Config config = small_config();
  config.unexpected_max_bytes = 64 << 10;
  run_ranks(2, [&](int rank, Transport& t) {
    const auto deadline = Clock::now() + std::chrono::seconds(8);
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the receive is posted first
      std::vector<char> big(100 << 10, 'x');
      error_of([&] { t.p2p().isend(1, 3, big.data(), big.size(), deadline)->wait(); });
    } else {
      auto start = Clock::now();
      int small = 0;
      std::string why = error_of([&] { t.p2p().irecv(0, 3, &small, sizeof(small), deadline)->wait(); });
      EXPECT_TRUE(contains(why, "102400 bytes")) << why;
      EXPECT_LT(Clock::now() - start, std::chrono::seconds(6));
    }
  }, std::chrono::milliseconds(10000), GetParam(), config);
}

// Buffered bytes are counted back when a receive takes them: early arrivals that each fit
// never add up to a failure.
TEST_P(Frames, EarlyArrivalsUnderTheCapAreCountedBackWhenReceived) {
  Config config = small_config();
  config.unexpected_max_bytes = 64 << 10;
  run_ranks(2, [&](int rank, Transport& t) {
    const auto deadline = Clock::now() + std::chrono::seconds(8);
    for (int i = 0; i < 5; ++i) {
      std::vector<char> piece(40 << 10, static_cast<char>(i));
      int ack = 0;
      if (rank == 0) {
        t.p2p().isend(1, i, piece.data(), piece.size(), deadline)->wait();
        t.p2p().irecv(1, 100 + i, &ack, sizeof(ack), deadline)->wait();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        std::vector<char> got(piece.size());
        t.p2p().irecv(0, i, got.data(), got.size(), deadline)->wait();
        EXPECT_EQ(got, piece);
        t.p2p().isend(0, 100 + i, &ack, sizeof(ack), deadline)->wait();
      }
    }
  }, std::chrono::milliseconds(10000), GetParam(), config);
}

// Every early message costs its record as well as its payload. Zero-byte ones used to
// count as nothing, so a peer could queue them without limit.
TEST_P(Frames, ZeroByteEarlyArrivalsCountAgainstTheCap) {
  Config config = small_config();
  config.unexpected_max_bytes = 4 << 10;  // room for the records of fewer than 100 messages
  run_ranks(2, [&](int rank, Transport& t) {
    const auto deadline = Clock::now() + std::chrono::seconds(8);
    if (rank == 0) {
      error_of([&] {
        for (int i = 0; i < 100; ++i) t.p2p().isend(1, i, nullptr, 0, deadline)->wait();
        int never = 0;
        t.p2p().irecv(1, 1000, &never, sizeof(never), deadline)->wait();
      });
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let them arrive first
      std::string why = error_of([&] {
        for (int i = 0; i < 100; ++i) t.p2p().irecv(0, i, nullptr, 0, deadline)->wait();
      });
      EXPECT_TRUE(contains(why, "TORCHPAR_UNEXPECTED_MAX_BYTES=4096")) << why;
    }
  }, std::chrono::milliseconds(10000), GetParam(), config);
}

INSTANTIATE_TEST_SUITE_P(Transports, Frames, ::testing::Values("shm", "tcp"));

// The default bound on early arrivals is half of memory. It was a fixed 1 GiB, which refused
// a broadcast or all-gather of more than that to a rank still computing: those had worked.
TEST(Config, EarlyArrivalsAreBoundedByHalfOfMemoryByDefault) {
  ::unsetenv("TORCHPAR_UNEXPECTED_MAX_BYTES");
  const int64_t memory = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
  EXPECT_EQ(Config{}.unexpected_max_bytes, default_unexpected_max_bytes());
  EXPECT_LE(default_unexpected_max_bytes(), memory / 2);
  if (memory < (int64_t{8} << 30)) GTEST_SKIP() << "the check below needs 8 GiB of memory";
  std::ifstream cgroup("/sys/fs/cgroup/memory.max");
  std::string limit;
  if (cgroup >> limit && limit != "max") GTEST_SKIP() << "a cgroup memory limit is set: " << limit;
  EXPECT_GT(default_unexpected_max_bytes(), int64_t{1} << 30);
}

// A ring whose counters say more bytes are waiting than it holds (a corrupt or hostile
// segment) used to size a memcpy past the ring's end.
TEST(Ring, CorruptCountersAreAnErrorNotACopy) {
  const size_t capacity = 4096;
  std::vector<char> storage(sizeof(shm::RingHeader) + capacity);
  auto* header = new (storage.data()) shm::RingHeader{};
  shm::Ring ring(header, storage.data() + sizeof(shm::RingHeader), capacity);
  std::vector<char> buffer(16 * capacity);
  header->head.store(10 * capacity);  // "10 ring-fulls are waiting"
  EXPECT_THROW(ring.read_some(buffer.data(), buffer.size()), Error);
  header->head.store(0);
  header->tail.store(5);  // the consumer is ahead of the producer
  EXPECT_THROW(ring.write_some(buffer.data(), buffer.size()), Error);
}

// ---------------------------------------------------------------------------------------
// Values from the store and the environment

TEST(Records, MalformedNumbersAreTorchparErrorsNamingTheValue) {
  const std::string host = "|node|boot|pidns|netns|10.0.0.1";
  for (const std::string port : {"http", "", "70000", "0", "-1", "12x", "99999999999999999999999"}) {
    std::string why = error_of([&] { Contact::decode(port + host); });
    EXPECT_TRUE(contains(why, "'" + port + "'")) << "port " << port << ": " << why;
  }
  EXPECT_EQ(Contact::decode("65535" + host).port, 65535);
  EXPECT_TRUE(contains(error_of([] { AbortNotice::decode("three|why"); }), "'three'"));
  EXPECT_EQ(AbortNotice::decode("3|why").rank, 3);
}

// A rank that finds garbage where a peer's contact or the group's secret should be says
// which key held what, instead of dying of std::invalid_argument.
TEST(Records, GarbageInTheStoreNamesTheKey) {
  tptest::MemoryRendezvous rv;
  rv.set("torchpar/tcp/secret", std::string(64, 'a'));
  rv.set("torchpar/tcp/token", "12345");
  rv.set("torchpar/tcp/0", "port?|node|boot|pidns|netns|127.0.0.1");
  std::string why;
  std::thread rank1([&] {
    try {
      tcp::TcpTransport t(1, 2, rv, small_config(), std::chrono::milliseconds(3000));
    } catch (const Error& e) {
      why = e.what();
    } catch (const std::exception& e) {
      why = std::string("not a torchpar::Error: ") + e.what();
    }
  });
  rank1.join();
  EXPECT_TRUE(contains(why, "torchpar/tcp/0")) << why;
  EXPECT_TRUE(contains(why, "'port?'")) << why;
}

TEST(Env, BadNumbersAreErrorsNamingTheSetting) {
  for (const char* bad : {"12Q", "lots", "4M4", "99999999999G", "-", "0x10"}) {
    ::setenv("TORCHPAR_SHM_SLOT_BYTES", bad, 1);
    std::string why = error_of([] { Config c; });
    EXPECT_TRUE(contains(why, "TORCHPAR_SHM_SLOT_BYTES")) << bad << ": " << why;
    EXPECT_TRUE(contains(why, bad)) << why;
  }
  ::setenv("TORCHPAR_SHM_SLOT_BYTES", "4M", 1);
  EXPECT_EQ(Config().slot_bytes, 4 << 20);
  ::unsetenv("TORCHPAR_SHM_SLOT_BYTES");
}

TEST(Layout, SizesThatOverflowAreRefused) {
  const size_t huge = size_t{1} << 62;
  EXPECT_THROW(shm::Layout(4, huge, 4096), Error);
  EXPECT_THROW(shm::Layout(4, 4096, huge), Error);
  EXPECT_THROW(shm::Layout(size_t{1} << 22, 4096, 1 << 20), Error);  // world² rings
  EXPECT_THROW(shm::Layout(2, ~size_t{0} - 10, 4096), Error);  // align_up itself wraps
  EXPECT_NO_THROW(shm::Layout(4, 4 << 20, 1 << 20));
}

}  // namespace
}  // namespace torchpar

// GoogleTest of the pure C++ layers (transport, collectives) with threads as ranks:
// no Python, no torch runtime, seconds to build.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "collectives/collectives.h"
#include "common/error.h"
#include "transport/connect.h"
#include "transport/link.h"
#include "transport/p2p_engine.h"
#include "transport/records.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "ranks.h"

namespace torchpar {
namespace {

using tptest::MemoryRendezvous;
using tptest::comm;
using tptest::run_ranks;
using tptest::small_config;

TEST(Ring, StreamsFarMoreThanItsCapacityInRandomPieces) {
  std::vector<char> storage(sizeof(shm::RingHeader) + 4096);
  auto* header = new (storage.data()) shm::RingHeader{};
  shm::Ring ring(header, storage.data() + sizeof(shm::RingHeader), 4096);
  const size_t total = 3'000'017;
  std::vector<char> sent(total), got(total);
  std::mt19937 gen(1);
  for (auto& c : sent) c = static_cast<char>(gen());
  std::thread producer([&] {
    std::mt19937 g(2);
    size_t off = 0;
    while (off < total) off += ring.write_some(sent.data() + off, std::min<size_t>(g() % 5000 + 1, total - off));
  });
  std::mt19937 g(3);
  size_t off = 0;
  while (off < total) off += ring.read_some(got.data() + off, std::min<size_t>(g() % 7000 + 1, total - off));
  producer.join();
  EXPECT_EQ(sent, got);
}

// (transport, world size)
class Groups : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  int world() const { return std::get<1>(GetParam()); }
  void run(const std::function<void(int, Transport&)>& fn) {
    run_ranks(world(), fn, std::chrono::milliseconds(10000), std::get<0>(GetParam()));
  }
};

TEST_P(Groups, RingExchangeLargerThanThePipes) {
  const int world = this->world();
  if (world == 1) GTEST_SKIP() << "no peer to exchange with";
  run([&](int rank, Transport& t) {
    const size_t n = 100'003;
    std::vector<float> out(n), in(n);
    std::iota(out.begin(), out.end(), static_cast<float>(rank * 1000));
    auto deadline = Clock::now() + std::chrono::seconds(10);
    auto r = t.p2p().irecv((rank + world - 1) % world, 7, in.data(), n * 4, deadline);
    auto s = t.p2p().isend((rank + 1) % world, 7, out.data(), n * 4, deadline);
    s->wait();
    r->wait();
    EXPECT_EQ(in[5], static_cast<float>(((rank + world - 1) % world) * 1000 + 5));
    EXPECT_EQ(r->source(), (rank + world - 1) % world);
  });
}

TEST_P(Groups, AllreduceOneShotAndChunked) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    uint64_t seq = 0;
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{3000}, size_t{100'001}}) {
      std::vector<float> v(n, static_cast<float>(rank + 1));
      auto c = comm(t, seq++);
      collectives::allreduce(c, v.data(), n, c10::ScalarType::Float, collectives::ReduceOp::kSum);
      for (float x : v) ASSERT_EQ(x, world * (world + 1) / 2.0f) << "n=" << n;
    }
  });
}

TEST_P(Groups, MismatchedCountsFailEveryRankAndLeaveTheGroupUsable) {
  const int world = this->world();
  if (world == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  run([&](int rank, Transport& t) {
    std::vector<double> v(10 + rank, 1.0);
    auto c = comm(t, 0);
    EXPECT_THROW(collectives::allreduce(c, v.data(), v.size(), c10::ScalarType::Double,
                                        collectives::ReduceOp::kSum),
                 UsageError);
    auto c2 = comm(t, 1);
    collectives::allreduce(c2, v.data(), 10, c10::ScalarType::Double, collectives::ReduceOp::kMax);
    EXPECT_EQ(v[0], 1.0);
  });
}

INSTANTIATE_TEST_SUITE_P(TransportsAndWorldSizes, Groups,
                         ::testing::Combine(::testing::Values("shm", "tcp"), ::testing::Values(1, 2, 3, 4)));

TEST(P2P, TagsMatchWhateverTheReceiveOrder) {
  run_ranks(2, [&](int rank, Transport& t) {
    auto deadline = Clock::now() + std::chrono::seconds(10);
    if (rank == 0) {
      for (int tag = 1; tag <= 3; ++tag) t.p2p().isend(1, tag, &tag, sizeof(tag), deadline)->wait();
    } else {
      for (int tag : {3, 1, 2}) {
        int got = 0;
        t.p2p().irecv(0, tag, &got, sizeof(got), deadline)->wait();
        EXPECT_EQ(got, tag);
      }
    }
  });
}

TEST(P2P, CancelledReceiveIsNeverWrittenAndItsMessageWaitsForTheNext) {
  for (const char* kind : {"shm", "tcp"}) {
    run_ranks(2, [&](int rank, Transport& t) {
      auto deadline = Clock::now() + std::chrono::seconds(10);
      int token = 0;
      if (rank == 1) {
        int withdrawn = -1;
        auto r = t.p2p().irecv(0, 5, &withdrawn, sizeof(withdrawn), deadline);
        EXPECT_TRUE(t.p2p().cancel(r));
        EXPECT_THROW(r->wait(), Error);
        EXPECT_FALSE(t.p2p().cancel(r));  // once only
        t.p2p().isend(0, 9, &token, sizeof(token), deadline)->wait();  // now rank 0 sends
        int got = 0;
        auto again = t.p2p().irecv(0, 5, &got, sizeof(got), deadline);
        again->wait();
        EXPECT_EQ(got, 42);
        EXPECT_EQ(withdrawn, -1);
        EXPECT_FALSE(t.p2p().cancel(again));  // matched: too late to withdraw
      } else {
        t.p2p().irecv(1, 9, &token, sizeof(token), deadline)->wait();
        int value = 42;
        t.p2p().isend(1, 5, &value, sizeof(value), deadline)->wait();
      }
    }, std::chrono::milliseconds(10000), kind);
  }
}

// The send fast path (issue 18): callers of isend on several threads write into a ring while
// the progress thread writes what did not fit and reads the other direction. Each thread's
// messages to a peer (one tag per thread) must arrive whole and in order; sizes straddle the
// 8 KiB ring of small_config(). Built with -fsanitize=thread (make build/cpp-tests-tsan) it is
// the data-race check of the fast path's hand-over.
TEST(P2P, SendsFromManyThreadsArriveWholeAndInEachThreadsOrder) {
  struct Case {
    const char* kind;
    int world;
    std::vector<int> hosts;
  };
  for (const Case& c : {Case{"shm", 2, {}}, Case{"tcp", 2, {}}, Case{"mixed", 3, {0, 0, 1}}}) {
    run_ranks(c.world, [&](int rank, Transport& t) {
      constexpr int kThreads = 3, kMessages = 30;
      const size_t sizes[] = {0, 1, 8192 / 4 - 4, 8192 / 4 - 3, 5000, 3};  // int32 elements
      auto size_of = [&](int thread, int i) { return sizes[(i + thread) % 6]; };
      auto value = [](int from, int thread, int i) { return from * 1000000 + thread * 10000 + i; };
      auto deadline = Clock::now() + std::chrono::seconds(20);
      std::vector<std::thread> senders;
      std::vector<std::string> errors(kThreads);
      for (int j = 0; j < kThreads; ++j) {
        senders.emplace_back([&, j] {
          try {
            std::vector<std::vector<int32_t>> bufs;
            std::vector<std::shared_ptr<Request>> reqs;
            bufs.reserve(static_cast<size_t>(kMessages) * c.world);
            for (int i = 0; i < kMessages; ++i) {
              for (int peer = 0; peer < c.world; ++peer) {
                if (peer == rank) continue;
                bufs.emplace_back(size_of(j, i), value(rank, j, i));
                reqs.push_back(t.p2p().isend(peer, j, bufs.back().data(), bufs.back().size() * 4, deadline));
              }
            }
            for (auto& r : reqs) r->wait();
          } catch (const std::exception& e) {
            errors[j] = e.what();
          }
        });
      }
      std::vector<std::vector<int32_t>> outs;
      std::vector<std::shared_ptr<Request>> recvs;
      std::vector<int32_t> want;
      outs.reserve(static_cast<size_t>(kMessages) * kThreads * c.world);
      for (int peer = 0; peer < c.world; ++peer) {
        if (peer == rank) continue;
        for (int j = kThreads - 1; j >= 0; --j) {
          for (int i = 0; i < kMessages; ++i) {
            outs.emplace_back(size_of(j, i), -1);
            want.push_back(value(peer, j, i));
            recvs.push_back(t.p2p().irecv(peer, j, outs.back().data(), outs.back().size() * 4, deadline));
          }
        }
      }
      for (size_t k = 0; k < recvs.size(); ++k) {
        recvs[k]->wait();
        bool whole = std::all_of(outs[k].begin(), outs[k].end(), [&](int32_t v) { return v == want[k]; });
        EXPECT_TRUE(whole) << c.kind << ": message " << k << " from rank " << want[k] / 1000000;
      }
      for (auto& th : senders) th.join();
      for (auto& e : errors) EXPECT_EQ(e, "") << c.kind;
    }, std::chrono::milliseconds(20000), c.kind, small_config(), c.hosts);
  }
}

TEST(P2P, SmallSendToASharedMemoryPeerIsDoneWhenIsendReturns) {
  run_ranks(2, [&](int rank, Transport& t) {
    auto deadline = Clock::now() + std::chrono::seconds(10);
    int64_t value = 42;
    if (rank == 0) {
      auto sent = t.p2p().isend(1, 3, &value, sizeof(value), deadline);
      EXPECT_TRUE(sent->done());  // written by this thread: the ring was empty, nothing queued
      sent->wait();
    } else {
      int64_t got = 0;
      t.p2p().irecv(0, 3, &got, sizeof(got), deadline)->wait();
      EXPECT_EQ(got, 42);
    }
  });
}

// A link whose write to peer 1 takes every byte and then stalls the writing thread, while peer
// 1, done with the message, closes its end: the moment between a caller's last write and its
// marking the send complete. No real peer: the bytes go nowhere, nothing comes back.
class StallingLink : public Link {
 public:
  std::atomic<bool> peer_gone{false};
  std::atomic<bool> release{false};
  size_t write_some(int, const void*, size_t n) override {
    peer_gone = true;  // the peer read the message and left
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return n;
  }
  size_t read_some(int, void*, size_t) override { return 0; }
  void notify(int) override {}
  uint32_t activity() const override { return 0; }
  void sleep_until_activity(uint32_t, std::chrono::microseconds max_sleep) override {
    std::this_thread::sleep_for(std::min(max_sleep, std::chrono::microseconds(1000)));
  }
  void check_peer(int peer) override {
    if (peer_gone) throw Error("rank " + std::to_string(peer) + " has exited");
  }
  void abort(const std::string&) override {}
  bool writable_from_any_thread(int) const override { return true; }
};

TEST(P2P, ASendWhoseBytesAreOutSurvivesItsPeerLeavingBeforeItCompletes) {
  // Seen as "lost the TCP connection to rank 0" on 3 ranks: rank 0 finished an all_reduce and
  // destroyed its group while a peer's thread was between its last write and the completion;
  // the peer's progress thread checked rank 0 (still "being written to") and failed the group.
  StallingLink link;
  P2PEngine engine(0, 2, link, std::chrono::microseconds(0), std::chrono::microseconds(0), 1 << 20);
  int64_t value = 7;
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // 4 of the engine's peer checks
    link.release = true;
  });
  auto sent = engine.isend(1, 3, &value, sizeof(value), Clock::now() + std::chrono::seconds(10));
  releaser.join();
  EXPECT_NO_THROW(sent->wait());
  // A failed engine fails every later request at once.
  EXPECT_NO_THROW(engine.isend(1, 4, &value, sizeof(value), Clock::now() + std::chrono::seconds(10))->wait());
  engine.stop();
}

TEST(Collectives, AbsentPeerTimesOut) {
  run_ranks(2, [&](int rank, Transport& t) {
    if (rank == 1) {  // never joins the collective, but stays in the group past rank 0's timeout
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return;
    }
    float x = 1;
    auto c = comm(t, 0, 300);
    EXPECT_THROW(collectives::allreduce(c, &x, 1, c10::ScalarType::Float, collectives::ReduceOp::kSum),
                 TimeoutError);
  });
}

TEST(Collectives, DepartedPeerFailsAtOnce) {
  // A rank that leaves the group (destroy_process_group) while a peer waits for it in a
  // collective it never issued: the peer fails naming it, well before its timeout.
  run_ranks(2, [&](int rank, Transport& t) {
    if (rank == 1) {
      t.leave();
      return;
    }
    float x = 1;
    auto c = comm(t, 0, 20000);
    auto start = std::chrono::steady_clock::now();
    try {
      collectives::allreduce(c, &x, 1, c10::ScalarType::Float, collectives::ReduceOp::kSum);
      ADD_FAILURE() << "the collective did not fail";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "timed out instead: " << e.what();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 has left the group"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  });
}

// ---------------------------------------------------------------------------------------
// Rendezvous records and set-up (transport/records.h, transport/connect.h)

TEST(Records, EachRoundTripsThroughItsEncoding) {
  HostIdentity id{"node-7", "0b1e-boot", "4026531836", "4026531840"};
  EXPECT_EQ(HostIdentity::decode(id.encode()), id);
  EXPECT_EQ(HostIdentity::local(), HostIdentity::local());

  Contact c{29500, id, {"10.0.0.7", "192.168.1.3"}};
  Contact back = Contact::decode(c.encode());
  EXPECT_EQ(back.port, 29500);
  EXPECT_EQ(back.host, id);
  EXPECT_EQ(back.addresses, c.addresses);
  EXPECT_TRUE(Contact::decode(Contact{1, id, {}}.encode()).addresses.empty());

  AbortNotice n{3, "rank 3 aborted group '1' | with a bar in the reason"};
  AbortNotice nb = AbortNotice::decode(n.encode());
  EXPECT_EQ(nb.rank, 3);
  EXPECT_EQ(nb.reason, n.reason);

  EXPECT_THROW(HostIdentity::decode("only-one-field"), Error);
  // Equal but for the network namespace: another host (issue 21).
  HostIdentity other_netns = id;
  other_netns.net_namespace = "4026532000";
  EXPECT_NE(other_netns, id);
}

TEST(Connect, DifferentSettingsAreRefusedOnEveryRank) {
  MemoryRendezvous rv;
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Config config = small_config();
      config.p2p_chunk_bytes = r == 0 ? 4096 : 8192;
      try {
        connect(rv, r, 2, config, std::chrono::milliseconds(5000));
      } catch (const UsageError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("TORCHPAR_P2P_CHUNK_BYTES differs between rank 0 (4096) and rank 1 (8192)"),
              std::string::npos)
        << errors[r];
  }
}

TEST(Connect, RanksOfOneHostShareMemoryUnlessTcpIsAskedFor) {
  for (const std::string kind : {"auto", "tcp"}) {
    MemoryRendezvous rv;
    std::vector<std::string> names(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        Config config = small_config();
        config.transport = kind;
        names[r] = connect(rv, r, 2, config, std::chrono::milliseconds(5000))->name();
      });
    }
    for (auto& t : ranks) t.join();
    EXPECT_EQ(names[0], kind == "tcp" ? "tcp" : "shm");
    EXPECT_EQ(names[1], names[0]);
  }
}

}  // namespace
}  // namespace torchpar

// What the GoogleTest files share: an in-memory store, a small configuration, and a way to
// run one function per rank on threads, each with its own transport.
#pragma once

#include <gtest/gtest.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/collectives.h"
#include "common/error.h"
#include "transport/mixed_transport.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace torchpar::tptest {

// The c10d::Store stand-in: a map with blocking get.
class MemoryRendezvous : public Rendezvous {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_[key] = value;
    cv_.notify_all();
  }
  std::string get(const std::string& key) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return kv_.count(key) > 0; });
    return kv_[key];
  }
  void set_once(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_.emplace(key, value);
    cv_.notify_all();
  }
  bool try_get(const std::string& key, std::string* value) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = kv_.find(key);
    if (it == kv_.end()) return false;
    *value = it->second;
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

inline Config small_config() {
  Config c;
  c.slot_bytes = 64 << 10;
  c.ring_bytes = 8 << 10;
  c.oneshot_max_bytes = 16 << 10;
  c.p2p_chunk_bytes = 4 << 10;
  c.spin_us = 5;
  c.yield_us = 50;
  return c;
}

// Runs fn(rank, transport) on `world` threads, each with its own transport ("shm", "tcp",
// or "mixed" over the made-up hosts `hosts`, one label per rank; "mixed-flat" the same
// without hierarchical collectives) of one group.
inline void run_ranks(int world, const std::function<void(int, Transport&)>& fn,
               std::chrono::milliseconds timeout = std::chrono::milliseconds(10000),
               const std::string& kind = "shm", const Config& config = small_config(),
               const std::vector<int>& hosts = {}) {
  MemoryRendezvous rv;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Transport> t;
        if (kind == "mixed" || kind == "mixed-flat") {
          t = std::make_unique<MixedTransport>(r, world, rv, config, timeout, HostMap::from(hosts), kind == "mixed");
        } else if (kind == "tcp") {
          t = std::make_unique<tcp::TcpTransport>(r, world, rv, config, timeout);
        } else {
          t = std::make_unique<shm::ShmTransport>(r, world, rv, config, timeout);
        }
        fn(r, *t);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

inline collectives::Comm comm(Transport& t, uint64_t seq, int timeout_ms = 10000) {
  static Config config = small_config();
  thread_local std::vector<char> scratch;  // one per rank (thread), as the backend keeps one per group
  collectives::Comm c{t.arena(), t.p2p(), config, Clock::now() + std::chrono::milliseconds(timeout_ms), seq, true,
                      &scratch};
  c.hierarchy = t.hierarchy();  // as the backend's queue does
  return c;
}

}  // namespace torchpar::tptest

// Groups spanning hosts (issue 21), with threads as ranks and the hosts made up: the mixed
// transport takes its host map as an input, so one process can play several hosts (each
// host's ranks share a segment of their own; ranks of different hosts talk TCP on loopback).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "collectives/collectives.h"
#include "common/error.h"
#include "ranks.h"
#include "transport/mixed_transport.h"

namespace torchpar {
namespace {

using collectives::ReduceOp;
using tptest::comm;
using tptest::run_ranks;
using tptest::small_config;

std::string name_of(const std::vector<int>& hosts) {
  std::string s = "hosts";
  for (int h : hosts) s += std::to_string(h);
  return s;
}

// (host of each rank, hierarchical collectives or not)
class Hosts : public ::testing::TestWithParam<std::tuple<std::vector<int>, bool>> {
 protected:
  const std::vector<int>& hosts() const { return std::get<0>(GetParam()); }
  int world() const { return static_cast<int>(hosts().size()); }
  void run(const std::function<void(int, Transport&)>& fn) {
    run_ranks(world(), fn, std::chrono::milliseconds(20000), std::get<1>(GetParam()) ? "mixed" : "mixed-flat",
              small_config(), hosts());
  }
};

TEST_P(Hosts, PeersOnTheSameHostShareMemoryTheOthersUseTcp) {
  run([&](int rank, Transport& t) {
    auto& mixed = dynamic_cast<MixedTransport&>(t);
    EXPECT_STREQ(t.name(), "mixed");
    for (int peer = 0; peer < world(); ++peer) {
      if (peer == rank) continue;
      EXPECT_EQ(mixed.shares_memory_with(peer), hosts()[peer] == hosts()[rank]) << rank << " -> " << peer;
    }
    EXPECT_EQ(t.hierarchy() != nullptr, std::get<1>(GetParam()));
  });
}

TEST_P(Hosts, RingOfSendsLargerThanThePipes) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    const size_t bytes = 100'003;  // ~12 rings of small_config() and many TCP chunks
    std::vector<uint8_t> out(bytes), in(bytes);
    for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(rank * 31 + i);
    const int prev = (rank + world - 1) % world;
    auto r = t.p2p().irecv(prev, 5, in.data(), bytes, deadline);
    auto s = t.p2p().isend((rank + 1) % world, 5, out.data(), bytes, deadline);
    s->wait();
    r->wait();
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(in[i], static_cast<uint8_t>(prev * 31 + i)) << i;
  });
}

// Exact values: integers, and floats that are small integers (every order of summation gives
// the same), at sizes that take the one-shot and the chunked paths of every stage.
TEST_P(Hosts, AllreduceEqualsExactValues) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    uint64_t seq = 0;
    for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{70'001}}) {
      std::vector<int64_t> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = static_cast<int64_t>(i % 97) * (rank + 1) - rank;
      auto c = comm(t, seq++, 20000);
      collectives::allreduce(c, v.data(), n, c10::ScalarType::Long, ReduceOp::kSum);
      const int64_t ranks_sum = world * (world + 1) / 2, minus = world * (world - 1) / 2;
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[i], static_cast<int64_t>(i % 97) * ranks_sum - minus) << "n=" << n;

      std::vector<int32_t> m(n);
      for (size_t i = 0; i < n; ++i) m[i] = static_cast<int32_t>((i + rank * 7) % 13);
      auto c2 = comm(t, seq++, 20000);
      collectives::allreduce(c2, m.data(), n, c10::ScalarType::Int, ReduceOp::kMax);
      for (size_t i = 0; i < n; ++i) {
        int32_t want = 0;
        for (int q = 0; q < world; ++q) want = std::max(want, static_cast<int32_t>((i + q * 7) % 13));
        ASSERT_EQ(m[i], want) << "n=" << n << " i=" << i;
      }

      std::vector<float> f(n, static_cast<float>(rank + 1));
      auto c3 = comm(t, seq++, 20000);
      collectives::allreduce(c3, f.data(), n, c10::ScalarType::Float, ReduceOp::kAvg);
      for (float x : f) ASSERT_EQ(x, (world + 1) / 2.0f) << "n=" << n;

      std::vector<int64_t> a(n, 10 * (rank + 1));
      auto c4 = comm(t, seq++, 20000);
      collectives::allreduce(c4, a.data(), n, c10::ScalarType::Long, ReduceOp::kAvg);
      for (int64_t x : a) ASSERT_EQ(x, 10 * (world + 1) / 2) << "n=" << n;  // the flat algorithm's integer division
    }
  });
}

// Random floats: every rank ends with the same bits, and (hierarchically) those of the
// documented order: each host's ranks summed in rank order, then the hosts' sums in host
// order (hosts ordered by their lowest rank).
TEST_P(Hosts, FloatSumIsBitIdenticalOnEveryRankAndFollowsTheDocumentedOrder) {
  const int world = this->world();
  auto input = [](int rank, size_t n) {
    std::mt19937 gen(rank + 1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(gen) * (1 << (rank * 3));  // magnitudes apart, so order shows
    return v;
  };
  const HostMap map = HostMap::from(hosts());
  // 20k: the three stages one after the other; 70k (more than two 64 KiB slots): pipelined.
  for (size_t n : {size_t{20'000}, size_t{70'000}}) {
    std::vector<std::vector<float>> inputs(world);
    for (int r = 0; r < world; ++r) inputs[r] = input(r, n);
    std::vector<float> want(n);
    for (size_t i = 0; i < n; ++i) {
      float total = 0;
      for (int h = 0; h < map.hosts(); ++h) {
        float part = 0;
        for (size_t k = 0; k < map.ranks_of[h].size(); ++k) {
          float x = inputs[map.ranks_of[h][k]][i];
          part = k == 0 ? x : part + x;
        }
        total = h == 0 ? part : total + part;
      }
      want[i] = total;
    }
    std::vector<std::vector<float>> got(world);
    run([&](int rank, Transport& t) {
      got[rank] = inputs[rank];
      auto c = comm(t, 0, 20000);
      collectives::allreduce(c, got[rank].data(), n, c10::ScalarType::Float, ReduceOp::kSum);
    });
    for (int r = 1; r < world; ++r) EXPECT_EQ(std::memcmp(got[r].data(), got[0].data(), n * sizeof(float)), 0) << r;
    if (std::get<1>(GetParam())) EXPECT_EQ(std::memcmp(got[0].data(), want.data(), n * sizeof(float)), 0) << n;
  }
}

// float16 sums go flat (review finding): a host's partial sum stored in float16 overflowed
// where the flat algorithm, adding in float32 and rounding once, gives finite values
// (all_reduce, reduce_scatter and reduce). Ranks hold +40000 and -40000 alternately by host,
// so host partials of two ranks pass 65504.
TEST_P(Hosts, HalfSumsThatPassTheRangeOnOneHostStayFinite) {
  const std::vector<int>& hosts = this->hosts();
  run([&](int rank, Transport& t) {
    const float sign = hosts[rank] % 2 == 0 ? 1.0f : -1.0f;
    float expect_sum = 0;
    for (int h : hosts) expect_sum += (h % 2 == 0 ? 1.0f : -1.0f) * 40000.0f;
    std::vector<c10::Half> v(5, c10::Half(sign * 40000.0f));
    auto c = comm(t, 0, 20000);
    collectives::allreduce(c, v.data(), v.size(), c10::ScalarType::Half, ReduceOp::kSum);
    std::vector<c10::Half> a(5, c10::Half(40000.0f));
    auto c2 = comm(t, 1, 20000);
    collectives::allreduce(c2, a.data(), a.size(), c10::ScalarType::Half, ReduceOp::kAvg);
    std::vector<c10::Half> blocks(hosts.size() * 5, c10::Half(sign * 40000.0f)), piece(5);
    std::vector<const void*> ins;
    for (size_t q = 0; q < hosts.size(); ++q) ins.push_back(blocks.data() + q * 5);
    auto c3 = comm(t, 2, 20000);
    collectives::reduce_scatter(c3, ins.data(), piece.data(), 5, c10::ScalarType::Half, ReduceOp::kSum);
    std::vector<c10::Half> r(5, c10::Half(sign * 40000.0f));
    auto c4 = comm(t, 3, 20000);
    collectives::reduce(c4, r.data(), r.size(), c10::ScalarType::Half, ReduceOp::kSum, 0);
    for (size_t i = 0; i < v.size(); ++i) {
      if (std::abs(expect_sum) <= 65504.0f) {
        EXPECT_EQ(static_cast<float>(v[i]), expect_sum) << rank;
        EXPECT_EQ(static_cast<float>(piece[i]), expect_sum) << rank;
        EXPECT_EQ(static_cast<float>(r[i]), rank == 0 ? expect_sum : sign * 40000.0f) << rank;
      }
      EXPECT_EQ(static_cast<float>(a[i]), 40000.0f) << rank;
    }
  });
}

TEST_P(Hosts, CoalescedAllreduceOverSeveralBuffers) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    // 43001 doubles: more than two 64 KiB slots, so the pipelined all_reduce packs them (on
    // the leaders, or on every rank by rails). With rails of three the last 43001 % 3 = 2
    // elements, which go through the leaders' stages, span the last two buffers.
    std::vector<double> a(3000, rank + 1.0), b(40'000, 2.0 * rank), d(1, 3.0 * rank);
    collectives::Segments segments;
    segments.add(a.data(), a.size() * sizeof(double));
    segments.add(b.data(), b.size() * sizeof(double));
    segments.add(d.data(), d.size() * sizeof(double));
    auto c = comm(t, 0, 20000);
    collectives::allreduce(c, segments, a.size() + b.size() + d.size(), c10::ScalarType::Double, ReduceOp::kSum);
    for (double x : a) ASSERT_EQ(x, world * (world + 1) / 2.0);
    for (double x : b) ASSERT_EQ(x, world * (world - 1.0));
    ASSERT_EQ(d[0], 1.5 * world * (world - 1.0));
  });
}

TEST_P(Hosts, BroadcastFromEveryRoot) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    uint64_t seq = 0;
    for (int root = 0; root < world; ++root) {
      for (size_t n : {size_t{0}, size_t{5}, size_t{50'000}}) {
        std::vector<int32_t> v(n, rank == root ? 0 : -1);
        if (rank == root) {
          for (size_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(i * 3 + root);
        }
        auto c = comm(t, seq++, 20000);
        collectives::broadcast(c, v.data(), n, c10::ScalarType::Int, root);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[i], static_cast<int32_t>(i * 3 + root)) << "root " << root;
      }
    }
  });
}

// all_gather, reduce_scatter and reduce: hierarchical on the hierarchical layouts (through
// each host's arena, then by rails on hosts of equal size or through the hosts' leaders),
// flat point-to-point otherwise. Sizes take the
// empty, one-shot and chunked paths of every stage (small_config: 64 KiB slots, 4 KiB chunks).
TEST_P(Hosts, AllgatherEqualsExactValues) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    uint64_t seq = 0;
    for (size_t n : {size_t{0}, size_t{1}, size_t{3001}, size_t{40'000}}) {
      std::vector<int64_t> in(n);
      for (size_t i = 0; i < n; ++i) in[i] = rank * 1'000'000 + static_cast<int64_t>(i);
      std::vector<std::vector<int64_t>> outs(world, std::vector<int64_t>(n, -1));
      std::vector<void*> out_ptrs;
      for (auto& o : outs) out_ptrs.push_back(o.data());
      auto c = comm(t, seq++, 20000);
      collectives::allgather(c, in.data(), out_ptrs.data(), n, c10::ScalarType::Long);
      for (int q = 0; q < world; ++q) {
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(outs[q][i], q * 1'000'000 + static_cast<int64_t>(i)) << "n=" << n;
      }
      // In place, as all_gather_into_tensor: the input is this rank's block of the output.
      std::vector<uint8_t> flat(world * n, 0xff);
      for (size_t i = 0; i < n; ++i) flat[rank * n + i] = static_cast<uint8_t>(rank * 17 + i);
      std::vector<void*> blocks;
      for (int q = 0; q < world; ++q) blocks.push_back(flat.data() + q * n);
      auto c2 = comm(t, seq++, 20000);
      collectives::allgather(c2, blocks[rank], blocks.data(), n, c10::ScalarType::Byte);
      for (int q = 0; q < world; ++q) {
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(flat[q * n + i], static_cast<uint8_t>(q * 17 + i)) << "n=" << n;
      }
    }
  });
}

TEST_P(Hosts, ReduceScatterEqualsExactValues) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    uint64_t seq = 0;
    for (size_t n : {size_t{0}, size_t{1}, size_t{3001}, size_t{20'000}}) {
      std::vector<std::vector<int64_t>> ins(world, std::vector<int64_t>(n));
      std::vector<const void*> in_ptrs;
      for (int q = 0; q < world; ++q) {
        for (size_t i = 0; i < n; ++i) ins[q][i] = (rank + 1) * (q + 1) + static_cast<int64_t>(i);
        in_ptrs.push_back(ins[q].data());
      }
      std::vector<int64_t> piece(n, -1);
      auto c = comm(t, seq++, 20000);
      collectives::reduce_scatter(c, in_ptrs.data(), piece.data(), n, c10::ScalarType::Long, ReduceOp::kSum);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(piece[i], (rank + 1) * world * (world + 1) / 2 + world * static_cast<int64_t>(i)) << "n=" << n;
      }

      std::vector<std::vector<int32_t>> m(world, std::vector<int32_t>(n));
      std::vector<const void*> m_ptrs;
      for (int q = 0; q < world; ++q) {
        for (size_t i = 0; i < n; ++i) m[q][i] = static_cast<int32_t>((i + rank * 7 + q) % 13);
        m_ptrs.push_back(m[q].data());
      }
      std::vector<int32_t> mx(n, -1);
      auto c2 = comm(t, seq++, 20000);
      collectives::reduce_scatter(c2, m_ptrs.data(), mx.data(), n, c10::ScalarType::Int, ReduceOp::kMax);
      for (size_t i = 0; i < n; ++i) {
        int32_t want = 0;
        for (int p = 0; p < world; ++p) want = std::max(want, static_cast<int32_t>((i + p * 7 + rank) % 13));
        ASSERT_EQ(mx[i], want) << "n=" << n << " i=" << i;
      }

      std::vector<int64_t> a(world * n, 10 * (rank + 1));
      std::vector<const void*> a_ptrs;
      for (int q = 0; q < world; ++q) a_ptrs.push_back(a.data() + q * n);
      std::vector<int64_t> avg(n, -1);
      auto c3 = comm(t, seq++, 20000);
      collectives::reduce_scatter(c3, a_ptrs.data(), avg.data(), n, c10::ScalarType::Long, ReduceOp::kAvg);
      for (int64_t x : avg) ASSERT_EQ(x, 10 * (world + 1) / 2) << "n=" << n;  // the flat integer division
    }
  });
}

// Random floats: reduce_scatter's piece has the bits of the same piece of an all_reduce of
// the same inputs (the two add in the same order, hierarchical or flat), on every rank; so
// has reduce's result on every root.
TEST_P(Hosts, ReduceScatterOfFloatsEqualsThatPieceOfAllreduce) {
  const int world = this->world();
  const size_t n = 9000;
  run([&](int rank, Transport& t) {
    std::mt19937 gen(rank + 1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> all(world * n);
    for (size_t i = 0; i < all.size(); ++i) all[i] = dist(gen) * (1 << (rank * 3));
    std::vector<const void*> blocks;
    for (int q = 0; q < world; ++q) blocks.push_back(all.data() + q * n);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::vector<float> piece(n);
      auto c = comm(t, 2 * static_cast<int>(op), 20000);
      collectives::reduce_scatter(c, blocks.data(), piece.data(), n, c10::ScalarType::Float, op);
      std::vector<float> reduced = all;
      auto c2 = comm(t, 2 * static_cast<int>(op) + 1, 20000);
      collectives::allreduce(c2, reduced.data(), reduced.size(), c10::ScalarType::Float, op);
      ASSERT_EQ(std::memcmp(piece.data(), reduced.data() + rank * n, n * sizeof(float)), 0) << collectives::name(op);
      // reduce adds in the same order (hierarchical.h): the root gets all_reduce's bits.
      for (int root = 0; root < world; ++root) {
        std::vector<float> r = all;
        auto c3 = comm(t, 100 + 2 * world * static_cast<int>(op) + root, 20000);
        collectives::reduce(c3, r.data(), r.size(), c10::ScalarType::Float, op, root);
        if (rank == root) ASSERT_EQ(std::memcmp(r.data(), reduced.data(), r.size() * sizeof(float)), 0) << root;
      }
    }
  });
}

TEST_P(Hosts, ReduceToEveryRootEqualsExactValues) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    uint64_t seq = 0;
    for (int root = 0; root < world; ++root) {
      for (size_t n : {size_t{0}, size_t{5}, size_t{20'000}}) {
        std::vector<int64_t> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = (rank + 1) * static_cast<int64_t>(i % 101);
        const std::vector<int64_t> before = v;
        auto c = comm(t, seq++, 20000);
        collectives::reduce(c, v.data(), n, c10::ScalarType::Long, ReduceOp::kSum, root);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(v[i], rank == root ? world * (world + 1) / 2 * static_cast<int64_t>(i % 101) : before[i])
              << "root " << root << " n=" << n;
        }
        std::vector<double> a(n, 2.0 * (rank + 1));
        auto c2 = comm(t, seq++, 20000);
        collectives::reduce(c2, a.data(), n, c10::ScalarType::Double, ReduceOp::kAvg, root);
        for (double x : a) ASSERT_EQ(x, rank == root ? world + 1.0 : 2.0 * (rank + 1)) << "root " << root;
      }
    }
  });
}

// Element sizes 1, 2 and 8 at counts around the pipelined all_reduce's threshold (two slots:
// 64 Ki int8, 32 Ki bfloat16, 8 Ki double) and odd counts: a last chunk of one element, pieces
// of a chunk that the hosts do not divide evenly, counts smaller than a piece. Small integers,
// so every order of summation gives the same exact values; reduce_scatter in place (the
// output is this rank's input block, as reduce_scatter_tensor over a view), all_gather in
// place, both pipelined too (hierarchical_pipeline.h), reduce to every root.
template <typename T>
void odd_counts_of(int rank, int world, Transport& t, c10::ScalarType dtype, size_t slot, uint64_t& seq) {
  const auto value = [](int r, size_t i) { return static_cast<float>((i + 3 * r) % 5); };
  for (size_t n : {size_t{1}, size_t{17}, 2 * slot, 2 * slot + 1, 3 * slot - 1, 5 * slot + 7}) {
    std::vector<T> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<T>(value(rank, i));
    auto c = comm(t, seq++, 20000);
    collectives::allreduce(c, v.data(), n, dtype, ReduceOp::kSum);
    for (size_t i = 0; i < n; ++i) {
      float want = 0;
      for (int q = 0; q < world; ++q) want += value(q, i);
      ASSERT_EQ(static_cast<float>(v[i]), want) << "all_reduce n=" << n << " i=" << i;
    }
    std::vector<T> mx(n);
    for (size_t i = 0; i < n; ++i) mx[i] = static_cast<T>(value(rank, i));
    auto c2 = comm(t, seq++, 20000);
    collectives::allreduce(c2, mx.data(), n, dtype, ReduceOp::kMax);
    for (size_t i = 0; i < n; ++i) {
      float want = 0;
      for (int q = 0; q < world; ++q) want = std::max(want, value(q, i));
      ASSERT_EQ(static_cast<float>(mx[i]), want) << "all_reduce max n=" << n << " i=" << i;
    }
  }
  // slot + 7 per block: more than two slots in all (every layout), so reduce_scatter and
  // all_gather run pipelined in chunks of every block, the last chunk 7 elements long.
  for (size_t n : {size_t{1}, size_t{17}, size_t{4099}, slot + 7}) {
    std::vector<T> gathered(world * n);
    for (size_t i = 0; i < n; ++i) gathered[rank * n + i] = static_cast<T>(value(rank, i));
    std::vector<void*> blocks;
    for (int q = 0; q < world; ++q) blocks.push_back(gathered.data() + q * n);
    auto c0 = comm(t, seq++, 20000);
    collectives::allgather(c0, blocks[rank], blocks.data(), n, dtype);  // in place
    for (int q = 0; q < world; ++q) {
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(static_cast<float>(gathered[q * n + i]), value(q, i)) << "all_gather n=" << n << " q=" << q << " i=" << i;
      }
    }
    std::vector<T> all(world * n);
    std::vector<const void*> ins;
    for (int q = 0; q < world; ++q) {
      for (size_t i = 0; i < n; ++i) all[q * n + i] = static_cast<T>(value(rank, q * n + i));
      ins.push_back(all.data() + q * n);
    }
    auto c = comm(t, seq++, 20000);
    collectives::reduce_scatter(c, ins.data(), all.data() + rank * n, n, dtype, ReduceOp::kSum);
    for (size_t i = 0; i < n; ++i) {
      float want = 0;
      for (int q = 0; q < world; ++q) want += value(q, rank * n + i);
      ASSERT_EQ(static_cast<float>(all[rank * n + i]), want) << "reduce_scatter n=" << n << " i=" << i;
    }
    for (int root = 0; root < world; ++root) {
      std::vector<T> r(n);
      for (size_t i = 0; i < n; ++i) r[i] = static_cast<T>(value(rank, i));
      auto c2 = comm(t, seq++, 20000);
      collectives::reduce(c2, r.data(), n, dtype, ReduceOp::kSum, root);
      for (size_t i = 0; i < n; ++i) {
        float want = value(rank, i);
        if (rank == root) {
          want = 0;
          for (int q = 0; q < world; ++q) want += value(q, i);
        }
        ASSERT_EQ(static_cast<float>(r[i]), want) << "reduce root " << root << " n=" << n << " i=" << i;
      }
    }
  }
}

TEST_P(Hosts, OddCountsOfNarrowAndWideDtypes) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    uint64_t seq = 0;
    odd_counts_of<int8_t>(rank, world, t, c10::ScalarType::Char, 64 << 10, seq);
    odd_counts_of<c10::BFloat16>(rank, world, t, c10::ScalarType::BFloat16, 32 << 10, seq);
    odd_counts_of<double>(rank, world, t, c10::ScalarType::Double, 8 << 10, seq);
  });
}

TEST_P(Hosts, BarrierAndAllToAllOverTheMixedTransport) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    const size_t n = 3001;
    std::vector<int64_t> sends(world * n), recvs(world * n, -1);
    std::vector<const void*> send_ptrs;
    std::vector<void*> recv_ptrs;
    std::vector<size_t> counts(world, n);
    for (int q = 0; q < world; ++q) {
      for (size_t i = 0; i < n; ++i) sends[q * n + i] = rank * 100 + q + static_cast<int64_t>(i) * 1000;
      send_ptrs.push_back(sends.data() + q * n);
      recv_ptrs.push_back(recvs.data() + q * n);
    }
    auto c = comm(t, 0, 20000);
    collectives::alltoall(c, send_ptrs.data(), counts.data(), recv_ptrs.data(), counts.data(), c10::ScalarType::Long);
    for (int q = 0; q < world; ++q) {
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(recvs[q * n + i], q * 100 + rank + static_cast<int64_t>(i) * 1000);
    }
    auto c2 = comm(t, 1, 20000);
    collectives::barrier(c2);
  });
}

TEST_P(Hosts, MismatchFailsEveryRankAlikeAndTheGroupStaysUsable) {
  const int world = this->world();
  std::vector<std::string> messages(world);
  run([&](int rank, Transport& t) {
    std::vector<double> v(10 + (rank == world - 1), 1.0);
    auto c = comm(t, 0, 20000);
    try {
      collectives::allreduce(c, v.data(), v.size(), c10::ScalarType::Double, ReduceOp::kSum);
      ADD_FAILURE() << "rank " << rank << " did not notice the mismatch";
    } catch (const UsageError& e) {
      messages[rank] = e.what();
      messages[rank] = messages[rank].substr(messages[rank].find("collective mismatch"));
    }
    // A different collective altogether is a mismatch too, named as such.
    auto c2 = comm(t, 1, 20000);
    std::vector<int32_t> w(4, rank);
    if (rank == 0) {
      EXPECT_THROW(collectives::broadcast(c2, w.data(), 4, c10::ScalarType::Int, 0), UsageError);
    } else {
      EXPECT_THROW(collectives::allreduce(c2, w.data(), 4, c10::ScalarType::Int, ReduceOp::kSum), UsageError);
    }
    auto c3 = comm(t, 2, 20000);
    collectives::allreduce(c3, v.data(), 10, c10::ScalarType::Double, ReduceOp::kMax);
    EXPECT_EQ(v[0], 1.0);
    // all_gather and reduce_scatter check every rank's call before moving data, too.
    std::vector<float> in(8, 1.0f), out(world * 8);
    std::vector<void*> outs;
    std::vector<const void*> ins;
    for (int q = 0; q < world; ++q) {
      outs.push_back(out.data() + q * 8);
      ins.push_back(out.data() + q * 8);
    }
    auto c4 = comm(t, 3, 20000);
    EXPECT_THROW(collectives::allgather(c4, in.data(), outs.data(), rank == 0 ? 7 : 8, c10::ScalarType::Float),
                 UsageError);
    auto c5 = comm(t, 4, 20000);
    EXPECT_THROW(collectives::reduce_scatter(c5, ins.data(), in.data(), 8, c10::ScalarType::Float,
                                             rank == world - 1 ? ReduceOp::kMax : ReduceOp::kSum),
                 UsageError);
    auto c6 = comm(t, 5, 20000);
    collectives::allgather(c6, in.data(), outs.data(), 8, c10::ScalarType::Float);
    EXPECT_EQ(out[world * 8 - 1], 1.0f);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(messages[r], messages[0]) << r;
    EXPECT_NE(messages[r].find("rank " + std::to_string(world - 1) + " called all_reduce of 11"), std::string::npos)
        << messages[r];
  }
}

// reduce with roots that differ, all_gather with dtypes that differ (same byte count):
// the same message on every rank, before any data moves, and the group stays usable.
TEST_P(Hosts, ReduceAndAllgatherMismatchesFailEveryRankAlike) {
  const int world = this->world();
  std::vector<std::string> roots(world), dtypes(world);
  run([&](int rank, Transport& t) {
    std::vector<int32_t> v(6, rank);
    auto c = comm(t, 0, 20000);
    try {
      collectives::reduce(c, v.data(), v.size(), c10::ScalarType::Int, ReduceOp::kSum, rank == world - 1 ? 1 : 0);
      ADD_FAILURE() << "rank " << rank << " did not notice the mismatch";
    } catch (const UsageError& e) {
      roots[rank] = e.what();
      roots[rank] = roots[rank].substr(roots[rank].find("collective mismatch"));
    }
    EXPECT_EQ(v[0], rank);
    std::vector<int32_t> out(world * 6, -1);
    std::vector<void*> outs;
    for (int q = 0; q < world; ++q) outs.push_back(out.data() + q * 6);
    auto c2 = comm(t, 1, 20000);
    try {
      collectives::allgather(c2, v.data(), outs.data(), 6, rank == 0 ? c10::ScalarType::Float : c10::ScalarType::Int);
      ADD_FAILURE() << "rank " << rank << " did not notice the mismatch";
    } catch (const UsageError& e) {
      dtypes[rank] = e.what();
      dtypes[rank] = dtypes[rank].substr(dtypes[rank].find("collective mismatch"));
    }
    auto c3 = comm(t, 2, 20000);
    collectives::reduce(c3, v.data(), v.size(), c10::ScalarType::Int, ReduceOp::kSum, world - 1);
    EXPECT_EQ(v[0], rank == world - 1 ? world * (world - 1) / 2 : rank);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(roots[r], roots[0]) << r;
    EXPECT_EQ(dtypes[r], dtypes[0]) << r;
  }
}

// float16 sums run flat and float16 maxima hierarchical (hier::reduces_flat): ranks that
// disagree on the op take different algorithms, and still fail alike (both begin with the
// same agreement), for all_reduce, reduce_scatter and reduce.
TEST_P(Hosts, HalfOpMismatchAcrossTheFlatAndHierarchicalPathsFailsEveryRank) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    const ReduceOp op = rank == 0 ? ReduceOp::kMax : ReduceOp::kSum;
    std::vector<c10::Half> v(world * 8, c10::Half(1.0f)), piece(8);
    std::vector<const void*> ins;
    for (int q = 0; q < world; ++q) ins.push_back(v.data() + q * 8);
    auto c = comm(t, 0, 20000);
    EXPECT_THROW(collectives::allreduce(c, v.data(), v.size(), c10::ScalarType::Half, op), UsageError);
    auto c2 = comm(t, 1, 20000);
    EXPECT_THROW(collectives::reduce_scatter(c2, ins.data(), piece.data(), 8, c10::ScalarType::Half, op), UsageError);
    auto c3 = comm(t, 2, 20000);
    EXPECT_THROW(collectives::reduce(c3, v.data(), 8, c10::ScalarType::Half, op, world - 1), UsageError);
    auto c4 = comm(t, 3, 20000);
    collectives::allreduce(c4, v.data(), 8, c10::ScalarType::Half, ReduceOp::kSum);
    EXPECT_EQ(static_cast<float>(v[0]), static_cast<float>(world));
  });
}

// A rank that gives up fails every rank of every host rather than leaving them to their
// timeout: its host's ranks through the segment, the others through its closed sockets,
// each failing rank aborting in turn (as the backend does) to reach its own host.
TEST_P(Hosts, AnAbortReachesEveryHost) {
  const int world = this->world();
  run([&](int rank, Transport& t) {
    std::vector<float> v(5000, 1.0f);
    if (rank == world - 1) {
      t.abort("rank " + std::to_string(rank) + " gave up (test)");
      return;
    }
    auto c = comm(t, 0, 15000);
    const auto start = Clock::now();
    try {
      collectives::allreduce(c, v.data(), v.size(), c10::ScalarType::Float, ReduceOp::kSum);
      ADD_FAILURE() << "rank " << rank << " finished an all-reduce without rank " << world - 1;
    } catch (const Error& e) {
      EXPECT_LT(Clock::now() - start, std::chrono::seconds(10)) << e.what();
      t.abort(e.what());  // as the backend's queue does with a failed collective
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Hosts,
    ::testing::Combine(::testing::Values(std::vector<int>{0, 0, 1, 1}, std::vector<int>{0, 1, 1, 0},
                                         std::vector<int>{0, 0, 1, 2}, std::vector<int>{0, 1},
                                         // Rails of three ranks; three hosts, interleaved.
                                         std::vector<int>{0, 0, 0, 1, 1, 1}, std::vector<int>{0, 1, 2, 2, 1, 0}),
                       ::testing::Bool()),
    [](const auto& info) {
      return name_of(std::get<0>(info.param)) + (std::get<1>(info.param) ? "Hierarchical" : "Flat");
    });

}  // namespace
}  // namespace torchpar

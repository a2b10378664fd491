#include "transport/connect.h"

#include <sched.h>

#include <algorithm>
#include <string>
#include <utility>

#include "common/error.h"
#include "transport/hosts.h"
#include "transport/mixed_transport.h"
#include "transport/records.h"
#include "transport/shm/shm_transport.h"
#include "transport/store_keys.h"
#include "transport/tcp/tcp_transport.h"

namespace torchpar {
namespace {

// Every rank must use the same value of a setting that decides what goes on the wire. Each
// rank checks every rank's, so all of them refuse a mixed group with the same message.
void check_same_everywhere(Rendezvous& rv, int rank, int size, const std::string& name, const std::string& mine) {
  const std::string first = rank == 0 ? mine : rv.get(store_keys::setting(name, 0));
  for (int r = 1; r < size; ++r) {
    const std::string other = r == rank ? mine : rv.get(store_keys::setting(name, r));
    TP_CHECK_USAGE(other == first, "torchpar: ", name, " differs between rank 0 (", first, ") and rank ", r,
                   " (", other, "); every rank must use the same");
  }
}

// With more ranks on this machine's cores than it has, a waiting rank's spinning or
// yielding only delays the rank it waits for (shm_transport.cpp): sleep at once instead,
// unless the user chose. Ranks on one machine share a kernel (its boot id), whatever host
// their network namespaces make them: the test hosts of tests/netns.py, or containers.
// Measured on the 2-core machine with 2 test hosts x 2 ranks (bench_hosts_allreduce.py):
// a 4 KiB all_reduce took 23 ms with the default 2 ms of yielding, 1.6 ms without.
Config adapt_to_machine(Config config, const std::vector<HostIdentity>& ranks, const HostIdentity& mine) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  const auto here = std::count_if(ranks.begin(), ranks.end(), [&](const HostIdentity& h) {
    return h.boot_id == mine.boot_id && h.hostname == mine.hostname;
  });
  if (here > cpus) {
    if (!env_set("TORCHPAR_SPIN_US")) config.spin_us = std::min<int64_t>(config.spin_us, 2);
    if (!env_set("TORCHPAR_YIELD_US")) config.yield_us = 0;
  }
  return config;
}

}  // namespace

std::unique_ptr<Transport> connect(Rendezvous& rv, int rank, int size, const Config& config,
                                   std::chrono::milliseconds timeout) {
  // Everything is published before anything is checked, so that a rank refusing the group
  // never leaves the others waiting for its keys.
  const HostIdentity mine = HostIdentity::local();
  // 1 (default): a group spanning hosts runs all_reduce and broadcast hierarchically; 0: its
  // collectives run the point-to-point algorithms over the mixed transport (a baseline).
  // Read as text and checked after publishing: a rank throwing here left the others waiting.
  const std::string hierarchical = env_str("TORCHPAR_HIERARCHICAL", "1");
  const std::pair<std::string, std::string> settings[] = {
      {"TORCHPAR_TRANSPORT", config.transport},
      {"TORCHPAR_HIERARCHICAL", hierarchical},
      {"TORCHPAR_SHM_SLOT_BYTES", std::to_string(config.slot_bytes)},
      {"TORCHPAR_ONESHOT_MAX_BYTES", std::to_string(config.oneshot_max_bytes)},
      {"TORCHPAR_P2P_CHUNK_BYTES", std::to_string(config.p2p_chunk_bytes)}};
  rv.set(store_keys::host(rank), mine.encode());
  for (const auto& [name, value] : settings) rv.set(store_keys::setting(name, rank), value);

  TP_CHECK_USAGE(config.unexpected_max_bytes >= 0, "torchpar: TORCHPAR_UNEXPECTED_MAX_BYTES must not be negative");
  TP_CHECK_USAGE(config.transport == "auto" || config.transport == "shm" || config.transport == "tcp",
                 "torchpar: TORCHPAR_TRANSPORT must be auto, shm or tcp, not '", config.transport, "'");
  TP_CHECK_USAGE(hierarchical == "0" || hierarchical == "1", "torchpar: TORCHPAR_HIERARCHICAL must be 0 or 1, not '",
                 hierarchical, "'");
  for (const auto& [name, value] : settings) check_same_everywhere(rv, rank, size, name, value);
  std::vector<HostIdentity> identities(size);
  int elsewhere = -1;
  for (int r = 0; r < size; ++r) {
    identities[r] = r == rank ? mine : read_record<HostIdentity>(rv, store_keys::host(r));
    if (elsewhere < 0 && identities[r] != mine) elsewhere = r;
  }
  const HostIdentity& theirs = identities[elsewhere < 0 ? rank : elsewhere];
  TP_CHECK_USAGE(elsewhere < 0 || config.transport != "shm", "torchpar: TORCHPAR_TRANSPORT=shm, but rank ",
                 elsewhere, " runs on another host (", theirs.hostname, ") than rank ", rank, " (",
                 mine.hostname, ")");
  if (elsewhere < 0 && config.transport != "tcp") {
    return std::make_unique<shm::ShmTransport>(rank, size, rv, config, timeout);
  }
  if (elsewhere < 0 || config.transport == "tcp") {
    return std::make_unique<tcp::TcpTransport>(rank, size, rv, config, timeout);
  }
  return std::make_unique<MixedTransport>(rank, size, rv, adapt_to_machine(config, identities, mine), timeout,
                                          HostMap::from(identities), hierarchical == "1");
}

}  // namespace torchpar

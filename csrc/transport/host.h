// Which ranks share a host, and so can share memory.
#pragma once

#include <string>

namespace torchpar {

// Identifies this host and IPC view: hostname, kernel boot id, PID namespace. Two ranks
// with the same identity can map each other's POSIX shared memory and see each other's pids.
std::string host_identity();

}  // namespace torchpar

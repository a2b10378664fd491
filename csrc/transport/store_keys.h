// Every key torchpar writes in the c10d store, in one place. Torch hands each group a store
// prefixed with the group's name, so these need only be unique within a group.
#pragma once

#include <string>

namespace torchpar::store_keys {

// Rank r's HostIdentity (which ranks can share memory).
inline std::string host(int rank) { return "torchpar/host/" + std::to_string(rank); }
// Rank r's value of a setting every rank must share (TORCHPAR_TRANSPORT ...).
inline std::string setting(const std::string& name, int rank) {
  return "torchpar/setting/" + name + "/" + std::to_string(rank);
}
// The shared-memory segment's name, published by rank 0.
inline const char* const kShmSegment = "torchpar/shm/segment";
// Rank 0's random secret for the group's TCP connections (64 hex digits): ranks prove they
// know it when they connect, never sending it (transport/tcp/handshake.h).
inline const char* const kTcpSecret = "torchpar/tcp/secret";
// Rank r's TCP Contact.
inline std::string tcp_contact(int rank) { return "torchpar/tcp/" + std::to_string(rank); }
// The first AbortNotice of the group (set once).
inline const char* const kTcpAbort = "torchpar/tcp/abort";

}  // namespace torchpar::store_keys

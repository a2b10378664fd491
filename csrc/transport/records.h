// What ranks tell each other through the store while a group is set up (and when it is
// aborted), as typed records: each has one encode() and one decode(), and nothing else
// parses the text. The text is '|'-separated fields; no field may contain '|'.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/error.h"
#include "transport/rendezvous.h"

namespace torchpar {

// A host and IPC view: two ranks with equal identities can map each other's POSIX shared
// memory and see each other's pids. A network namespace counts as a host of its own (issue
// 21): namespaces on one kernel may share /dev/shm, but they stand for separate machines
// (containers, or the test hosts of tests/netns.py), so ranks in different ones talk TCP.
struct HostIdentity {
  std::string hostname;
  std::string boot_id;        // the kernel's boot id: a hostname may be reused by containers
  std::string pid_namespace;  // inode of /proc/self/ns/pid
  std::string net_namespace;  // inode of /proc/self/ns/net

  static HostIdentity local();
  std::string encode() const;
  static HostIdentity decode(const std::string& text);
  bool operator==(const HostIdentity& o) const {
    return hostname == o.hostname && boot_id == o.boot_id && pid_namespace == o.pid_namespace &&
           net_namespace == o.net_namespace;
  }
  bool operator!=(const HostIdentity& o) const { return !(*this == o); }
};

// How to reach a rank over TCP: its listening port, its host, its IPv4 addresses.
struct Contact {
  uint16_t port = 0;
  HostIdentity host;
  std::vector<std::string> addresses;

  std::string encode() const;
  static Contact decode(const std::string& text);
};

// Why a rank gave up on the group (the first one to say so).
struct AbortNotice {
  int rank = -1;
  std::string reason;  // may contain '|': it is the last field

  std::string encode() const;
  static AbortNotice decode(const std::string& text);
};

// Waits for `key` and decodes it as a Record; a malformed value is an Error that names the
// key as well as what was wrong with it.
template <typename Record>
Record read_record(Rendezvous& rendezvous, const std::string& key) {
  const std::string text = rendezvous.get(key);
  try {
    return Record::decode(text);
  } catch (const Error& e) {
    throw Error(std::string("[torchpar] the store key '") + key + "' holds a malformed value: " + e.what());
  }
}

}  // namespace torchpar

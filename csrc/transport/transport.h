// What the backend holds for a group: a Link to every peer (driven by the point-to-point
// engine), plus, where the ranks share memory, the collective arena (for the whole group,
// or per host in a group spanning hosts).
#pragma once

#include <string>

#include "transport/hosts.h"
#include "transport/link.h"
#include "transport/p2p_engine.h"

namespace torchpar {

namespace shm {
class Arena;
}

class Transport : public Link {
 public:
  // "shm", "tcp" or "mixed" (shared memory within a host, TCP between hosts) (logs, tests, the Python API).
  virtual const char* name() const = 0;
  virtual P2PEngine& p2p() = 0;
  // The shared arena, or null when the ranks cannot map each other's memory (collectives
  // then run their point-to-point algorithms).
  virtual shm::Arena* arena() { return nullptr; }
  // For a group spanning hosts whose collectives go hierarchical (shared memory inside each
  // host, TCP between one leader per host); null otherwise.
  virtual const Hierarchy* hierarchy() const { return nullptr; }
  // abort(reason) (Link): marks the group failed for every rank, first reason wins.
  // Why another rank aborted the group, if it said so ("" otherwise). May block briefly
  // (a store lookup): call it from a thread that is failing anyway, never the progress one.
  virtual std::string abort_reason() { return ""; }
  // This rank's side of the group is closing (the backend's shutdown, after its own work
  // ended): a peer still waiting for this rank fails at once instead of at the timeout. TCP
  // ends its half of each connection; shared memory marks it in the segment.
  virtual void leave() {}
};

}  // namespace torchpar

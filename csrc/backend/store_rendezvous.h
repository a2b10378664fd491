// The transport's Rendezvous over the c10d::Store torch hands each group (already prefixed
// with the group's name). The only place the transport's set-up meets a torch type.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "transport/rendezvous.h"

namespace torchpar {

class StoreRendezvous final : public Rendezvous {
 public:
  // `answer_within` bounds set_once and try_get, the calls a failing group makes (its abort
  // notice, its peers' reasons): c10d's TCPStore client has no deadline of its own there, and
  // a rank whose network went down would otherwise block in recv() for TCP's ~15 minutes
  // (issue 21, tests/test_hosts.py). A call past the bound throws Error.
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store,
                           std::chrono::milliseconds answer_within = std::chrono::seconds(5))
      : store_(std::move(store)), answer_within_(answer_within) {}
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  void set_once(const std::string& key, const std::string& value) override;
  bool try_get(const std::string& key, std::string* value) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds answer_within_;
};

}  // namespace torchpar

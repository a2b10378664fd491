// The transport's Rendezvous over the c10d::Store torch hands each group (already prefixed
// with the group's name). The only place the transport's set-up meets a torch type.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "transport/rendezvous.h"

namespace torchpar {

class StoreRendezvous final : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  void set_once(const std::string& key, const std::string& value) override;
  bool try_get(const std::string& key, std::string* value) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace torchpar

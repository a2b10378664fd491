// A view of a rendezvous whose keys all carry a prefix: the shared-memory transport of one
// host in a group spanning hosts publishes its segment under a key of its own host.
#pragma once

#include <string>
#include <utility>

#include "transport/rendezvous.h"

namespace torchpar {

class PrefixedRendezvous : public Rendezvous {
 public:
  PrefixedRendezvous(Rendezvous& inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::string& value) override { inner_.set(prefix_ + key, value); }
  std::string get(const std::string& key) override { return inner_.get(prefix_ + key); }
  void set_once(const std::string& key, const std::string& value) override { inner_.set_once(prefix_ + key, value); }
  bool try_get(const std::string& key, std::string* value) override { return inner_.try_get(prefix_ + key, value); }

 private:
  Rendezvous& inner_;
  std::string prefix_;
};

}  // namespace torchpar

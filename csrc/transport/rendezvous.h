// The key-value store ranks meet through. The backend implements it over the
// c10d::Store that torch hands each group; the transport never sees torch types.
#pragma once

#include <string>

namespace torchpar {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` is set (bounded by the store's own timeout).
  virtual std::string get(const std::string& key) = 0;
  // Sets `key` unless some rank has set it already (the first value stays).
  virtual void set_once(const std::string& key, const std::string& value) = 0;
  // The value of `key` if it is set, without waiting.
  virtual bool try_get(const std::string& key, std::string* value) = 0;
};

}  // namespace torchpar

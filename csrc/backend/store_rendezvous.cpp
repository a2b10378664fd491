#include "backend/store_rendezvous.h"

#include <vector>

namespace torchpar {

void StoreRendezvous::set(const std::string& key, const std::string& value) {
  store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string StoreRendezvous::get(const std::string& key) {
  auto v = store_->get(key);
  return std::string(v.begin(), v.end());
}

void StoreRendezvous::set_once(const std::string& key, const std::string& value) {
  store_->compareSet(key, {}, std::vector<uint8_t>(value.begin(), value.end()));
}

bool StoreRendezvous::try_get(const std::string& key, std::string* value) {
  if (!store_->check({key})) return false;
  *value = get(key);
  return true;
}

}  // namespace torchpar

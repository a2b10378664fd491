#include "backend/store_rendezvous.h"

#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "common/error.h"

namespace torchpar {
namespace {

using Bytes = std::vector<uint8_t>;

// Runs `call` on a thread of its own and waits at most `bound` for its answer. A call that
// overruns is left to finish (or to block until the process ends) on that thread, which owns
// copies of all it uses; the caller gets an Error at once.
template <typename T>
T within(std::chrono::milliseconds bound, const std::string& what, std::function<T()> call) {
  auto answer = std::make_shared<std::promise<T>>();
  std::future<T> ready = answer->get_future();
  std::thread([answer, call = std::move(call)] {
    try {
      answer->set_value(call());
    } catch (...) {
      answer->set_exception(std::current_exception());
    }
  }).detach();
  if (ready.wait_for(bound) != std::future_status::ready) {
    throw Error(detail::message(__FILE__, __LINE__, "the store did not answer ", what, " within ",
                                bound.count(), " ms (is its host still reachable?)"));
  }
  return ready.get();
}

}  // namespace

void StoreRendezvous::set(const std::string& key, const std::string& value) {
  store_->set(key, Bytes(value.begin(), value.end()));
}

std::string StoreRendezvous::get(const std::string& key) {
  auto v = store_->get(key);
  return std::string(v.begin(), v.end());
}

void StoreRendezvous::set_once(const std::string& key, const std::string& value) {
  within<bool>(answer_within_, "compareSet('" + key + "')", [store = store_, key, value] {
    store->compareSet(key, {}, Bytes(value.begin(), value.end()));
    return true;
  });
}

bool StoreRendezvous::try_get(const std::string& key, std::string* value) {
  auto found = within<std::optional<Bytes>>(
      answer_within_, "check('" + key + "')", [store = store_, key]() -> std::optional<Bytes> {
        if (!store->check({key})) return std::nullopt;
        return store->get(key);
      });
  if (!found) return false;
  *value = std::string(found->begin(), found->end());
  return true;
}

}  // namespace torchpar

#include "transport/request.h"

#include <utility>

namespace torchpar {

bool Request::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool Request::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return done_; });
}

void Request::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

std::exception_ptr Request::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

int Request::source() const {
  std::lock_guard<std::mutex> lock(mu_);
  return source_;
}

void Request::on_done(std::function<void()> fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!done_) {
    on_done_ = std::move(fn);
    return;
  }
  lock.unlock();
  fn();
}

void Request::complete(int source) {
  std::unique_lock<std::mutex> lock(mu_);
  if (done_) return;
  source_ = source;
  finish(lock);
}

void Request::fail(std::exception_ptr error) {
  std::unique_lock<std::mutex> lock(mu_);
  if (done_) return;
  error_ = std::move(error);
  finish(lock);
}

void Request::finish(std::unique_lock<std::mutex>& lock) {
  done_ = true;
  auto fn = std::move(on_done_);
  lock.unlock();
  cv_.notify_all();
  if (fn) fn();
}

}  // namespace torchpar

#include "transport/request.h"

#include <utility>

#include "common/error.h"

namespace torchpar {
namespace {
thread_local bool on_progress_thread = false;
}  // namespace

void mark_progress_thread() { on_progress_thread = true; }

void check_not_on_progress_thread(const char* what) {
  TP_CHECK_USAGE(!on_progress_thread, "torchpar: ", what,
                 " was called on torchpar's point-to-point progress thread (from a callback on the future of "
                 "a send or recv, which that thread runs), and would wait forever: only that thread could "
                 "finish it. Wait in the caller's thread instead, or chain the work with then().");
}

bool Request::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool Request::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return done_; });
}

void Request::wait() {
  if (!done()) check_not_on_progress_thread("a blocking send or recv");
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

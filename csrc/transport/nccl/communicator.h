// One NCCL communicator: the CUDA counterpart of the shared-memory and TCP transports.
//
// Made from an ncclUniqueId that rank 0 of the communicator publishes through the group's
// store, with NCCL's non-blocking configuration (config.blocking = 0), so that set-up and
// every enqueue can be abandoned at a deadline: a rank that never arrives makes the others
// raise a TimeoutError rather than wait inside ncclCommInitRank forever. Plain C++ over
// nccl.h and the CUDA runtime: no torch header, like the rest of transport/.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "transport/rendezvous.h"

namespace torchpar::nccl {

using Clock = std::chrono::steady_clock;

class Communicator {
 public:
  // Joins communicator `key` of `size` ranks as `rank`, on CUDA device `device` (made current
  // on this thread). Rank 0 makes the unique id and sets it in the store under `key`; the
  // others read it. Throws TimeoutError if the communicator is not ready by `deadline`.
  static std::unique_ptr<Communicator> create(Rendezvous& store, const std::string& key, int rank, int size,
                                              int device, Clock::time_point deadline);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Every NCCL call on the communicator runs under this lock, so the watchdog's abort (which
  // frees the communicator) never lands in the middle of one. Recursive: check() may abort.
  std::unique_lock<std::recursive_mutex> lock() { return std::unique_lock<std::recursive_mutex>(mu_); }
  // The handle, for calls made under lock(); throws if the communicator was aborted.
  ncclComm_t get() const;
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  const std::string& key() const { return key_; }

  // The result of an NCCL call on this communicator: ncclInProgress (the non-blocking
  // configuration's "still enqueueing") is waited out until `deadline`; any other failure
  // throws an Error naming `what`, NCCL's message and its last error text.
  void check(ncclResult_t result, const char* what, Clock::time_point deadline);

  // NCCL's asynchronous error state (ncclSuccess while healthy); never blocks.
  ncclResult_t async_error();
  // A description of an asynchronous error for messages.
  std::string describe(ncclResult_t result) const;

  // Aborts the communicator: its kernels in flight stop, later calls on it fail. Idempotent;
  // safe from the watchdog thread while another thread enqueues (NCCL allows it).
  void abort();
  bool aborted() const;

 private:
  Communicator(ncclComm_t comm, int rank, int size, int device, std::string key);
  void wait_ready(const char* what, Clock::time_point deadline);

  ncclComm_t comm_;
  const int rank_, size_, device_;
  const std::string key_;
  mutable std::recursive_mutex mu_;  // guards comm_'s use and aborted_
  bool aborted_ = false;
};

// Throws an Error naming `what` when a CUDA runtime call failed.
void check_cuda(cudaError_t error, const char* what);

}  // namespace torchpar::nccl

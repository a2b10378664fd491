#include "transport/nccl/communicator.h"

#include <cstring>
#include <thread>

#include "common/error.h"

namespace torchpar::nccl {
namespace {

std::string encode_id(const ncclUniqueId& id) {
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

ncclUniqueId decode_id(const std::string& bytes, const std::string& key) {
  // Read from the store: its length is checked before it is copied.
  TP_CHECK(bytes.size() == sizeof(ncclUniqueId), "NCCL unique id under store key '", key, "' has ",
           bytes.size(), " bytes, expected ", sizeof(ncclUniqueId),
           " (do all ranks load the same NCCL version?)");
  ncclUniqueId id;
  std::memcpy(&id, bytes.data(), sizeof(id));
  return id;
}

// Between looks at a communicator that is still setting up or enqueueing. NCCL's own
// progress runs on its threads; this only decides how soon we notice.
void pause() { std::this_thread::sleep_for(std::chrono::microseconds(200)); }

}  // namespace

void check_cuda(cudaError_t error, const char* what) {
  TP_CHECK(error == cudaSuccess, what, " failed: ", cudaGetErrorString(error));
}

std::unique_ptr<Communicator> Communicator::create(Rendezvous& store, const std::string& key, int rank, int size,
                                                   int device, Clock::time_point deadline) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    TP_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr),
             ")");
    store.set(key, encode_id(id));
  } else {
    // Polled against our deadline (the store's own get waits the store's timeout).
    std::string bytes;
    while (!store.try_get(key, &bytes)) {
      if (Clock::now() >= deadline) {
        TP_THROW_TIMEOUT("rank 0 of NCCL communicator ", key, " did not publish its unique id in time");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    id = decode_id(bytes, key);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Non-blocking: ncclCommInitRankConfig returns at once and we poll with a deadline, so a
  // rank that never joins is a TimeoutError here instead of a hang inside NCCL.
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  TP_CHECK(r == ncclSuccess || r == ncclInProgress, "ncclCommInitRankConfig (", key, ", rank ", rank, " of ",
           size, ", cuda:", device, ") failed: ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr), ")");
  TP_CHECK(comm != nullptr, "ncclCommInitRankConfig returned no communicator for ", key);
  std::unique_ptr<Communicator> c(new Communicator(comm, rank, size, device, key));
  c->wait_ready("setting up the NCCL communicator", deadline);
  return c;
}

Communicator::Communicator(ncclComm_t comm, int rank, int size, int device, std::string key)
    : comm_(comm), rank_(rank), size_(size), device_(device), key_(std::move(key)) {}

Communicator::~Communicator() { abort(); }

void Communicator::wait_ready(const char* what, Clock::time_point deadline) {
  for (;;) {
    ncclResult_t state = async_error();
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      std::string why = describe(state);
      abort();
      TP_THROW(what, " failed: ", why);
    }
    if (Clock::now() >= deadline) {
      abort();
      TP_THROW_TIMEOUT(what, " (", key_, ", rank ", rank_, " of ", size_,
                       ") did not finish in time: a rank of the communicator did not take part");
    }
    pause();
  }
}

void Communicator::check(ncclResult_t result, const char* what, Clock::time_point deadline) {
  if (result == ncclSuccess) return;
  if (result == ncclInProgress) return wait_ready(what, deadline);
  TP_THROW(what, " failed: ", describe(result));
}

ncclResult_t Communicator::async_error() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (aborted_) return ncclInvalidUsage;
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  return r == ncclSuccess ? state : r;
}

std::string Communicator::describe(ncclResult_t result) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::string msg = ncclGetErrorString(result);
  if (aborted_) return msg + " (the communicator was aborted)";
  const char* last = ncclGetLastError(comm_);
  if (last != nullptr && *last != '\0') msg += std::string(": ") + last;
  return msg;
}

void Communicator::abort() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (aborted_) return;
  aborted_ = true;
  // Frees the communicator too: comm_ is never touched again.
  ncclCommAbort(comm_);
}

ncclComm_t Communicator::get() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  TP_CHECK(!aborted_, "NCCL communicator ", key_, " was aborted after an earlier failure");
  return comm_;
}

bool Communicator::aborted() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return aborted_;
}

}  // namespace torchpar::nccl

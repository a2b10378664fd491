#include "backend/process_group.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

#include "backend/sparse.h"
#include "backend/tensors.h"
#include "collectives/collectives.h"
#include "common/error.h"
#include "transport/host.h"
#include "transport/tcp/tcp_transport.h"

namespace torchpar {

using collectives::Comm;
using c10d::OpType;

namespace {

class StoreRendezvous final : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  void set_once(const std::string& key, const std::string& value) override {
    store_->compareSet(key, {}, std::vector<uint8_t>(value.begin(), value.end()));
  }
  bool try_get(const std::string& key, std::string* value) override {
    if (!store_->check({key})) return false;
    *value = get(key);
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// Every rank must use the same value of a setting that decides what goes on the wire. Each
// rank checks every rank's, so all of them refuse a mixed group with the same message.
void check_same_everywhere(Rendezvous& rv, int rank, int size, const std::string& name, const std::string& mine) {
  const std::string first = rank == 0 ? mine : rv.get("torchpar/setting/" + name + "/0");
  for (int r = 1; r < size; ++r) {
    const std::string other = r == rank ? mine : rv.get("torchpar/setting/" + name + "/" + std::to_string(r));
    TORCH_CHECK(other == first, "torchpar: ", name, " differs between rank 0 (", first, ") and rank ", r, " (",
                other, "); every rank must use the same");
  }
}

// Shared memory when every rank of the group runs on this host (host identities are
// exchanged through the store, never guessed from the environment); TCP otherwise, or when
// TORCHPAR_TRANSPORT=tcp asks for it.
std::unique_ptr<Transport> connect(Rendezvous& rv, int rank, int size, const Config& config,
                                   std::chrono::milliseconds timeout) {
  // Everything is published before anything is checked, so that a rank refusing the group
  // never leaves the others waiting for its keys.
  const std::string mine = host_identity();
  const std::pair<std::string, std::string> settings[] = {
      {"TORCHPAR_TRANSPORT", config.transport},
      {"TORCHPAR_ONESHOT_MAX_BYTES", std::to_string(config.oneshot_max_bytes)},
      {"TORCHPAR_P2P_CHUNK_BYTES", std::to_string(config.p2p_chunk_bytes)}};
  rv.set("torchpar/host/" + std::to_string(rank), mine);
  for (const auto& [name, value] : settings) rv.set("torchpar/setting/" + name + "/" + std::to_string(rank), value);

  TORCH_CHECK(config.transport == "auto" || config.transport == "shm" || config.transport == "tcp",
              "torchpar: TORCHPAR_TRANSPORT must be auto, shm or tcp, not '", config.transport, "'");
  for (const auto& [name, value] : settings) check_same_everywhere(rv, rank, size, name, value);
  int elsewhere = -1;
  std::string theirs;
  for (int r = 0; r < size && elsewhere < 0; ++r) {
    theirs = r == rank ? mine : rv.get("torchpar/host/" + std::to_string(r));
    if (theirs != mine) elsewhere = r;
  }
  TORCH_CHECK(elsewhere < 0 || config.transport != "shm", "torchpar: TORCHPAR_TRANSPORT=shm, but rank ",
              elsewhere, " runs on another host (", theirs.substr(0, theirs.find('|')), ") than rank ", rank,
              " (", mine.substr(0, mine.find('|')), ")");
  if (elsewhere < 0 && config.transport != "tcp") {
    return std::make_unique<shm::ShmTransport>(rank, size, rv, config, timeout);
  }
  return std::make_unique<tcp::TcpTransport>(rank, size, rv, config, timeout);
}

// The message of a stored exception (c10 errors without their C++ backtrace).
std::string message_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

std::exception_ptr dist_backend_error(std::string msg) {
  return std::make_exception_ptr(c10::DistBackendError(
      c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(msg)));
}

std::vector<void*> data_ptrs(const std::vector<Staged>& staged) {
  std::vector<void*> out;
  for (auto& s : staged) out.push_back(s.data());
  return out;
}

// Rows per split of dim 0, as elements, for all_to_all_single; empty splits mean even.
std::vector<size_t> split_counts(const at::Tensor& t, const std::vector<int64_t>& splits, int size,
                                 const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row = rows == 0 ? 0 : static_cast<size_t>(t.numel() / rows);
  std::vector<size_t> counts(size);
  if (splits.empty()) {
    TORCH_CHECK(rows % size == 0, "torchpar all_to_all: ", what, " has ", rows,
                " rows in dim 0, which does not divide evenly among ", size, " ranks; pass split sizes");
    for (auto& c : counts) c = static_cast<size_t>(rows / size) * row;
    return counts;
  }
  TORCH_CHECK(static_cast<int>(splits.size()) == size, "torchpar all_to_all: ", what, " split sizes have ",
              splits.size(), " entries for a group of size ", size);
  int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK(splits[r] >= 0, "torchpar all_to_all: negative ", what, " split size ", splits[r]);
    total += splits[r];
    counts[r] = static_cast<size_t>(splits[r]) * row;
  }
  TORCH_CHECK(total == rows, "torchpar all_to_all: ", what, " split sizes sum to ", total, " but dim 0 has ",
              rows, " rows");
  return counts;
}

}  // namespace

ProcessGroupTorchpar::ProcessGroupTorchpar(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, std::chrono::milliseconds timeout,
                                           std::string group_name)
    : c10d::Backend(rank, size), group_name_(std::move(group_name)), timeout_(timeout) {
  rendezvous_ = std::make_unique<StoreRendezvous>(store);
  try {
    transport_ = connect(*rendezvous_, rank, size, config_, timeout);
  } catch (const Error& e) {
    C10_THROW_ERROR(DistBackendError, std::string("torchpar: setting up group '") + group_name_ +
                                          "' failed on rank " + std::to_string(rank) + ": " + e.what());
  }
  worker_ = std::thread([this] { run_worker(); });
}

ProcessGroupTorchpar::~ProcessGroupTorchpar() { shutdown(); }

void ProcessGroupTorchpar::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();  // runs what was already queued, then exits
  if (transport_) transport_->p2p().stop();
}

void ProcessGroupTorchpar::abort() {
  transport_->abort("rank " + std::to_string(getRank()) + " aborted group '" + group_name_ + "'");
  shutdown();
}

std::chrono::milliseconds ProcessGroupTorchpar::timeout_for(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? timeout_ : requested;
}

// ---------------------------------------------------------------------------------------
// The collective queue

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::enqueue(OpType type, const char* name,
                                                             std::vector<at::Tensor> outputs, Task task,
                                                             std::chrono::milliseconds timeout, bool async_op) {
  auto work = c10::make_intrusive<Work>(getRank(), type, name, std::move(outputs));
  ++issued_;
  if (coalescing_) coalesced_.push_back(work);  // endCoalescing's work waits for it too
  Queued item{work, name, std::move(task), timeout_for(timeout)};
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "torchpar ", name, ": group '", group_name_, "' has been shut down");
    if (async_op || busy_ || !queue_.empty()) {
      queue_.push_back(std::move(item));
      cv_.notify_all();
      return work;
    }
    busy_ = true;
  }
  execute(item, /*caller_blocks=*/true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
  }
  cv_.notify_all();
  return work;
}

void ProcessGroupTorchpar::run_worker() {
  while (true) {
    Queued item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return (stopping_ || !queue_.empty()) && !busy_; });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    execute(item, /*caller_blocks=*/false);
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void ProcessGroupTorchpar::execute(Queued& item, bool caller_blocks) {
  uint64_t seq = next_seq_++;
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = group_error_;
  }
  if (failed) {
    item.work->complete(failed);
    return;
  }
  std::exception_ptr error;
  try {
    Comm comm{transport_->arena(), transport_->p2p(), config_, Clock::now() + item.timeout, seq, caller_blocks,
              &scratch_};
    item.task(comm);
  } catch (...) {
    bool fatal = false;
    error = describe_failure(item.name, seq, item.timeout, std::current_exception(), &fatal);
    if (fatal) {
      transport_->abort(message_of(error));
      std::lock_guard<std::mutex> lock(mu_);
      if (!group_error_) group_error_ = error;
    }
  }
  item.work->complete(error);
}

std::exception_ptr ProcessGroupTorchpar::describe_failure(const char* op, uint64_t seq,
                                                          std::chrono::milliseconds timeout,
                                                          std::exception_ptr error, bool* fatal) const {
  *fatal = true;
  std::string what = message_of(error);
  try {
    std::rethrow_exception(error);
  } catch (const UsageError&) {
    *fatal = false;  // every rank saw the same thing and stopped in step
  } catch (const PeerLostError&) {
    // A peer that gave up on the group hangs up after saying why (over TCP, in the store).
    std::string why = transport_->abort_reason();
    if (!why.empty()) what = why;
  } catch (const TimeoutError&) {
    // " Timed out " is the shape gloo's message has, and what users and PyTorch's tests match.
    what = "Timed out after " + std::to_string(timeout.count()) + " ms: " + what;
  } catch (...) {
  }
  std::string msg = std::string("torchpar ") + op + " failed on rank " + std::to_string(getRank()) + "/" +
                    std::to_string(getSize()) + " of group '" + group_name_ + "' (collective #" +
                    std::to_string(seq) + "): " + what;
  if (*fatal) msg += " [the group is no longer usable]";
  return dist_backend_error(std::move(msg));
}

// ---------------------------------------------------------------------------------------
// Collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  check_single(tensors, "broadcast");
  check_rank(static_cast<int>(opts.rootRank), getSize(), "broadcast", "root");
  at::Tensor t = tensors[0];
  int root = static_cast<int>(opts.rootRank);
  return enqueue(OpType::BROADCAST, "broadcast", {t}, [t, root](Comm& c) {
    Staged s = c.rank() == root ? Staged::input(t) : Staged::output(t);
    collectives::broadcast(c, s.data(), s.count(), s.dtype(), root);
    s.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    at::Tensor t = tensors[0];
    check_sparse_allreduce(t, opts.reduceOp);
    return enqueue(OpType::ALLREDUCE, "all_reduce", {t}, [t](Comm& c) { sparse_allreduce_sum(c, t); }, opts);
  }
  check_single(tensors, "all_reduce");
  at::Tensor t = tensors[0];
  auto op = reduce_op(opts.reduceOp, "all_reduce", t.scalar_type());
  c10d::ReduceOp user_op = opts.reduceOp;
  return enqueue(OpType::ALLREDUCE, "all_reduce", {t}, [t, op, user_op](Comm& c) {
    Staged s = Staged::input(premultiply(t, user_op));
    s.user = t;
    collectives::allreduce(c, s.data(), s.count(), s.dtype(), op);
    s.finish();
  }, opts);
}

namespace {

// Contiguous, not lazily conjugated or negated, and no two sharing memory: then each tensor
// can be reduced where it lies (an aliased pair would read one reduction's result as the
// other's input).
bool reducible_in_place(const std::vector<at::Tensor>& ts) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const auto& t : ts) {
    if (!t.is_contiguous() || t.is_conj() || t.is_neg()) return false;
    if (t.nbytes() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.emplace_back(begin, begin + t.nbytes());
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return false;
  }
  return true;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  check_tensors(tensors, "all_reduce_coalesced", "tensors");
  TORCH_CHECK(!tensors.empty(), "torchpar all_reduce_coalesced: no tensors");
  for (auto& t : tensors) {
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                "torchpar all_reduce_coalesced: all tensors must have one dtype, got ",
                tensors[0].scalar_type(), " and ", t.scalar_type());
  }
  auto op = reduce_op(opts.reduceOp, "all_reduce_coalesced", tensors[0].scalar_type());
  c10d::ReduceOp user_op = opts.reduceOp;
  std::vector<at::Tensor> ts = tensors;
  if (user_op != c10d::ReduceOp::PREMUL_SUM && reducible_in_place(ts)) {
    // One collective over the tensors where they lie: no flat copy to pack and unpack.
    collectives::Segments data;
    size_t count = 0;
    for (const auto& t : ts) {
      const Staged s = Staged::output(t);  // the tensor itself (complex as real pairs)
      data.add(s.data(), s.count() * s.buffer.element_size());
      count += s.count();
    }
    const c10::ScalarType dtype = Staged::output(ts[0]).dtype();
    return enqueue(OpType::COALESCED, "all_reduce_coalesced", ts, [ts, data, count, dtype, op](Comm& c) {
      collectives::allreduce(c, data, count, dtype, op);  // `ts` keeps the memory alive
    }, opts);
  }
  return enqueue(OpType::COALESCED, "all_reduce_coalesced", ts, [ts, op, user_op](Comm& c) {
    // One flat buffer, one collective: W small all-reduces would pay W synchronisations.
    std::vector<at::Tensor> flat;
    for (auto& t : ts) flat.push_back(premultiply(t, user_op).reshape({-1}));
    Staged s = Staged::input(at::cat(flat));
    collectives::allreduce(c, s.data(), s.count(), s.dtype(), op);
    int64_t off = 0;
    for (auto& t : ts) {
      t.copy_(s.user.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  check_single(tensors, "reduce");
  check_rank(static_cast<int>(opts.rootRank), getSize(), "reduce", "root");
  at::Tensor t = tensors[0];
  auto op = reduce_op(opts.reduceOp, "reduce", t.scalar_type());
  c10d::ReduceOp user_op = opts.reduceOp;
  int root = static_cast<int>(opts.rootRank);
  return enqueue(OpType::REDUCE, "reduce", {t}, [t, op, user_op, root](Comm& c) {
    Staged s = Staged::input(premultiply(t, user_op));  // written on the root only
    s.user = t;
    collectives::reduce(c, s.data(), s.count(), s.dtype(), op, root);
    if (c.rank() == root) s.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  check_single(inputs, "all_gather");
  TORCH_CHECK(outputs.size() == 1, "torchpar all_gather: expects one output list, got ", outputs.size());
  TORCH_CHECK(static_cast<int>(outputs[0].size()) == getSize(), "torchpar all_gather: the output list has ",
              outputs[0].size(), " tensors for a group of size ", getSize());
  check_tensors(outputs[0], "all_gather", "output");
  for (size_t r = 0; r < outputs[0].size(); ++r) {
    check_same_type_and_size(inputs[0], outputs[0][r], "all_gather", "output[" + std::to_string(r) + "]");
  }
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  return enqueue(OpType::ALLGATHER, "all_gather", outs, [in, outs](Comm& c) {
    Staged s = Staged::input(in);
    std::vector<Staged> staged;
    for (auto& o : outs) staged.push_back(Staged::output(o));
    auto ptrs = data_ptrs(staged);
    collectives::allgather(c, s.data(), ptrs.data(), s.count(), s.dtype());
    for (auto& o : staged) o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::AllgatherOptions& opts) {
  check_tensor(input, "all_gather_into_tensor", "input");
  check_tensor(output, "all_gather_into_tensor", "output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torchpar all_gather_into_tensor: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "torchpar all_gather_into_tensor: output has ",
              output.numel(), " elements; expected world size (", getSize(), ") x input (", input.numel(), ")");
  at::Tensor in = input, out = output;
  return enqueue(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {out}, [in, out](Comm& c) {
    Staged s = Staged::input(in);
    Staged o = Staged::output(out);
    std::vector<void*> ptrs;
    size_t bytes = s.count() * s.buffer.element_size();
    for (int r = 0; r < c.size(); ++r) ptrs.push_back(static_cast<char*>(o.data()) + r * bytes);
    collectives::allgather(c, s.data(), ptrs.data(), s.count(), s.dtype());
    o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // torch's layout: outputs[r][i] receives rank r's inputs[i] (one inner list per rank).
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "torchpar all_gather_coalesced: ",
              outputs.size(), " output lists for a group of size ", getSize(),
              "; expected one list per rank, each with one tensor per input");
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(), "torchpar all_gather_coalesced: output list ", r, " has ",
                outputs[r].size(), " tensors for ", inputs.size(), " inputs");
  }
  check_tensors(inputs, "all_gather_coalesced", "input");
  for (size_t r = 0; r < outputs.size(); ++r) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::string what = "output[" + std::to_string(r) + "][" + std::to_string(i) + "]";
      check_tensor(outputs[r][i], "all_gather_coalesced", what);
      check_same_type_and_size(inputs[i], outputs[r][i], "all_gather_coalesced", what);
    }
  }
  std::vector<c10::intrusive_ptr<Work>> parts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<std::vector<at::Tensor>> o(1);
    for (auto& per_rank : outputs) o[0].push_back(per_rank[i]);
    std::vector<at::Tensor> in{inputs[i]};
    parts.push_back(c10::static_intrusive_pointer_cast<Work>(allgather(o, in, opts)));
  }
  return GroupWork::create(getRank(), parts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "torchpar all_gather_into_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  std::vector<c10::intrusive_ptr<Work>> parts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    parts.push_back(c10::static_intrusive_pointer_cast<Work>(_allgather_base(outputs[i], inputs[i], opts)));
  }
  return GroupWork::create(getRank(), parts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::GatherOptions& opts) {
  check_single(inputs, "gather");
  int root = static_cast<int>(opts.rootRank);
  check_rank(root, getSize(), "gather", "root");
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "torchpar gather: the root needs one list of ", getSize(), " output tensors");
    check_tensors(outputs[0], "gather", "output");
    for (size_t r = 0; r < outputs[0].size(); ++r) {
      check_same_type_and_size(inputs[0], outputs[0][r], "gather", "output[" + std::to_string(r) + "]");
    }
    outs = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(), "torchpar gather: only the root (rank ", root,
                ") takes output tensors");
  }
  at::Tensor in = inputs[0];
  return enqueue(OpType::GATHER, "gather", outs, [in, outs, root](Comm& c) {
    Staged s = Staged::input(in);
    std::vector<Staged> staged;
    for (auto& o : outs) staged.push_back(Staged::output(o));
    auto ptrs = data_ptrs(staged);
    if (ptrs.empty()) ptrs.resize(c.size(), nullptr);
    collectives::gather(c, s.data(), ptrs.data(), s.count(), s.dtype(), root);
    for (auto& o : staged) o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::scatter(std::vector<at::Tensor>& outputs,
                                                             std::vector<std::vector<at::Tensor>>& inputs,
                                                             const c10d::ScatterOptions& opts) {
  check_single(outputs, "scatter");
  int root = static_cast<int>(opts.rootRank);
  check_rank(root, getSize(), "scatter", "root");
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                "torchpar scatter: the root needs one list of ", getSize(), " input tensors");
    check_tensors(inputs[0], "scatter", "input");
    for (size_t r = 0; r < inputs[0].size(); ++r) {
      check_same_type_and_size(outputs[0], inputs[0][r], "scatter", "input[" + std::to_string(r) + "]");
    }
    ins = inputs[0];
  } else {
    TORCH_CHECK(inputs.empty() || inputs[0].empty(), "torchpar scatter: only the root (rank ", root,
                ") takes input tensors");
  }
  at::Tensor out = outputs[0];
  return enqueue(OpType::SCATTER, "scatter", {out}, [ins, out, root](Comm& c) {
    Staged o = Staged::output(out);
    std::vector<Staged> staged;
    for (auto& i : ins) staged.push_back(Staged::input(i));
    std::vector<const void*> ptrs(c.size(), nullptr);
    for (size_t r = 0; r < staged.size(); ++r) ptrs[r] = staged[r].data();
    collectives::scatter(c, ptrs.data(), o.data(), o.count(), o.dtype(), root);
    o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  check_single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
              "torchpar reduce_scatter: expects one list of ", getSize(), " input tensors");
  check_tensors(inputs[0], "reduce_scatter", "input");
  for (size_t r = 0; r < inputs[0].size(); ++r) {
    check_same_type_and_size(outputs[0], inputs[0][r], "reduce_scatter", "input[" + std::to_string(r) + "]");
  }
  at::Tensor out = outputs[0];
  auto op = reduce_op(opts.reduceOp, "reduce_scatter", out.scalar_type());
  c10d::ReduceOp user_op = opts.reduceOp;
  std::vector<at::Tensor> ins = inputs[0];
  return enqueue(OpType::REDUCE_SCATTER, "reduce_scatter", {out}, [ins, out, op, user_op](Comm& c) {
    Staged o = Staged::output(out);
    std::vector<Staged> staged;
    for (auto& i : ins) staged.push_back(Staged::input(premultiply(i, user_op)));
    std::vector<const void*> ptrs;
    for (auto& s : staged) ptrs.push_back(s.data());
    collectives::reduce_scatter(c, ptrs.data(), o.data(), o.count(), o.dtype(), op);
    o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                          const c10d::ReduceScatterOptions& opts) {
  check_tensor(input, "reduce_scatter_tensor", "input");
  check_tensor(output, "reduce_scatter_tensor", "output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torchpar reduce_scatter_tensor: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "torchpar reduce_scatter_tensor: input has ",
              input.numel(), " elements; expected world size (", getSize(), ") x output (", output.numel(), ")");
  auto op = reduce_op(opts.reduceOp, "reduce_scatter_tensor", output.scalar_type());
  c10d::ReduceOp user_op = opts.reduceOp;
  at::Tensor in = input, out = output;
  return enqueue(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {out}, [in, out, op, user_op](Comm& c) {
    Staged s = Staged::input(premultiply(in, user_op));
    Staged o = Staged::output(out);
    std::vector<const void*> ptrs;
    size_t bytes = o.count() * o.buffer.element_size();
    for (int r = 0; r < c.size(); ++r) ptrs.push_back(static_cast<const char*>(s.data()) + r * bytes);
    collectives::reduce_scatter(c, ptrs.data(), o.data(), o.count(), o.dtype(), op);
    o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "torchpar reduce_scatter_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  std::vector<c10::intrusive_ptr<Work>> parts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    parts.push_back(c10::static_intrusive_pointer_cast<Work>(_reduce_scatter_base(outputs[i], inputs[i], opts)));
  }
  return GroupWork::create(getRank(), parts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                   std::vector<int64_t>& output_split_sizes,
                                                                   std::vector<int64_t>& input_split_sizes,
                                                                   const c10d::AllToAllOptions& opts) {
  check_tensor(input, "all_to_all_single", "input");
  check_tensor(output, "all_to_all_single", "output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torchpar all_to_all_single: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type());
  auto send_counts = split_counts(input, input_split_sizes, getSize(), "input");
  auto recv_counts = split_counts(output, output_split_sizes, getSize(), "output");
  at::Tensor in = input, out = output;
  return enqueue(OpType::ALLTOALL_BASE, "all_to_all_single", {out}, [in, out, send_counts, recv_counts](Comm& c) {
    Staged s = Staged::input(in);
    Staged o = Staged::output(out);
    // Complex tensors travel as pairs of reals: twice the elements.
    size_t scale = in.is_complex() ? 2 : 1;
    std::vector<size_t> sc, rc;
    std::vector<const void*> sends;
    std::vector<void*> recvs;
    size_t es = s.buffer.element_size(), soff = 0, roff = 0;
    for (int r = 0; r < c.size(); ++r) {
      sc.push_back(send_counts[r] * scale);
      rc.push_back(recv_counts[r] * scale);
      sends.push_back(static_cast<const char*>(s.data()) + soff * es);
      recvs.push_back(static_cast<char*>(o.data()) + roff * es);
      soff += sc.back();
      roff += rc.back();
    }
    collectives::alltoall(c, sends.data(), sc.data(), recvs.data(), rc.data(), s.dtype());
    o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(static_cast<int>(inputs.size()) == getSize() && static_cast<int>(outputs.size()) == getSize(),
              "torchpar all_to_all: expects ", getSize(), " input and output tensors, got ", inputs.size(),
              " and ", outputs.size());
  check_tensors(inputs, "all_to_all", "input");
  check_tensors(outputs, "all_to_all", "output");
  for (int r = 0; r < getSize(); ++r) {
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                "torchpar all_to_all: all tensors must have one dtype");
  }
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return enqueue(OpType::ALLTOALL, "all_to_all", outs, [ins, outs](Comm& c) {
    std::vector<Staged> si, so;
    std::vector<const void*> sends;
    std::vector<void*> recvs;
    std::vector<size_t> sc, rc;
    for (auto& t : ins) {
      si.push_back(Staged::input(t));
      sends.push_back(si.back().data());
      sc.push_back(si.back().count());
    }
    for (auto& t : outs) {
      so.push_back(Staged::output(t));
      recvs.push_back(so.back().data());
      rc.push_back(so.back().count());
    }
    collectives::alltoall(c, sends.data(), sc.data(), recvs.data(), rc.data(), si[0].dtype());
    for (auto& o : so) o.finish();
  }, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(OpType::BARRIER, "barrier", {}, [](Comm& c) { collectives::barrier(c); }, opts);
}

// ---------------------------------------------------------------------------------------
// Point to point

c10::intrusive_ptr<Work> ProcessGroupTorchpar::post_p2p(bool is_send, at::Tensor& tensor, int peer, int tag) {
  const char* op = is_send ? "send" : "recv";
  check_tensor(tensor, op, "tensor");
  if (peer >= 0) {
    check_rank(peer, getSize(), op, is_send ? "destination" : "source");
    TORCH_CHECK(peer != getRank(), "torchpar ", op, ": rank ", getRank(), " cannot ", op,
                is_send ? " to" : " from", " itself");
  }
  Staged s = is_send ? Staged::input(tensor) : Staged::output(tensor);
  auto work = c10::make_intrusive<Work>(getRank(), is_send ? OpType::SEND : (peer < 0 ? OpType::RECVANYSOURCE : OpType::RECV),
                                        is_send ? "torchpar:send" : "torchpar:recv",
                                        std::vector<at::Tensor>{tensor});
  uint64_t wire_tag = static_cast<uint32_t>(tag);
  auto deadline = Clock::now() + timeout_;
  size_t bytes = s.count() * s.buffer.element_size();
  std::shared_ptr<Request> req =
      is_send ? transport_->p2p().isend(peer, wire_tag, s.data(), bytes, deadline)
              : transport_->p2p().irecv(peer, wire_tag, s.data(), bytes, deadline);
  std::string group = group_name_;
  int rank = getRank();
  // The callback holds the staged buffer (and so the tensor) alive until the transfer ends.
  req->on_done([work, req, s, is_send, group, rank]() {
    std::exception_ptr error = req->error();
    if (!error) {
      try {
        if (!is_send) s.finish();
        work->set_source_rank(req->source());
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) {
      error = dist_backend_error(std::string("torchpar ") + (is_send ? "send" : "recv") + " failed on rank " +
                                 std::to_string(rank) + " of group '" + group + "': " + message_of(error));
    }
    work->complete(error);
  });
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  check_single(tensors, "send");
  TORCH_CHECK(dst_rank >= 0, "torchpar send: invalid destination rank ", dst_rank);
  return post_p2p(true, tensors[0], dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  check_single(tensors, "recv");
  TORCH_CHECK(src_rank >= 0, "torchpar recv: invalid source rank ", src_rank);
  return post_p2p(false, tensors[0], src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  check_single(tensors, "recv");
  return post_p2p(false, tensors[0], -1, tag);
}

void ProcessGroupTorchpar::startCoalescing() {
  TORCH_CHECK(!coalescing_, "torchpar: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::endCoalescing() {
  TORCH_CHECK(coalescing_, "torchpar: endCoalescing without startCoalescing");
  coalescing_ = false;
  return GroupWork::create(getRank(), std::exchange(coalesced_, {}));
}

}  // namespace torchpar

#include "transport/tcp/tcp_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <thread>

#include "common/error.h"
#include "transport/records.h"
#include "transport/store_keys.h"
#include "transport/tcp/handshake.h"

namespace torchpar::tcp {
namespace {

// A caller waits this long for the listener's challenge before trying again: the listener
// answers on its own thread from the moment it publishes its port, so a real rank replies
// within a round trip.
constexpr auto kChallengeWait = std::chrono::seconds(10);
// A connection the listener has accepted must complete its handshake within this, or it is
// dropped: a silent or slow stranger holds a slot this long at most.
constexpr auto kHandshakeDeadline = std::chrono::seconds(5);
// Handshakes in progress at once; past this the oldest is dropped (a flood of strangers
// cannot exhaust descriptors, and a real rank finishes in one round trip).
constexpr size_t kMaxPending = 64;

// Connection failures that may pass (a listener's backlog overflowing while many ranks
// connect at once); others rule the address out.
bool transient(int err) {
  return err == ECONNREFUSED || err == ETIMEDOUT || err == EAGAIN || err == ECONNRESET || err == EINTR ||
         err == ECONNABORTED;
}

// Why a connection ended: `err` 0 for an orderly close (end of stream).
std::string hung_up(int err) {
  // A process that exits closes its sockets: an orderly close, or a reset when it left
  // unread data behind. Either way the peer is gone.
  if (err == 0 || err == ECONNRESET || err == EPIPE) {
    return std::string("it has exited or closed the connection") + (err ? " (" + std::string(std::strerror(err)) + ")" : "") +
           "; the group cannot continue";
  }
  return std::string("the connection failed: ") + std::strerror(err);
}

// Reads what is there of a fixed-size message into `into` (non-blocking); false if the
// connection ended or failed.
bool read_part(int fd, void* into, size_t size, size_t* got) {
  while (*got < size) {
    ssize_t k = ::recv(fd, static_cast<char*>(into) + *got, size - *got, MSG_DONTWAIT);
    if (k > 0) {
      *got += static_cast<size_t>(k);
      continue;
    }
    return k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
  }
  return true;
}

// TORCHPAR_SECRET_FILE names a file holding the job's key: the same bytes on every rank,
// handed out the way the job's other credentials are, never through the store (c10d's store
// has no authentication; handshake.h: group_secret). Read at each group's set-up.
constexpr size_t kMinJobKeyBytes = 16;

std::string read_job_key() {
  const std::string path = env_str("TORCHPAR_SECRET_FILE", "");
  if (path.empty()) return "";
  std::ifstream in(path, std::ios::binary);
  TP_CHECK(in.is_open(), "TORCHPAR_SECRET_FILE='", path, "' cannot be read: ", std::strerror(errno));
  std::string key((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TP_CHECK(!in.bad(), "TORCHPAR_SECRET_FILE='", path, "' cannot be read: ", std::strerror(errno));
  TP_CHECK(key.size() >= kMinJobKeyBytes, "TORCHPAR_SECRET_FILE='", path, "' holds ", key.size(),
           " bytes; a key needs at least ", kMinJobKeyBytes, " random bytes (e.g. `head -c 32 /dev/urandom > FILE`)");
  return key;
}

}  // namespace

// A connection accepted by the listener, part-way through its handshake.
struct TcpTransport::Pending {
  Fd fd;
  Clock::time_point deadline;
  Hello hello{};
  size_t hello_got = 0;
  bool challenged = false;
  Nonce nonce{};
  Proof proof{};
  size_t proof_got = 0;
};

TcpTransport::TcpTransport(int rank, int size, Rendezvous& rendezvous, const Config& config,
                           std::chrono::milliseconds timeout, std::vector<char> remote, bool own_engine)
    : rank_(rank), size_(size), remote_(remote.empty() ? std::vector<char>(size, 1) : std::move(remote)),
      rendezvous_(rendezvous), sockets_(size), want_write_(size), broken_(size), unwritable_(size), lost_(size) {
  TP_CHECK(static_cast<int>(remote_.size()) == size, "TcpTransport: ", remote_.size(), " peers marked for ", size,
           " ranks");
  for (auto& b : broken_) b.store(false);
  for (auto& b : unwritable_) b.store(false);
  wakeup_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  TP_CHECK_ERRNO(wakeup_.get() >= 0, "eventfd");
  connect_all(rendezvous, config, timeout);
  if (!own_engine) return;
  // poll() is the wait: spinning or yielding would only burn the CPU on recv() calls.
  p2p_ = std::make_unique<P2PEngine>(rank_, size_, *this, std::chrono::microseconds(0),
                                     std::chrono::microseconds(0),
                                     static_cast<size_t>(config.unexpected_max_bytes));
  engine_.store(p2p_.get(), std::memory_order_release);
}

TcpTransport::~TcpTransport() {
  if (p2p_) p2p_->stop();
}

P2PEngine& TcpTransport::p2p() {
  TP_CHECK(p2p_ != nullptr, "this TCP transport is driven by another transport's engine");
  return *p2p_;
}

void TcpTransport::connect_all(Rendezvous& rendezvous, const Config& config,
                               std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  // With TORCHPAR_SOCKET_IFNAME the listener takes connections on that interface only.
  std::vector<std::string> addresses = local_addresses(config.socket_ifname);
  const std::string bind_to = config.socket_ifname.empty() ? "" : addresses.front();
  if (!bind_to.empty()) addresses.resize(1);
  uint16_t port = 0;
  // The kernel's largest backlog: connections wait there only until the answering thread
  // (started below) accepts them, so strangers cannot crowd out the group's ranks.
  Fd listener = listen_on(bind_to, SOMAXCONN, &port);
  // The group's secret reaches the other ranks through the store only, mixed with the job's
  // key where there is one; on the wire each connection proves it knows it
  // (transport/tcp/handshake.h).
  const std::string job_key = read_job_key();
  Secret published{};
  if (rank_ == 0) {
    published = random_secret();
    rendezvous.set(store_keys::kTcpSecret, secret_to_hex(published));
  } else {
    const std::string text = rendezvous.get(store_keys::kTcpSecret);
    try {
      published = parse_secret(text);
    } catch (const Error& e) {
      TP_THROW("the store key '", store_keys::kTcpSecret, "' holds a malformed value: ", e.what());
    }
  }
  const Secret secret = group_secret(published, job_key);
  Contact mine{port, HostIdentity::local(), addresses};
  rendezvous.set(store_keys::tcp_contact(rank_), mine.encode());

  // The higher rank of each pair calls the lower one. Every rank answers its higher ranks on
  // a thread of its own from here on, while it calls its lower ones, so neither side waits
  // for the other's progress, and one slow connection never holds up the rest.
  std::atomic<bool> stop_answering{false};
  std::exception_ptr answer_error;
  std::thread answering([&] {
    try {
      answer(listener.get(), secret, deadline, stop_answering);
    } catch (...) {
      answer_error = std::current_exception();
    }
  });
  try {
    for (int peer = 0; peer < rank_; ++peer) {
      if (!remote_[peer]) continue;
      Contact theirs = read_record<Contact>(rendezvous, store_keys::tcp_contact(peer));
      std::vector<std::string> candidates = std::move(theirs.addresses);
      if (theirs.host == mine.host) candidates.insert(candidates.begin(), "127.0.0.1");
      TP_CHECK(!candidates.empty(), "rank ", peer, " (host ", theirs.host.hostname,
               ") published no IPv4 address to connect to; set TORCHPAR_SOCKET_IFNAME on it");
      call(peer, std::move(candidates), theirs.port, secret, deadline);
    }
  } catch (...) {
    stop_answering.store(true);
    answering.join();
    throw;
  }
  answering.join();
  if (answer_error) std::rethrow_exception(answer_error);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && remote_[peer]) tune_connected(sockets_[peer].get());
  }
}

void TcpTransport::call(int peer, std::vector<std::string> addresses, uint16_t port, const Secret& secret,
                        Clock::time_point deadline) {
  // Each address in turn, round after round, until one answers as rank `peer` of this
  // group: an address may be unreachable from here, or lead to another process (a
  // container bridge's address can be this host's own). Those are dropped.
  std::string errors;
  auto note = [&](const std::string& address, const std::string& why) {
    std::string line = "; " + address + ": " + why;
    if (errors.find(line) == std::string::npos) errors += line;
  };
  while (true) {
    for (auto it = addresses.begin(); it != addresses.end();) {
      int err = 0;
      Fd fd = connect_to(*it, port, std::min(deadline, Clock::now() + std::chrono::seconds(5)), &err);
      if (fd.get() < 0) {
        note(*it, std::strerror(err));
        it = transient(err) ? it + 1 : addresses.erase(it);
        continue;
      }
      std::string refused;
      try {
        const auto step_deadline = std::min(deadline, Clock::now() + kChallengeWait);
        const Nonce nonce = random_nonce();
        Hello hello{kHandshakeMagic, rank_, peer, size_, nonce};
        send_all(fd.get(), &hello, sizeof(hello), step_deadline);
        Challenge challenge{};
        recv_all(fd.get(), &challenge, sizeof(challenge), step_deadline);
        // Our proof goes out only to a listener that has proved itself.
        refused = check_challenge(challenge, secret, rank_, peer, size_, nonce);
        if (refused.empty()) {
          Proof proof{kHandshakeMagic, caller_mac(secret, peer, rank_, size_, nonce, challenge.nonce)};
          send_all(fd.get(), &proof, sizeof(proof), step_deadline);
          // A deadline of its own: the listener counts the connection once Accepted is
          // sent, so giving up on it early would leave the listener with a dead socket.
          Accepted accepted{};
          recv_all(fd.get(), &accepted, sizeof(accepted), std::min(deadline, Clock::now() + kChallengeWait));
          if (accepted.magic == kAcceptedMagic) {
            sockets_[peer] = std::move(fd);
            return;
          }
          refused = "the listener did not accept the connection";
        }
      } catch (const Error& e) {
        // It hung up or was slow: perhaps busy; try it again next round.
        note(*it, e.what());
        ++it;
        continue;
      }
      note(*it, refused);
      it = addresses.erase(it);  // it leads to some other process
    }
    TP_CHECK(!addresses.empty() && Clock::now() < deadline, "rank ", rank_, " could not reach rank ", peer,
             " at port ", port, " of any of its addresses", errors,
             " (TORCHPAR_SOCKET_IFNAME picks the interface a rank publishes)");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void TcpTransport::answer(int listener, const Secret& secret, Clock::time_point deadline,
                          const std::atomic<bool>& stop) {
  int flags = ::fcntl(listener, F_GETFL);
  TP_CHECK_ERRNO(flags >= 0 && ::fcntl(listener, F_SETFL, flags | O_NONBLOCK) == 0, "O_NONBLOCK");
  std::deque<Pending> pending;
  std::vector<pollfd> fds;
  size_t refused = 0;
  std::string last_refusal;
  auto refuse = [&](const std::string& why) {
    ++refused;
    last_refusal = why;
  };
  // After accept() runs short of descriptors or memory, the listener rests briefly rather
  // than spinning on a queue it cannot take from yet.
  Clock::time_point accept_paused_until{};
  int missing = static_cast<int>(std::count(remote_.begin() + rank_ + 1, remote_.end(), 1));
  while (missing > 0 && !stop.load()) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::string ranks;
      for (int r = rank_ + 1; r < size_; ++r) {
        if (remote_[r] && sockets_[r].get() < 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      }
      TP_THROW_TIMEOUT("timed out setting up TCP connections: rank(s) ", ranks, " never connected to rank ", rank_,
                       refused ? " (" + std::to_string(refused) + " other connection(s) refused, the last one: " +
                                     last_refusal + ")"
                               : std::string());
    }
    fds.clear();
    fds.push_back(pollfd{listener, static_cast<short>(now < accept_paused_until ? 0 : POLLIN), 0});
    for (auto& p : pending) fds.push_back(pollfd{p.fd.get(), POLLIN, 0});
    auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<int64_t>(wait, 0, 100))) < 0) {
      TP_CHECK_ERRNO(errno == EINTR, "poll");
      continue;
    }
    // Look at the connections first (fds[i + 1] is pending[i]); new ones join after.
    size_t i = 0;
    for (auto it = pending.begin(); it != pending.end(); ++i) {
      Pending& p = *it;
      bool drop = Clock::now() >= p.deadline;
      if (drop) refuse("no handshake within " + std::to_string(kHandshakeDeadline.count()) + " s");
      if (!drop && (fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) {
        if (!p.challenged) {
          drop = !read_part(p.fd.get(), &p.hello, sizeof(p.hello), &p.hello_got);
          if (!drop && p.hello_got == sizeof(p.hello)) {
            std::string why = check_hello(p.hello, rank_, size_);
            // A rank of this host reaches this one through shared memory, never here.
            if (why.empty() && !remote_[p.hello.rank]) why = "a hello from rank " + std::to_string(p.hello.rank) + " of this host";
            if (!why.empty()) {
              refuse(why);
              drop = true;
            } else {
              p.nonce = random_nonce();
              Challenge c{kHandshakeMagic, rank_, p.hello.rank, size_, p.nonce,
                          listener_mac(secret, rank_, p.hello.rank, size_, p.hello.nonce, p.nonce)};
              // A fresh socket's buffer takes these few bytes at once.
              drop = ::send(p.fd.get(), &c, sizeof(c), MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof(c));
              p.challenged = true;
            }
          }
        } else {
          drop = !read_part(p.fd.get(), &p.proof, sizeof(p.proof), &p.proof_got);
          if (drop) {
            // A rank hangs up here when this rank's challenge did not check out for it.
            refuse("a caller claiming rank " + std::to_string(p.hello.rank) +
                   " hung up on the challenge (a rank whose TORCHPAR_SECRET_FILE holds another key, or a stranger)");
          }
          if (!drop && p.proof_got == sizeof(p.proof)) {
            if (check_proof(p.proof, secret, rank_, p.hello, p.nonce)) {
              const Accepted accepted{kAcceptedMagic};
              if (::send(p.fd.get(), &accepted, sizeof(accepted), MSG_NOSIGNAL | MSG_DONTWAIT) ==
                  static_cast<ssize_t>(sizeof(accepted))) {
                // A rank calls again only after giving up on its earlier connection.
                if (sockets_[p.hello.rank].get() < 0) --missing;
                sockets_[p.hello.rank] = std::move(p.fd);
              }
            } else {
              refuse("a caller claiming rank " + std::to_string(p.hello.rank) +
                     " did not prove that it knows the group's secret (a stranger, or a rank whose "
                     "TORCHPAR_SECRET_FILE holds another key)");
            }
            drop = true;
          }
        }
      }
      it = drop ? pending.erase(it) : it + 1;
    }
    if (fds[0].revents & POLLIN) {
      while (true) {
        Fd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (fd.get() < 0) {
          const int err = errno;
          TP_CHECK_ERRNO(err == EWOULDBLOCK || accept_error_passes(err), "accept");
          if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
            refuse(std::string("accept: ") + std::strerror(err));
            accept_paused_until = Clock::now() + std::chrono::milliseconds(20);
          }
          if (err == EWOULDBLOCK || err == EAGAIN || accept_paused_until > Clock::now()) break;
          continue;  // that connection failed in the queue; the next may be fine
        }
        if (pending.size() >= kMaxPending) {
          // Silent connections go first: a rank sends its hello at once, so one that has
          // not is most likely a stranger. A dropped rank hears no Accepted and calls again.
          refuse("too many handshakes at once");
          auto silent = std::find_if(pending.begin(), pending.end(), [](const Pending& p) { return !p.challenged; });
          pending.erase(silent != pending.end() ? silent : pending.begin());
        }
        pending.push_back(Pending{std::move(fd), Clock::now() + kHandshakeDeadline});
      }
    }
  }
}

void TcpTransport::lost(int peer, const std::string& why, bool readable) {
  (readable ? unwritable_ : broken_)[peer].store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);
  if (lost_[peer].empty()) lost_[peer] = why;
}

size_t TcpTransport::write_some(int peer, const void* data, size_t n) {
  if (n == 0 || broken_[peer].load(std::memory_order_acquire) || unwritable_[peer].load(std::memory_order_acquire)) {
    return 0;
  }
  ssize_t k = ::send(sockets_[peer].get(), data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      want_write_[peer].store(true, std::memory_order_relaxed);
      return 0;
    }
    // A peer that sent its last messages and exited refuses writes, but its messages are
    // still in this socket: it counts as lost now (check_peer), and is read to the end of its
    // stream all the same (review finding: a send after its exit dropped a delivered message).
    lost(peer, hung_up(errno), /*readable=*/true);
    return 0;
  }
  want_write_[peer].store(static_cast<size_t>(k) < n, std::memory_order_relaxed);
  return static_cast<size_t>(k);
}

size_t TcpTransport::read_some(int peer, void* data, size_t n) {
  if (n == 0 || broken_[peer].load(std::memory_order_acquire)) return 0;
  ssize_t k = ::recv(sockets_[peer].get(), data, n, MSG_DONTWAIT);
  if (k > 0) return static_cast<size_t>(k);
  if (k == 0) {
    lost(peer, hung_up(0));
  } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    lost(peer, hung_up(errno));
  }
  return 0;
}

void TcpTransport::notify(int peer) {
  // Bytes in a socket wake the peer by themselves; only posts on this rank need a bell.
  if (peer != rank_) return;
  activity_.fetch_add(1, std::memory_order_acq_rel);
  uint64_t one = 1;
  [[maybe_unused]] ssize_t k = ::write(wakeup_.get(), &one, sizeof(one));
}

void TcpTransport::sleep_until_activity(uint32_t seen, std::chrono::microseconds max_sleep) {
  if (activity() != seen) return;
  std::vector<pollfd>& fds = polled_;
  fds.clear();
  polled_peers_.clear();
  fds.push_back(pollfd{wakeup_.get(), POLLIN, 0});
  polled_peers_.push_back(-1);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || !remote_[peer] || broken_[peer].load(std::memory_order_acquire)) continue;
    short events = POLLIN;
    if (want_write_[peer].load(std::memory_order_relaxed) && !unwritable_[peer].load(std::memory_order_acquire)) {
      events |= POLLOUT;
    }
    fds.push_back(pollfd{sockets_[peer].get(), events, 0});
    polled_peers_.push_back(peer);
  }
  int ms = static_cast<int>(std::max<int64_t>(1, max_sleep.count() / 1000));
  if (::poll(fds.data(), fds.size(), ms) <= 0) return;
  if (fds[0].revents & POLLIN) {
    uint64_t drained;
    [[maybe_unused]] ssize_t k = ::read(wakeup_.get(), &drained, sizeof(drained));
  }
  // Room again: the engine writes next and sets the flag anew if the socket fills. Left set,
  // a send that expired before writing a byte kept asking for POLLOUT, which a drained socket
  // answers at once, and the thread spun (review finding).
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents & POLLOUT) want_write_[polled_peers_[i]].store(false, std::memory_order_relaxed);
  }
}

void TcpTransport::check_peer(int peer) {
  std::string lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) throw Error(aborted_);
    lost = lost_[peer];
  }
  if (lost.empty()) return;
  // A rank that aborts the group writes why in the store before it hangs up: a pending
  // point-to-point request names that, as a collective does (describe_failure), rather than
  // the connection the abort closed. (Asked outside mu_: a store round trip must not hold it.)
  std::string why = abort_reason();
  if (!why.empty()) throw Error(why);
  throw PeerLostError(detail::message(__FILE__, __LINE__, "lost the TCP connection to rank ", peer, ": ", lost));
}

std::string TcpTransport::abort_reason() {
  std::string why;
  try {
    if (!rendezvous_.try_get(store_keys::kTcpAbort, &why)) return "";
  } catch (const std::exception&) {
    return "";  // the store went down with its host (often rank 0's)
  }
  const AbortNotice notice = AbortNotice::decode(why);
  return "the group was aborted by rank " + std::to_string(notice.rank) + ": " + notice.reason;
}

void TcpTransport::leave() {
  // What this rank sent still arrives; then each peer reads the end of the connection, and one
  // still waiting for this rank fails at once ("lost the TCP connection").
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && remote_[peer]) ::shutdown(sockets_[peer].get(), SHUT_WR);
  }
}

void TcpTransport::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = reason;
  }
  try {
    rendezvous_.set_once(store_keys::kTcpAbort, AbortNotice{rank_, reason}.encode());
  } catch (const std::exception&) {
    // The store may be gone (the job is ending); peers then see the connection end.
  }
  if (auto* engine = engine_.load(std::memory_order_acquire)) engine->fail(std::make_exception_ptr(Error(reason)));
  // Peers blocked on this rank see the connection end now rather than at their timeout.
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && remote_[peer]) ::shutdown(sockets_[peer].get(), SHUT_RDWR);
  }
}

}  // namespace torchpar::tcp

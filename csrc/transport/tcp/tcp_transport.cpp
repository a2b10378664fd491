#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <random>
#include <thread>
#include <sstream>

#include "common/error.h"
#include "transport/records.h"
#include "transport/store_keys.h"

namespace torchpar::tcp {
namespace {

constexpr uint64_t kHelloMagic = 0x7470617274637031ULL;  // "tpartcp1"

// The first bytes each way on every connection: who is calling whom, for which group.
struct Hello {
  uint64_t magic;
  uint64_t token;  // rank 0's random number for this group: a stray connection is refused
  int32_t rank;    // the sender
  int32_t to;      // the rank it means to reach
  int32_t size;
  int32_t reserved;
};

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

}  // namespace

TcpTransport::TcpTransport(int rank, int size, Rendezvous& rendezvous, const Config& config,
                           std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), rendezvous_(rendezvous), sockets_(size), want_write_(size, 0), broken_(size), lost_(size) {
  for (auto& b : broken_) b.store(false);
  wakeup_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  TP_CHECK_ERRNO(wakeup_.get() >= 0, "eventfd");
  connect_all(rendezvous, config, timeout);
  // poll() is the wait: spinning or yielding would only burn the CPU on recv() calls.
  p2p_ = std::make_unique<P2PEngine>(rank_, size_, *this, std::chrono::microseconds(0),
                                     std::chrono::microseconds(0),
                                     static_cast<size_t>(config.unexpected_max_bytes));
}

TcpTransport::~TcpTransport() {
  if (p2p_) p2p_->stop();
}

void TcpTransport::connect_all(Rendezvous& rendezvous, const Config& config,
                               std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  uint16_t port = 0;
  Fd listener = listen_any(size_, &port);
  uint64_t token = 0;
  if (rank_ == 0) {
    std::random_device rd;
    token = (static_cast<uint64_t>(rd()) << 32) | rd();
    rendezvous.set(store_keys::kTcpToken, std::to_string(token));
  } else {
    const std::string text = rendezvous.get(store_keys::kTcpToken);
    char* end = nullptr;
    errno = 0;
    token = std::strtoull(text.c_str(), &end, 10);
    TP_CHECK(!text.empty() && text[0] != '-' && *end == '\0' && errno == 0, "the store key '",
             store_keys::kTcpToken, "' holds '", text, "', not a number");
  }
  Contact mine{port, HostIdentity::local(), local_addresses(config.socket_ifname)};
  rendezvous.set(store_keys::tcp_contact(rank_), mine.encode());

  // The higher rank of each pair calls the lower one: connect to every lower rank (their
  // listeners queue us), then answer every higher one.
  for (int peer = 0; peer < rank_; ++peer) {
    Contact theirs = read_record<Contact>(rendezvous, store_keys::tcp_contact(peer));
    std::vector<std::string> candidates = std::move(theirs.addresses);
    if (theirs.host == mine.host) candidates.insert(candidates.begin(), "127.0.0.1");
    TP_CHECK(!candidates.empty(), "rank ", peer, " (host ", theirs.host.hostname,
             ") published no IPv4 address to connect to; set TORCHPAR_SOCKET_IFNAME on it");
    call(peer, std::move(candidates), theirs.port, token, deadline);
  }
  answer(listener.get(), token, deadline);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) tune_connected(sockets_[peer].get());
  }
}

void TcpTransport::call(int peer, std::vector<std::string> addresses, uint16_t port, uint64_t token,
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
      try {
        // The reply may take a while: the peer answers once it has called its own lower
        // ranks. Only the group's deadline bounds it.
        Hello hello{kHelloMagic, token, rank_, peer, size_, 0};
        send_all(fd.get(), &hello, sizeof(hello), deadline);
        Hello reply{};
        recv_all(fd.get(), &reply, sizeof(reply), deadline);
        TP_CHECK(reply.magic == kHelloMagic && reply.token == token && reply.rank == peer && reply.to == rank_,
                 "the process listening there is not rank ", peer, " of this group");
        sockets_[peer] = std::move(fd);
        return;
      } catch (const Error& e) {
        note(*it, e.what());
        it = addresses.erase(it);  // it leads elsewhere, or hung up on a valid hello
      }
    }
    TP_CHECK(!addresses.empty() && Clock::now() < deadline, "rank ", rank_, " could not reach rank ", peer,
             " at port ", port, " of any of its addresses", errors,
             " (TORCHPAR_SOCKET_IFNAME picks the interface a rank publishes)");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void TcpTransport::answer(int listener, uint64_t token, Clock::time_point deadline) {
  for (int pending = size_ - 1 - rank_; pending > 0;) {
    Fd fd;
    try {
      fd = accept_until(listener, deadline);
    } catch (const TimeoutError&) {
      std::string missing;
      for (int r = rank_ + 1; r < size_; ++r) {
        if (sockets_[r].get() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      TP_THROW_TIMEOUT("timed out setting up TCP connections: rank(s) ", missing, " never connected to rank ",
                       rank_);
    }
    Hello hello{};
    try {
      recv_all(fd.get(), &hello, sizeof(hello), std::min(deadline, Clock::now() + std::chrono::seconds(10)));
    } catch (const Error&) {
      continue;  // not one of ours
    }
    if (hello.magic != kHelloMagic || hello.token != token || hello.size != size_ || hello.to != rank_ ||
        hello.rank <= rank_ || hello.rank >= size_ || sockets_[hello.rank].get() >= 0) {
      continue;
    }
    try {
      Hello reply{kHelloMagic, token, rank_, hello.rank, size_, 0};
      send_all(fd.get(), &reply, sizeof(reply), std::min(deadline, Clock::now() + std::chrono::seconds(10)));
    } catch (const Error&) {
      continue;  // it hung up; it will call again
    }
    sockets_[hello.rank] = std::move(fd);
    --pending;
  }
}

void TcpTransport::lost(int peer, const std::string& why) {
  broken_[peer].store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);
  if (lost_[peer].empty()) lost_[peer] = why;
}

size_t TcpTransport::write_some(int peer, const void* data, size_t n) {
  if (n == 0 || broken_[peer].load(std::memory_order_acquire)) return 0;
  ssize_t k = ::send(sockets_[peer].get(), data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      want_write_[peer] = 1;
      return 0;
    }
    lost(peer, hung_up(errno));
    return 0;
  }
  want_write_[peer] = static_cast<size_t>(k) < n;
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
  fds.push_back(pollfd{wakeup_.get(), POLLIN, 0});
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || broken_[peer].load(std::memory_order_acquire)) continue;
    short events = POLLIN;
    if (want_write_[peer]) events |= POLLOUT;
    fds.push_back(pollfd{sockets_[peer].get(), events, 0});
  }
  int ms = static_cast<int>(std::max<int64_t>(1, max_sleep.count() / 1000));
  if (::poll(fds.data(), fds.size(), ms) > 0 && (fds[0].revents & POLLIN)) {
    uint64_t drained;
    [[maybe_unused]] ssize_t k = ::read(wakeup_.get(), &drained, sizeof(drained));
  }
}

void TcpTransport::check_peer(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_.empty()) throw Error(aborted_);
  if (!lost_[peer].empty()) {
    throw PeerLostError(detail::message(__FILE__, __LINE__, "lost the TCP connection to rank ", peer, ": ",
                                        lost_[peer]));
  }
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
  if (p2p_) p2p_->fail(std::make_exception_ptr(Error(reason)));
  // Peers blocked on this rank see the connection end now rather than at their timeout.
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) ::shutdown(sockets_[peer].get(), SHUT_RDWR);
  }
}

}  // namespace torchpar::tcp

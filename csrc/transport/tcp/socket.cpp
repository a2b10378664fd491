#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "common/error.h"

namespace torchpar::tcp {
namespace {

int millis_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

// Waits until `fd` is ready for `events`; false if `deadline` passed first.
bool wait_ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, millis_until(deadline));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) TP_CHECK_ERRNO(false, "poll");
    if (Clock::now() >= deadline) return false;
  }
}

sockaddr_in ipv4(const std::string& address, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  TP_CHECK(::inet_pton(AF_INET, address.c_str(), &a.sin_addr) == 1, "not an IPv4 address: '", address, "'");
  return a;
}

}  // namespace

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

std::vector<std::string> local_addresses(const std::string& ifname) {
  ifaddrs* list = nullptr;
  TP_CHECK_ERRNO(::getifaddrs(&list) == 0, "getifaddrs");
  std::vector<std::string> out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP)) continue;
    if (ifname.empty() ? (i->ifa_flags & IFF_LOOPBACK) != 0 : ifname != i->ifa_name) continue;
    char text[INET_ADDRSTRLEN] = {0};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    out.emplace_back(text);
  }
  ::freeifaddrs(list);
  TP_CHECK(ifname.empty() || !out.empty(), "TORCHPAR_SOCKET_IFNAME=", ifname,
           " names no interface of this host that is up and has an IPv4 address");
  return out;
}

Fd listen_on(const std::string& address, int backlog, uint16_t* port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  TP_CHECK_ERRNO(fd.get() >= 0, "socket");
  sockaddr_in a{};
  if (address.empty()) {
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
  } else {
    a = ipv4(address, 0);
  }
  TP_CHECK_ERRNO(::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0, "bind to ",
                 address.empty() ? std::string("every interface") : address);
  TP_CHECK_ERRNO(::listen(fd.get(), backlog) == 0, "listen");
  socklen_t len = sizeof(a);
  TP_CHECK_ERRNO(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0, "getsockname");
  *port = ntohs(a.sin_port);
  return fd;
}

Fd connect_to(const std::string& address, uint16_t port, Clock::time_point deadline, int* error) {
  sockaddr_in a = ipv4(address, port);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  TP_CHECK_ERRNO(fd.get() >= 0, "socket");
  int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
  int err = rc == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    if (!wait_ready(fd.get(), POLLOUT, deadline)) {
      err = ETIMEDOUT;
    } else {
      socklen_t len = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    }
  }
  *error = err;
  if (err != 0) return Fd();
  int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);  // the handshake blocks (with deadlines)
  return fd;
}

bool accept_error_passes(int err) {
  switch (err) {
    case EINTR: case EAGAIN: case ECONNABORTED: case EPROTO: case EPERM:  // this connection only
    case ENETDOWN: case ENOPROTOOPT: case EHOSTDOWN: case ENONET: case EHOSTUNREACH:
    case EOPNOTSUPP: case ENETUNREACH:  // the network's errors, passed on by accept
    case EMFILE: case ENFILE: case ENOBUFS: case ENOMEM:  // short of resources for now
      return true;
    default:
      return false;
  }
}

Fd accept_until(int listener, Clock::time_point deadline) {
  while (true) {
    if (!wait_ready(listener, POLLIN, deadline)) TP_THROW_TIMEOUT("no connection arrived in time");
    Fd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    if (fd.get() >= 0) return fd;
    TP_CHECK_ERRNO(accept_error_passes(errno), "accept");
  }
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!wait_ready(fd, POLLOUT, deadline)) TP_THROW_TIMEOUT("timed out sending on a socket");
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    TP_CHECK_ERRNO(k > 0, "send");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_ready(fd, POLLIN, deadline)) TP_THROW_TIMEOUT("timed out receiving on a socket");
    ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    TP_CHECK(k != 0, "the connection was closed by the other end");
    TP_CHECK_ERRNO(k > 0, "recv");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void tune_connected(int fd) {
  int one = 1;
  TP_CHECK_ERRNO(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) == 0, "TCP_NODELAY");
  TP_CHECK_ERRNO(::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one)) == 0, "SO_KEEPALIVE");
  int flags = ::fcntl(fd, F_GETFL);
  TP_CHECK_ERRNO(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, "O_NONBLOCK");
}

}  // namespace torchpar::tcp

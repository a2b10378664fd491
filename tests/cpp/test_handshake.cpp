// TCP set-up among strangers (issue 21): ranks prove they know the group's secret without
// sending it, a stranger cannot stall or join the group, and with TORCHPAR_SOCKET_IFNAME
// the listener takes connections on that interface only.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "ranks.h"
#include "transport/records.h"
#include "transport/store_keys.h"
#include "transport/tcp/handshake.h"
#include "transport/tcp/socket.h"

namespace torchpar {
namespace {

using tptest::MemoryRendezvous;
using tptest::small_config;
using namespace tcp;

bool contains(const std::string& text, const std::string& word) { return text.find(word) != std::string::npos; }

bool contains_bytes(const std::string& haystack, const void* needle, size_t n) {
  return std::search(haystack.begin(), haystack.end(), static_cast<const char*>(needle),
                     static_cast<const char*>(needle) + n) != haystack.end();
}

// A plain TCP connection to 127.0.0.1:port (or `address`), blocking.
int dial(uint16_t port, const std::string& address = "127.0.0.1") {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, address.c_str(), &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Rank 0 and rank 1 of a TCP group, rank 1 started only once `before_rank1` (given rank 0's
// port) returns; both then all-reduce. Returns each rank's error ("" if none), or that it
// took more than 2 s to set up.
std::vector<std::string> two_ranks(const std::function<void(uint16_t)>& before_rank1, Config config = small_config(),
                                   std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  MemoryRendezvous rv;
  std::vector<std::string> errors(2);
  std::atomic<Clock::time_point> rank1_started{Clock::time_point::max()};
  auto rank = [&](int r) {
    try {
      TcpTransport t(r, 2, rv, config, timeout);
      if (Clock::now() - rank1_started.load() > std::chrono::seconds(2)) errors[r] = "set-up took over 2 s; ";
      float x = static_cast<float>(r + 1);
      auto c = tptest::comm(t, 0);
      collectives::allreduce(c, &x, 1, c10::ScalarType::Float, collectives::ReduceOp::kSum);
      if (x != 3.0f) errors[r] += "wrong sum " + std::to_string(x);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::thread rank0(rank, 0);
  before_rank1(read_record<Contact>(rv, store_keys::tcp_contact(0)).port);
  rank1_started = Clock::now();
  std::thread rank1(rank, 1);
  rank0.join();
  rank1.join();
  return errors;
}

TEST(Handshake, SecretsRoundTripAndBadOnesAreRefusedWithoutBeingQuoted) {
  Secret s = random_secret();
  EXPECT_EQ(parse_secret(secret_to_hex(s)), s);
  EXPECT_NE(random_secret(), s);
  std::string bad = secret_to_hex(s);
  bad[7] = 'g';
  try {
    parse_secret(bad);
    FAIL() << "accepted a non-hex secret";
  } catch (const Error& e) {
    EXPECT_FALSE(contains(e.what(), bad.substr(0, 6))) << e.what();
  }
  EXPECT_THROW(parse_secret("abc"), Error);
}

TEST(Handshake, EachSideProvesItselfForThisConnectionOnly) {
  Secret secret = random_secret(), other = random_secret();
  Nonce caller = random_nonce(), listener = random_nonce();
  Hello hello{kHandshakeMagic, 3, 1, 4, caller};
  EXPECT_EQ(check_hello(hello, 1, 4), "");
  EXPECT_NE(check_hello(Hello{kHandshakeMagic, 1, 3, 4, caller}, 3, 4), "");  // lower ranks never call
  EXPECT_NE(check_hello(Hello{kHandshakeMagic, 3, 1, 5, caller}, 1, 4), "");
  EXPECT_NE(check_hello(Hello{0, 3, 1, 4, caller}, 1, 4), "");

  Challenge c{kHandshakeMagic, 1, 3, 4, listener, listener_mac(secret, 1, 3, 4, caller, listener)};
  EXPECT_EQ(check_challenge(c, secret, 3, 1, 4, caller), "");
  EXPECT_NE(check_challenge(c, other, 3, 1, 4, caller), "");           // another group's secret
  EXPECT_NE(check_challenge(c, secret, 3, 1, 4, random_nonce()), "");  // replayed from another connection
  Challenge reflected = c;
  reflected.mac = caller_mac(secret, 1, 3, 4, caller, listener);  // the caller's own MAC sent back
  EXPECT_NE(check_challenge(reflected, secret, 3, 1, 4, caller), "");

  Proof p{kHandshakeMagic, caller_mac(secret, 1, 3, 4, caller, listener)};
  EXPECT_TRUE(check_proof(p, secret, 1, hello, listener));
  EXPECT_FALSE(check_proof(p, other, 1, hello, listener));
  EXPECT_FALSE(check_proof(p, secret, 1, hello, random_nonce()));
  EXPECT_FALSE(check_proof(Proof{kHandshakeMagic, c.mac}, secret, 1, hello, listener));
}

// A rank calling an address that leads to some other process must not hand it anything it
// could use to pass for a rank: not the secret, not a MAC made without a fresh challenge.
// Before the handshake, the hello carried the group's token in plain text.
TEST(Tcp, TheSecretNeverCrossesTheWire) {
  Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(listener.get(), 8), 0);
  ASSERT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&a), &len), 0);
  const uint16_t port = ntohs(a.sin_port);
  MemoryRendezvous rv;
  const Secret secret = random_secret();
  const uint64_t token = 0x1122334455667788ULL;  // what the old protocol sent in its hello
  rv.set(store_keys::kTcpSecret, secret_to_hex(secret));
  rv.set("torchpar/tcp/token", std::to_string(token));
  rv.set(store_keys::tcp_contact(0), Contact{port, HostIdentity{"elsewhere", "b", "n", "net"}, {"127.0.0.1"}}.encode());

  std::string heard;
  std::thread impostor([&] {
    Fd fd = accept_until(listener.get(), Clock::now() + std::chrono::seconds(5));
    char buf[4096];
    auto until = Clock::now() + std::chrono::milliseconds(1500);
    bool answered = false;
    while (Clock::now() < until) {
      ssize_t k = ::recv(fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (k > 0) heard.append(buf, static_cast<size_t>(k));
      if (!answered && heard.size() >= sizeof(Hello)) {
        // A challenge whose MAC is made without the secret.
        Challenge forged{kHandshakeMagic, 0, 1, 2, random_nonce(), {}};
        ::send(fd.get(), &forged, sizeof(forged), MSG_NOSIGNAL);
        answered = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  std::string why;
  try {
    TcpTransport t(1, 2, rv, small_config(), std::chrono::milliseconds(1200));
  } catch (const std::exception& e) {
    why = e.what();
  }
  impostor.join();
  EXPECT_TRUE(contains(why, "could not reach rank 0")) << why;
  EXPECT_TRUE(contains(why, "does not prove that it knows this group's secret")) << why;
  EXPECT_FALSE(heard.empty());
  EXPECT_FALSE(contains_bytes(heard, secret.data(), secret.size()));
  EXPECT_FALSE(contains(heard, secret_to_hex(secret)));
  EXPECT_FALSE(contains_bytes(heard, &token, sizeof(token)));
  EXPECT_EQ(heard.size(), sizeof(Hello)) << "the caller sent its proof to a listener that had not proved itself";
}

// Before the listener answered hellos concurrently, each silent connection held set-up for
// up to 10 s, one after another: three of them ran past this 5 s timeout.
TEST(Tcp, SilentStrangersDoNotStallSetUp) {
  std::vector<int> strangers;
  auto errors = two_ranks([&](uint16_t port) {
    for (int i = 0; i < 3; ++i) strangers.push_back(dial(port));
  });
  for (int fd : strangers) {
    EXPECT_GE(fd, 0);
    ::close(fd);
  }
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// A stranger that does not know the secret cannot take rank 1's place, however early it
// calls or however well-formed its hello.
TEST(Tcp, AStrangerWithoutTheSecretCannotTakeARanksPlace) {
  std::vector<int> strangers;
  auto errors = two_ranks([&](uint16_t port) {
    for (int i = 0; i < 3; ++i) {
      int fd = dial(port);
      Hello hello{kHandshakeMagic, 1, 0, 2, random_nonce()};
      ::send(fd, &hello, sizeof(hello), MSG_NOSIGNAL);
      Challenge c{};
      ::recv(fd, &c, sizeof(c), MSG_WAITALL);
      Proof guess{kHandshakeMagic, {}};
      ::send(fd, &guess, sizeof(guess), MSG_NOSIGNAL);
      strangers.push_back(fd);
    }
  });
  for (int fd : strangers) ::close(fd);
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// The store is c10d's and has no authentication: whoever reads it learns the published
// secret. With a job key (TORCHPAR_SECRET_FILE) the handshakes use HMAC(key, published),
// which that reader cannot make.
TEST(Handshake, AJobKeyMixesIntoTheSecret) {
  const Secret published = random_secret();
  EXPECT_EQ(group_secret(published, ""), published);  // no key: the published secret itself
  const std::string key(32, 'k');
  const Secret keyed = group_secret(published, key);
  EXPECT_NE(keyed, published);
  EXPECT_EQ(group_secret(published, key), keyed);
  EXPECT_NE(group_secret(published, std::string(32, 'j')), keyed);
  EXPECT_NE(group_secret(random_secret(), key), keyed);

  Nonce caller = random_nonce(), listener = random_nonce();
  Hello hello{kHandshakeMagic, 1, 0, 2, caller};
  Proof from_store{kHandshakeMagic, caller_mac(published, 0, 1, 2, caller, listener)};
  EXPECT_FALSE(check_proof(from_store, keyed, 0, hello, listener));
  Challenge c{kHandshakeMagic, 0, 1, 2, listener, listener_mac(published, 0, 1, 2, caller, listener)};
  EXPECT_NE(check_challenge(c, keyed, 1, 0, 2, caller), "");
}

// A stranger who read the published secret from the store plays rank 1 through the whole
// handshake; with a job key it is refused and the real ranks connect.
TEST(Tcp, AStoreReaderWithoutTheJobKeyCannotTakeARanksPlace) {
  char path[] = "/tmp/torchpar-key-XXXXXX";
  int key_fd = ::mkstemp(path);
  ASSERT_GE(key_fd, 0);
  const std::string key(32, 'q');
  ASSERT_EQ(::write(key_fd, key.data(), key.size()), static_cast<ssize_t>(key.size()));
  ::close(key_fd);
  ::setenv("TORCHPAR_SECRET_FILE", path, 1);
  MemoryRendezvous rv;
  std::vector<std::string> errors(2);
  auto rank = [&](int r) {
    try {
      TcpTransport t(r, 2, rv, small_config(), std::chrono::milliseconds(5000));
      float x = static_cast<float>(r + 1);
      auto c = tptest::comm(t, 0);
      collectives::allreduce(c, &x, 1, c10::ScalarType::Float, collectives::ReduceOp::kSum);
      if (x != 3.0f) errors[r] = "wrong sum " + std::to_string(x);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::thread rank0(rank, 0);
  const uint16_t port = read_record<Contact>(rv, store_keys::tcp_contact(0)).port;
  const Secret published = parse_secret(rv.get(store_keys::kTcpSecret));
  int fd = dial(port);
  ASSERT_GE(fd, 0);
  Hello hello{kHandshakeMagic, 1, 0, 2, random_nonce()};
  ::send(fd, &hello, sizeof(hello), MSG_NOSIGNAL);
  Challenge c{};
  ASSERT_EQ(::recv(fd, &c, sizeof(c), MSG_WAITALL), static_cast<ssize_t>(sizeof(c)));
  Proof proof{kHandshakeMagic, caller_mac(published, 0, 1, 2, hello.nonce, c.nonce)};
  ::send(fd, &proof, sizeof(proof), MSG_NOSIGNAL);
  Accepted accepted{};
  EXPECT_NE(::recv(fd, &accepted, sizeof(accepted), MSG_WAITALL), static_cast<ssize_t>(sizeof(accepted)))
      << "the listener accepted a caller that knew only what the store holds";
  ::close(fd);
  std::thread rank1(rank, 1);
  rank0.join();
  rank1.join();
  ::unsetenv("TORCHPAR_SECRET_FILE");
  ::unlink(path);
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// A key file that is missing, or too short to be a key, fails set-up naming it.
TEST(Tcp, ABadJobKeyFileFailsSetUpNamingIt) {
  for (bool missing : {false, true}) {
    char path[] = "/tmp/torchpar-key-XXXXXX";
    int key_fd = ::mkstemp(path);
    ASSERT_GE(key_fd, 0);
    ASSERT_EQ(::write(key_fd, "short", 5), 5);
    ::close(key_fd);
    if (missing) ::unlink(path);
    ::setenv("TORCHPAR_SECRET_FILE", path, 1);
    MemoryRendezvous rv;
    std::string error;
    try {
      TcpTransport t(0, 2, rv, small_config(), std::chrono::milliseconds(2000));
    } catch (const std::exception& e) {
      error = e.what();
    }
    ::unsetenv("TORCHPAR_SECRET_FILE");
    ::unlink(path);
    EXPECT_TRUE(contains(error, "TORCHPAR_SECRET_FILE='" + std::string(path) + "'")) << error;
    EXPECT_TRUE(contains(error, missing ? "cannot be read" : "holds 5 bytes")) << error;
  }
}

// The listener may drop a connection after the caller's proof (too many handshakes at once,
// or past its deadline). The caller used to keep such a connection as its link to the
// listener, and the group then waited on a socket nobody read until its timeout. Now it
// keeps a connection only once the listener sends Accepted, and calls again otherwise. Here
// rank 0 is played by hand: it drops the first connection after checking its proof.
TEST(Tcp, ACallerDroppedAfterItsProofCallsAgain) {
  MemoryRendezvous rv;
  uint16_t port = 0;
  Fd listener = listen_on("127.0.0.1", 16, &port);
  const Secret secret = random_secret();
  rv.set(store_keys::kTcpSecret, secret_to_hex(secret));
  rv.set(store_keys::tcp_contact(0), Contact{port, HostIdentity::local(), {}}.encode());
  int connections = 0;
  std::string fake_error;
  std::atomic<bool> rank1_done{false};
  std::thread rank0([&] {
    try {
      for (bool accept : {false, true}) {
        Fd fd = accept_until(listener.get(), Clock::now() + std::chrono::seconds(4));
        ++connections;
        const auto deadline = Clock::now() + std::chrono::seconds(4);
        Hello hello{};
        recv_all(fd.get(), &hello, sizeof(hello), deadline);
        const Nonce nonce = random_nonce();
        Challenge c{kHandshakeMagic, 0, 1, 2, nonce, listener_mac(secret, 0, 1, 2, hello.nonce, nonce)};
        send_all(fd.get(), &c, sizeof(c), deadline);
        Proof proof{};
        recv_all(fd.get(), &proof, sizeof(proof), deadline);
        ASSERT_TRUE(check_proof(proof, secret, 0, hello, nonce));
        if (!accept) continue;  // dropped: the caller must not count on this connection
        Accepted ok{kAcceptedMagic};
        send_all(fd.get(), &ok, sizeof(ok), deadline);
        while (!rank1_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (const std::exception& e) {
      fake_error = e.what();
    }
  });
  std::string rank1_error;
  try {
    TcpTransport t(1, 2, rv, small_config(), std::chrono::milliseconds(5000));
  } catch (const std::exception& e) {
    rank1_error = e.what();
  }
  rank1_done = true;
  rank0.join();
  EXPECT_EQ(rank1_error, "");
  EXPECT_EQ(connections, 2) << "rank 1 kept the connection rank 0 had dropped";
  EXPECT_EQ(fake_error, "");
}

// accept() failures that leave the listener usable (accept(2): errors of the connection or
// the network passed on, and running short of descriptors) used to end set-up on the spot.
TEST(Tcp, AcceptErrorsThatPassDoNotEndSetUp) {
  for (int err : {EINTR, EAGAIN, ECONNABORTED, EPROTO, EPERM, ENETDOWN, EHOSTUNREACH, ENETUNREACH, EMFILE, ENFILE,
                  ENOBUFS, ENOMEM}) {
    EXPECT_TRUE(accept_error_passes(err)) << std::strerror(err);
  }
  for (int err : {EBADF, EINVAL, ENOTSOCK, EFAULT}) EXPECT_FALSE(accept_error_passes(err)) << std::strerror(err);
}

// With TORCHPAR_SOCKET_IFNAME=lo the listener is bound to 127.0.0.1: the same port on this
// host's other addresses refuses connections (it used to listen on every interface).
TEST(Tcp, TheListenerBindsToTheChosenInterfaceOnly) {
  std::vector<std::string> others = local_addresses("");
  if (others.empty()) GTEST_SKIP() << "this host has no address but loopback";
  Config config = small_config();
  config.socket_ifname = "lo";
  int reached = -2;
  auto errors = two_ranks([&](uint16_t port) {
    reached = dial(port, others.front());
    if (reached >= 0) ::close(reached);
  }, config);
  EXPECT_LT(reached, 0) << "rank 0's listener answered on " << others.front();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace torchpar

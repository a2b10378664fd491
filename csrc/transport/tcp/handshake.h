// How two ranks of a group prove to each other, on a fresh TCP connection, that each knows
// the group's secret, without either sending it (issue 21: "Authentication").
//
//   caller -> listener  Hello      {magic, caller, listener, world, caller's nonce}
//   listener -> caller  Challenge  {magic, listener, caller, world, listener's nonce,
//                                   HMAC(secret, "listener" | transcript)}
//   caller -> listener  Proof      {magic, HMAC(secret, "caller" | transcript)}
//   listener -> caller  Accepted   {magic}
//
// The caller keeps the connection only once Accepted arrives: the listener may still drop a
// connection after the caller's proof (too many handshakes at once, its deadline), and a
// caller that took the proof's sending for success would wait on a socket nobody reads
// until the group's timeout. Without Accepted it calls again.
//
// The transcript is both ranks, the world size and both nonces, so a reply recorded on one
// connection is useless on another (the other side's nonce is new each time) and the role
// label keeps either side from reflecting the other's MAC back. The caller checks the
// listener's MAC before it sends its own, so a stranger listening at a wrong address learns
// nothing it could use. HMAC-SHA256 is OpenSSL's (libcrypto): vetted, constant-time compare.
//
// Everything here is a pure function of bytes, so tests and the fuzz target drive it alone.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace torchpar::tcp {

constexpr uint64_t kHandshakeMagic = 0x7470617274637033ULL;  // "tpartcp3"
constexpr uint64_t kAcceptedMagic = 0x7470617274636f6bULL;   // "tpartcok"
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;      // SHA-256
constexpr size_t kSecretBytes = 32;

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;
using Secret = std::array<uint8_t, kSecretBytes>;

#pragma pack(push, 1)
struct Hello {
  uint64_t magic;
  int32_t rank;  // the caller
  int32_t to;    // the listener it means to reach
  int32_t size;
  Nonce nonce;
};

struct Challenge {
  uint64_t magic;
  int32_t rank;  // the listener
  int32_t to;    // the caller
  int32_t size;
  Nonce nonce;
  Mac mac;
};

struct Proof {
  uint64_t magic;
  Mac mac;
};

struct Accepted {
  uint64_t magic;
};
#pragma pack(pop)

// Fresh random bytes from the system's generator (OpenSSL RAND_bytes); throws on failure.
Secret random_secret();
Nonce random_nonce();

// The secret as the store holds it (64 hex digits), and back; parse_secret throws an Error
// quoting `text` if it is anything else.
std::string secret_to_hex(const Secret& secret);
Secret parse_secret(const std::string& text);

// The secret the handshakes use. `published` is the one rank 0 drew and put in the store; the
// store is c10d's, which has no authentication, so whoever can read it could join the group.
// With a job key that every rank holds and the store never sees (TORCHPAR_SECRET_FILE) the
// secret is HMAC(key, published): a reader of the store learns the published half only.
// Without a key (empty) it is `published` itself.
Secret group_secret(const Secret& published, const std::string& job_key);

// The MACs each side sends: over both ranks, the world size and both nonces.
Mac listener_mac(const Secret& secret, int listener, int caller, int size, const Nonce& caller_nonce,
                 const Nonce& listener_nonce);
Mac caller_mac(const Secret& secret, int listener, int caller, int size, const Nonce& caller_nonce,
               const Nonce& listener_nonce);
// Constant-time comparison.
bool same_mac(const Mac& a, const Mac& b);

// The listener's check of a Hello, before it spends anything on the connection: "" if it is
// a plausible call from a higher rank of this group to `me`, else why not.
std::string check_hello(const Hello& hello, int me, int size);
// The caller's check of a Challenge from the rank it called: "" if the listener proved it
// knows the secret, else why not.
std::string check_challenge(const Challenge& challenge, const Secret& secret, int me, int peer, int size,
                            const Nonce& my_nonce);
// The listener's check of the caller's Proof.
bool check_proof(const Proof& proof, const Secret& secret, int me, const Hello& hello, const Nonce& my_nonce);

}  // namespace torchpar::tcp

#include "transport/tcp/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>
#include <vector>

#include "common/error.h"

namespace torchpar::tcp {
namespace {

static_assert(kMacBytes == 32 && kSecretBytes == 32, "a MAC and a secret are each one SHA-256 output");

template <size_t N>
std::array<uint8_t, N> random_bytes() {
  std::array<uint8_t, N> out{};
  TP_CHECK(::RAND_bytes(out.data(), static_cast<int>(N)) == 1, "the system's random generator failed");
  return out;
}

void put_i32(std::vector<uint8_t>& out, int32_t v) {
  uint32_t u = static_cast<uint32_t>(v);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(u >> (8 * i)));
}

// HMAC-SHA256 of `text` under `key` (OpenSSL's libcrypto); throws if it fails.
std::array<uint8_t, 32> hmac_sha256(const void* key, size_t key_len, const std::vector<uint8_t>& text) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  TP_CHECK(::HMAC(::EVP_sha256(), key, static_cast<int>(key_len), text.data(), text.size(), out.data(), &len) !=
                   nullptr &&
               len == out.size(),
           "HMAC-SHA256 failed");
  return out;
}

// The role label first, then fixed-width fields: no two transcripts encode alike.
Mac mac_of(const Secret& secret, const char* role, int listener, int caller, int size, const Nonce& caller_nonce,
           const Nonce& listener_nonce) {
  std::vector<uint8_t> text(role, role + std::strlen(role) + 1);
  put_i32(text, listener);
  put_i32(text, caller);
  put_i32(text, size);
  text.insert(text.end(), caller_nonce.begin(), caller_nonce.end());
  text.insert(text.end(), listener_nonce.begin(), listener_nonce.end());
  return hmac_sha256(secret.data(), secret.size(), text);
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Secret random_secret() { return random_bytes<kSecretBytes>(); }
Nonce random_nonce() { return random_bytes<kNonceBytes>(); }

std::string secret_to_hex(const Secret& secret) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : secret) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

Secret parse_secret(const std::string& text) {
  Secret secret{};
  bool ok = text.size() == 2 * kSecretBytes;
  for (size_t i = 0; ok && i < kSecretBytes; ++i) {
    int hi = hex_digit(text[2 * i]), lo = hex_digit(text[2 * i + 1]);
    ok = hi >= 0 && lo >= 0;
    secret[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  // Never quote a value that might be the secret itself: only its length.
  TP_CHECK(ok, "the group secret is not ", 2 * kSecretBytes, " hex digits (", text.size(), " characters)");
  return secret;
}

Secret group_secret(const Secret& published, const std::string& job_key) {
  if (job_key.empty()) return published;
  static const char kLabel[] = "torchpar group secret";  // with its NUL: domain separation from the MACs
  std::vector<uint8_t> text(kLabel, kLabel + sizeof(kLabel));
  text.insert(text.end(), published.begin(), published.end());
  return hmac_sha256(job_key.data(), job_key.size(), text);
}

Mac listener_mac(const Secret& secret, int listener, int caller, int size, const Nonce& caller_nonce,
                 const Nonce& listener_nonce) {
  return mac_of(secret, "torchpar listener", listener, caller, size, caller_nonce, listener_nonce);
}

Mac caller_mac(const Secret& secret, int listener, int caller, int size, const Nonce& caller_nonce,
               const Nonce& listener_nonce) {
  return mac_of(secret, "torchpar caller", listener, caller, size, caller_nonce, listener_nonce);
}

bool same_mac(const Mac& a, const Mac& b) { return ::CRYPTO_memcmp(a.data(), b.data(), kMacBytes) == 0; }

std::string check_hello(const Hello& hello, int me, int size) {
  if (hello.magic != kHandshakeMagic) return "not a torchpar hello";
  if (hello.size != size) return "a hello for a group of " + std::to_string(hello.size) + " ranks";
  if (hello.to != me) return "a hello for rank " + std::to_string(hello.to);
  // Only higher ranks call: see TcpTransport::connect_all.
  if (hello.rank <= me || hello.rank >= size) return "a hello from rank " + std::to_string(hello.rank);
  return "";
}

std::string check_challenge(const Challenge& challenge, const Secret& secret, int me, int peer, int size,
                            const Nonce& my_nonce) {
  if (challenge.magic != kHandshakeMagic || challenge.rank != peer || challenge.to != me || challenge.size != size) {
    return "the process listening there is not rank " + std::to_string(peer) + " of this group";
  }
  if (!same_mac(challenge.mac, listener_mac(secret, peer, me, size, my_nonce, challenge.nonce))) {
    return "the process listening there does not prove that it knows this group's secret (a stranger, or a rank "
           "whose TORCHPAR_SECRET_FILE holds another key)";
  }
  return "";
}

bool check_proof(const Proof& proof, const Secret& secret, int me, const Hello& hello, const Nonce& my_nonce) {
  return proof.magic == kHandshakeMagic &&
         same_mac(proof.mac, caller_mac(secret, me, hello.rank, hello.size, hello.nonce, my_nonce));
}

}  // namespace torchpar::tcp

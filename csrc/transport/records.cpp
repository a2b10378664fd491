#include "transport/records.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace torchpar {
namespace {

// The first `n` '|'-separated fields of `text`; the last one takes the rest of the text.
std::vector<std::string> fields(const std::string& text, size_t n, const char* what) {
  std::vector<std::string> out;
  size_t start = 0;
  while (out.size() + 1 < n) {
    size_t bar = text.find('|', start);
    TP_CHECK(bar != std::string::npos, "malformed ", what, " '", text, "': expected ", n, " fields");
    out.push_back(text.substr(start, bar - start));
    start = bar + 1;
  }
  out.push_back(text.substr(start));
  return out;
}

// A whole decimal number in [lo, hi]; anything else (text, a sign, trailing characters, a
// value out of range) is an Error that quotes the field. std::stoul would throw
// std::invalid_argument, or take "12x" for 12.
int64_t number(const std::string& text, int64_t lo, int64_t hi, const char* what) {
  int64_t value = 0;
  bool ok = !text.empty() && text.size() <= 18;
  for (size_t i = 0; ok && i < text.size(); ++i) {
    ok = text[i] >= '0' && text[i] <= '9';
    value = value * 10 + (text[i] - '0');
  }
  TP_CHECK(ok && value >= lo && value <= hi, what, " '", text, "' is not a number from ", lo, " to ", hi);
  return value;
}

// The inode of /proc/self/ns/`kind`, which names this process's namespace of that kind;
// empty where /proc does not say (then every rank reads the same empty value).
std::string namespace_inode(const char* kind) {
  struct stat st {};
  const std::string path = std::string("/proc/self/ns/") + kind;
  return ::stat(path.c_str(), &st) == 0 ? std::to_string(st.st_ino) : std::string();
}

}  // namespace

HostIdentity HostIdentity::local() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  HostIdentity id;
  id.hostname = host;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id.boot_id;
  id.pid_namespace = namespace_inode("pid");
  id.net_namespace = namespace_inode("net");
  return id;
}

std::string HostIdentity::encode() const {
  return hostname + "|" + boot_id + "|" + pid_namespace + "|" + net_namespace;
}

HostIdentity HostIdentity::decode(const std::string& text) {
  auto f = fields(text, 4, "host identity");
  return HostIdentity{f[0], f[1], f[2], f[3]};
}

std::string Contact::encode() const {
  std::string out = std::to_string(port) + "|" + host.encode() + "|";
  for (size_t i = 0; i < addresses.size(); ++i) out += (i ? "," : "") + addresses[i];
  return out;
}

Contact Contact::decode(const std::string& text) {
  auto f = fields(text, 6, "TCP contact");
  Contact c;
  c.port = static_cast<uint16_t>(number(f[0], 1, 65535, "port"));
  c.host = HostIdentity{f[1], f[2], f[3], f[4]};
  std::istringstream list(f[5]);
  for (std::string a; std::getline(list, a, ',');) {
    if (!a.empty()) c.addresses.push_back(a);
  }
  return c;
}

std::string AbortNotice::encode() const { return std::to_string(rank) + "|" + reason; }

AbortNotice AbortNotice::decode(const std::string& text) {
  auto f = fields(text, 2, "abort notice");
  return AbortNotice{static_cast<int>(number(f[0], 0, INT32_MAX, "rank")), f[1]};
}

}  // namespace torchpar

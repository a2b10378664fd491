#include "transport/host.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

namespace torchpar {

std::string host_identity() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  struct stat st {};
  std::string pidns = ::stat("/proc/self/ns/pid", &st) == 0 ? std::to_string(st.st_ino) : "";
  return std::string(host) + "|" + boot_id + "|" + pidns;
}

}  // namespace torchpar

#include "transport/hosts.h"

namespace torchpar {

std::string HostMap::describe(int host) const {
  std::string out = "host " + std::to_string(host) + " (rank" + (ranks_of[host].size() > 1 ? "s " : " ");
  for (size_t i = 0; i < ranks_of[host].size(); ++i) out += (i ? ", " : "") + std::to_string(ranks_of[host][i]);
  return out + ")";
}

}  // namespace torchpar

// torchpar._C: runs every TORCHPAR_PYBIND registration (see bindings.h).
#include "python/bindings.h"

#include <map>
#include <string>

namespace torchpar::python {
namespace {

std::map<std::string, BindFn>& registry() {
  static std::map<std::string, BindFn> fns;
  return fns;
}

}  // namespace

Binding::Binding(const char* name, BindFn fn) {
  registry().emplace(name, fn);
}

}  // namespace torchpar::python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torchpar C++ core: torch.distributed backend, fused kernels, parallel engines";
  for (auto& [name, fn] : torchpar::python::registry()) {
    fn(m);
  }
}

// Python face of torchpar._C.TorchparGroup: the c10d ProcessGroup torch.distributed hands
// users for a torchpar group (torchpar/_backend.py builds one around each backend).
//
// It is torch's ProcessGroup, with one difference: it tells its name. Whatever asks the
// group rather than its backend for a name gets "torchpar"; torch's plain group answers
// "custom" for every plugin backend (ProcessGroup::backendTypeToString(CUSTOM)), which is
// what DDP's logging data reported (issue 23). torch uses a ProcessGroup returned by a
// plugin's creator as the group itself, so the group must also carry the backend for every
// device torchpar serves, as torch's own set-up would have registered it.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "python/bindings.h"

namespace torchpar {
namespace {

class TorchparGroup : public c10d::ProcessGroup {
 public:
  TorchparGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                const c10::intrusive_ptr<c10d::Backend>& backend)
      : c10d::ProcessGroup(store, rank, size) {
    setDefaultBackend(BackendType::CUSTOM);
    for (auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) setBackend(device, BackendType::CUSTOM, backend);
  }

  const std::string getBackendName() const override { return "torchpar"; }
};

}  // namespace
}  // namespace torchpar

TORCHPAR_PYBIND(group) {
  namespace py = pybind11;
  py::class_<torchpar::TorchparGroup, c10d::ProcessGroup, c10::intrusive_ptr<torchpar::TorchparGroup>>(
      m, "TorchparGroup")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const c10::intrusive_ptr<c10d::Backend>& backend) {
             return c10::make_intrusive<torchpar::TorchparGroup>(store, rank, size, backend);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("backend"));
}

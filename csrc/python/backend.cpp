// Python face of the backend: torchpar._C.ProcessGroupTorchpar, a c10d Backend.
#include <pybind11/chrono.h>

#include "backend/process_group.h"
#include "python/bindings.h"

TORCHPAR_PYBIND(backend) {
  namespace py = pybind11;
  py::class_<torchpar::ProcessGroupTorchpar, c10d::Backend,
             c10::intrusive_ptr<torchpar::ProcessGroupTorchpar>>(m, "ProcessGroupTorchpar")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string group_name) {
             return c10::make_intrusive<torchpar::ProcessGroupTorchpar>(store, rank, size, timeout,
                                                                         std::move(group_name));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"),
           py::call_guard<py::gil_scoped_release>())
      // torch's dist.monitored_barrier accepts gloo groups only (it checks the name); this is
      // torchpar's monitoredBarrier reached through the group's backend object.
      .def(
          "monitored_barrier",
          [](torchpar::ProcessGroupTorchpar& self, std::chrono::milliseconds timeout, bool wait_all_ranks) {
            c10d::BarrierOptions opts;
            opts.timeout = timeout;
            self.monitoredBarrier(opts, wait_all_ranks);
          },
          py::arg("timeout") = c10d::kUnsetTimeout, py::arg("wait_all_ranks") = false,
          py::call_guard<py::gil_scoped_release>())
      // group.abort() with a reason the peers' errors quote (torch's ProcessGroup.abort takes none).
      .def(
          "abort",
          [](torchpar::ProcessGroupTorchpar& self, std::optional<std::string> reason) {
            if (reason) {
              self.abort(*reason);
            } else {
              self.abort();
            }
          },
          py::arg("reason") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("segment_name", &torchpar::ProcessGroupTorchpar::segment_name)
      .def_property_readonly("transport", &torchpar::ProcessGroupTorchpar::transport_name);
}

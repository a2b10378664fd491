// Python bindings of the tensor-parallel communication (csrc/parallel/tensor_parallel.h);
// the layers over them are in torchpar/parallel/tensor/.
#include "parallel/tensor_parallel.h"
#include "python/bindings.h"

#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
namespace tp = torchpar::parallel::tp;

TORCHPAR_PYBIND(tensor_parallel) {
  // Each takes a tensor and a torch.distributed.ProcessGroup; the GIL is released so the
  // backend's threads (and other Python threads) run while a collective waits.
  auto region = [&m](const char* name, at::Tensor (*fn)(const at::Tensor&, const tp::Group&),
                     const char* doc) {
    m.def(name, fn, py::arg("input"), py::arg("group"), py::call_guard<py::gil_scoped_release>(), doc);
  };
  region("tp_copy_to_region", &tp::copy_to_region, "Identity; backward all-reduces the gradient.");
  region("tp_reduce_from_region", &tp::reduce_from_region, "All-reduce; backward is the identity.");
  region("tp_scatter_to_region", &tp::scatter_to_region,
         "This rank's slice of the last dim; backward all-gathers it.");
  region("tp_gather_from_region", &tp::gather_from_region,
         "All-gather along the last dim; backward keeps this rank's slice.");
  region("tp_scatter_to_sequence_region", &tp::scatter_to_sequence_region,
         "This rank's slice of dim 0 (the sequence); backward all-gathers it.");
  region("tp_gather_from_sequence_region", &tp::gather_from_sequence_region,
         "All-gather along dim 0; backward reduce-scatters.");
  region("tp_reduce_scatter_to_sequence_region", &tp::reduce_scatter_to_sequence_region,
         "Reduce-scatter along dim 0; backward all-gathers.");
  m.def("tp_linear_with_async_comm", &tp::linear_with_async_comm, py::arg("input"), py::arg("weight"),
        py::arg("bias"), py::arg("group"), py::arg("sequence_parallel") = false,
        py::arg("overlap") = true, py::call_guard<py::gil_scoped_release>(),
        "Column-parallel linear; backward overlaps the input gradient's reduction with the "
        "weight gradient.");
  m.def("tp_check_same_sizes", &tp::check_same_sizes, py::arg("input"), py::arg("group"),
        py::arg("what"), py::call_guard<py::gil_scoped_release>(),
        "ValueError on every rank unless input.shape agrees across the group.");
  m.def("tp_bytes_communicated", &tp::bytes_communicated);
  m.def("tp_reset_bytes_communicated", &tp::reset_bytes_communicated);
  m.def("tp_set_tracing", &tp::set_tracing, py::arg("on"),
        "Clear the backward event trace and turn recording on or off.");
  m.def("tp_trace", &tp::trace);
}

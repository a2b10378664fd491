// Python bindings of the DDP reducer (csrc/parallel/reducer.h); the nn.Module wrapper is
// torchpar/parallel/ddp.py.
#include "common/step_buffer.h"
#include "parallel/bucket_assignment.h"
#include "parallel/reducer.h"
#include "python/bindings.h"
#include "python/released_without_gil.h"

#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using torchpar::parallel::Reducer;
using torchpar::parallel::ReducerOptions;
using torchpar::parallel::TraceEvent;

namespace {
py::list shard_layout_to_python(const std::vector<torchpar::parallel::BucketShards>& layout) {
  py::list out;
  for (const auto& s : layout) {
    out.append(py::make_tuple(s.params, s.owners, s.offsets, s.shard_numel));
  }
  return out;
}
}  // namespace

TORCHPAR_PYBIND(reducer) {
  m.def("step_buffer_bytes_mapped_total", &torchpar::step_buffer_bytes_mapped_total,
        "Bytes this process has mapped in huge pages for ZeRO-2's and fully_shard's per-step "
        "buffers, in all (csrc/common/step_buffer.h).");
  m.def("ddp_assign_buckets", &torchpar::parallel::assign_buckets, py::arg("params"),
        py::arg("cap_bytes"), py::arg("first_cap_bytes"), py::arg("reduce_dtype") = py::none(),
        py::arg("order") = std::vector<int64_t>{}, py::arg("sparse") = std::vector<bool>{},
        "Bucket -> parameter indices, filled in `order` (default: reverse registration order); "
        "a parameter flagged in `sparse` (sparse gradients) alone in its bucket.");
  m.def("zero_shard_buckets",
        [](const std::vector<at::Tensor>& params, const std::vector<std::vector<int64_t>>& buckets,
           int64_t world_size) {
          return shard_layout_to_python(torchpar::parallel::shard_buckets(params, buckets, world_size));
        },
        py::arg("params"), py::arg("buckets"), py::arg("world_size"),
        "Per bucket (params, owners, offsets, shard_numel): whole-parameter shards balanced by "
        "size, the layout ZeRO's optimizer and DDP(shard_gradients=True) share.");

  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       std::vector<std::vector<int64_t>> buckets,
                       c10::intrusive_ptr<c10d::ProcessGroup> group, bool gradient_as_bucket_view,
                       bool find_unused_parameters, std::optional<at::ScalarType> reduce_dtype,
                       int64_t cap_bytes, int64_t first_cap_bytes, bool static_graph,
                       bool reduce_grads_in_place, bool shard_gradients, std::vector<bool> sparse) {
             ReducerOptions options;
             options.cap_bytes = cap_bytes;
             options.first_cap_bytes = first_cap_bytes;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.find_unused_parameters = find_unused_parameters;
             options.reduce_dtype = reduce_dtype;
             options.static_graph = static_graph;
             options.reduce_grads_in_place = reduce_grads_in_place;
             options.shard_gradients = shard_gradients;
             options.sparse = std::move(sparse);
             return torchpar::python::make_shared_released_without_gil<Reducer>(
                 std::move(params), std::move(names), std::move(buckets), std::move(group), options);
           }),
           py::arg("params"), py::arg("names"), py::arg("buckets"), py::arg("process_group"),
           py::arg("gradient_as_bucket_view") = false, py::arg("find_unused_parameters") = false,
           py::arg("reduce_dtype") = py::none(), py::arg("cap_bytes") = -1,
           py::arg("first_cap_bytes") = -1, py::arg("static_graph") = false,
           py::arg("reduce_grads_in_place") = false, py::arg("shard_gradients") = false,
           py::arg("sparse") = std::vector<bool>{})
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_if_unreached", &Reducer::reduce_if_unreached, py::call_guard<py::gil_scoped_release>(),
           "After an armed backward the caller ran: reduce now if it reached no parameter "
           "(returns True then).")
      .def("cancel_backward", &Reducer::cancel_backward, py::call_guard<py::gil_scoped_release>(),
           "Disarm after an armed backward raised (launched reductions are waited for).")
      .def("abandon_backward", &Reducer::abandon_backward, py::call_guard<py::gil_scoped_release>(),
           "After this rank's step failed: issue the collectives its synchronised backward still "
           "owes the data-parallel peers (zeros), then disarm.")
      .def_property_readonly("completed_backwards",
                             py::cpp_function(&Reducer::completed_backwards, py::call_guard<py::gil_scoped_release>()),
                             "Synchronised backwards completed so far.")
      .def("trace",
           [](const Reducer& r) {
             py::list out;
             for (const auto& e : r.trace()) {
               const char* kind = e.kind == TraceEvent::kReady    ? "ready"
                                  : e.kind == TraceEvent::kLaunch ? "launch"
                                                                  : "finalize";
               out.append(py::make_tuple(kind, e.index));
             }
             return out;
           },
           "Events of the last synchronised step: ('ready', param), ('launch', bucket), "
           "('finalize', -1).")
      .def("register_comm_hook",
           [](Reducer& r, py::object state, py::object hook) {
             r.register_comm_hook(std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook)));
           },
           py::arg("state"), py::arg("hook"),
           "hook(state, torch.distributed.GradBucket) -> torch.futures.Future[Tensor] replaces "
           "each bucket's all-reduce (torch DDP's register_comm_hook contract).")
      .def("queue_finalize", &Reducer::queue_finalize, py::call_guard<py::gil_scoped_release>(),
           "Queue the end-of-backward callback on the graph task now running (from a node on "
           "the forward's outputs: the outermost backward).")
      .def("records_static_graph", &Reducer::records_static_graph,
           "static_graph, and this rank's gradient counts are still to be recorded.")
      .def("join_shadow_backward", &Reducer::join_shadow_backward,
           py::call_guard<py::gil_scoped_release>(),
           "The collectives of one synchronised backward with zeros as this rank's share "
           "(for DDP.join()).")
      .def("bucket_indices", &Reducer::bucket_indices)
      .def("bucket_tensors", &Reducer::bucket_tensors, py::call_guard<py::gil_scoped_release>(),
           "Each bucket's flat tensor (allocated, as zeros, if it was not yet).")
      .def("shard_layout",
           [](const Reducer& r) { return shard_layout_to_python(r.shard_layout()); },
           "shard_gradients: per bucket (params, owners, offsets, shard_numel), the ZeRO layout.")
      .def("bucket_bytes", &Reducer::bucket_bytes, py::call_guard<py::gil_scoped_release>(),
           "Bytes of bucket tensors allocated so far.")
      .def("peak_grad_bytes", &Reducer::peak_grad_bytes,
           "Highest bucket bytes plus the gradient in transit, at any gradient's arrival since "
           "reset_peak_grad_bytes().")
      .def("reset_peak_grad_bytes", &Reducer::reset_peak_grad_bytes);
}

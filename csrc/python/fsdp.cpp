// Python bindings of the FSDP engine (csrc/parallel/fsdp_{flat_param,engine}.h); the module hooks
// that call it are torchpar/parallel/fsdp.py.
#include "parallel/fsdp_engine.h"
#include "parallel/fsdp_flat_param.h"
#include "python/bindings.h"
#include "python/released_without_gil.h"

#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using torchpar::parallel::FlatParam;
using torchpar::parallel::FlatParamOptions;
using torchpar::parallel::FsdpEngine;
using torchpar::parallel::FsdpEvent;
using torchpar::parallel::FsdpMemory;

namespace {

const char* event_name(FsdpEvent::Kind kind) {
  switch (kind) {
    case FsdpEvent::kPreForward: return "pre_forward";
    case FsdpEvent::kPostForward: return "post_forward";
    case FsdpEvent::kGatherLaunch: return "all_gather_launch";
    case FsdpEvent::kGatherWait: return "all_gather_wait";
    case FsdpEvent::kReshard: return "reshard";
    case FsdpEvent::kPreBackward: return "pre_backward";
    case FsdpEvent::kPostBackward: return "post_backward";
    case FsdpEvent::kReduceScatterLaunch: return "reduce_scatter_launch";
    case FsdpEvent::kReduceScatterWait: return "reduce_scatter_wait";
    case FsdpEvent::kFinalize: return "finalize";
    case FsdpEvent::kSkippedBackward: return "skipped_backward";
    case FsdpEvent::kAllReduceLaunch: return "all_reduce_launch";
    case FsdpEvent::kAllReduceWait: return "all_reduce_wait";
    case FsdpEvent::kReshardToPostForward: return "reshard_to_post_forward";
  }
  return "?";
}

py::dict memory_dict(const FsdpMemory& m) {
  py::dict d;
  d["shards"] = m.shards;
  d["gathered"] = m.gathered;
  d["unsharded_grads"] = m.unsharded_grads;
  d["reduce_buffers"] = m.reduce_buffers;
  d["accumulators"] = m.accumulators;
  d["sharded_grads"] = m.sharded_grads;
  d["total"] = m.total();
  return d;
}

}  // namespace

TORCHPAR_PYBIND(fsdp) {
  py::class_<FlatParam, std::shared_ptr<FlatParam>>(m, "FlatParam")
      .def(py::init([](const std::vector<at::Tensor>& params, std::vector<std::string> names,
                       c10::intrusive_ptr<c10d::ProcessGroup> group, bool reshard_after_forward,
                       std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> replicate_group) {
             FlatParamOptions options;
             options.reshard_after_forward = reshard_after_forward;
             options.param_dtype = param_dtype;
             options.reduce_dtype = reduce_dtype;
             return torchpar::python::make_shared_released_without_gil<FlatParam>(
                 params, std::move(names), std::move(group), options,
                 replicate_group.value_or(c10::intrusive_ptr<c10d::ProcessGroup>()));
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("reshard_after_forward") = true,
           py::arg("param_dtype") = py::none(), py::arg("reduce_dtype") = py::none(),
           py::arg("replicate_group") = py::none(), py::call_guard<py::gil_scoped_release>(),
           "Shards `params` (checked identical across ranks, collectives) into a flat parameter; with a "
           "`replicate_group`, its reduced gradients are all-reduced over it (hybrid sharding).")
      .def_property_readonly("numel", &FlatParam::numel)
      .def_property_readonly("padded_numel", &FlatParam::padded_numel)
      .def_property_readonly("shard_numel", &FlatParam::shard_numel)
      .def_property_readonly("world_size", &FlatParam::world_size)
      .def_property_readonly("rank", &FlatParam::rank)
      .def_property_readonly("replicas", &FlatParam::replicas)
      .def_property_readonly("compute_dtype", &FlatParam::compute_dtype)
      .def_property_readonly("reduce_dtype", &FlatParam::reduce_dtype)
      .def("offset", &FlatParam::offset)
      .def("shard_range", &FlatParam::shard_range, "(start, length) of parameter i's elements on this rank")
      .def("shape", &FlatParam::shape)
      .def("shard_views", &FlatParam::shard_views)
      .def("unsharded_views", &FlatParam::unsharded_views)
      .def("bind", &FlatParam::bind, py::arg("sharded"), py::arg("unsharded"))
      .def("gathered", &FlatParam::gathered)
      .def_readwrite("requires_grad_sync", &FlatParam::requires_grad_sync)
      .def_readwrite("gradient_divide_factor", &FlatParam::gradient_divide_factor)
      .def_readwrite("requires_all_reduce", &FlatParam::requires_all_reduce)
      .def_readwrite("reshard_after_backward", &FlatParam::reshard_after_backward)
      .def_readwrite("unshard_in_backward", &FlatParam::unshard_in_backward)
      .def_readwrite("optimizer_steps", &FlatParam::optimizer_steps)
      .def_readwrite("unshard_requested", &FlatParam::unshard_requested)
      .def("start_gather", &FlatParam::start_gather, py::call_guard<py::gil_scoped_release>())
      .def("gather_in_flight", &FlatParam::gather_in_flight)
      .def("wait_gather", &FlatParam::wait_gather, py::call_guard<py::gil_scoped_release>())
      .def("free_full", &FlatParam::free_full)
      .def_property(
          "post_forward_group",
          [](const FlatParam& f) -> std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> {
            if (!f.post_forward_group()) return std::nullopt;
            return f.post_forward_group();
          },
          [](FlatParam& f, std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> g) {
            f.set_post_forward_group(g.value_or(c10::intrusive_ptr<c10d::ProcessGroup>()));
          })
      .def("holds_post_forward", &FlatParam::holds_post_forward)
      .def_property(
          "reshard_after_forward", [](const FlatParam& f) { return f.options().reshard_after_forward; },
          &FlatParam::set_reshard_after_forward)
      .def_property(
          "accumulator",
          [](const FlatParam& f) -> std::optional<at::Tensor> {
            if (!f.accumulator().defined()) return std::nullopt;
            return f.accumulator();
          },
          [](FlatParam& f, std::optional<at::Tensor> t) { f.set_accumulator(t.value_or(at::Tensor())); },
          "no_sync's local gradient sum (None when there is none)")
      .def("gather_full_params", &FlatParam::gather_full_params, py::call_guard<py::gil_scoped_release>(),
           "Every parameter full-shaped in the master dtype (collective).")
      .def("load_full_param", &FlatParam::load_full_param, py::call_guard<py::gil_scoped_release>());

  py::class_<FsdpEngine, std::shared_ptr<FsdpEngine>>(m, "FsdpEngine")
      .def(py::init([](std::vector<std::shared_ptr<FlatParam>> units, int64_t root) {
             return torchpar::python::make_shared_released_without_gil<FsdpEngine>(std::move(units), root);
           }),
           py::arg("units"), py::arg("root"))
      .def("pre_forward", &FsdpEngine::pre_forward, py::call_guard<py::gil_scoped_release>())
      .def("post_forward", &FsdpEngine::post_forward, py::call_guard<py::gil_scoped_release>())
      .def("register_post_backward", &FsdpEngine::register_post_backward)
      .def("pre_backward", &FsdpEngine::pre_backward, py::call_guard<py::gil_scoped_release>())
      .def("post_backward", &FsdpEngine::post_backward, py::call_guard<py::gil_scoped_release>())
      .def("unshard", &FsdpEngine::unshard, py::arg("unit"), py::call_guard<py::gil_scoped_release>())
      .def("wait_unshard", &FsdpEngine::wait_unshard, py::arg("unit"), py::call_guard<py::gil_scoped_release>())
      .def("set_forward_prefetch", &FsdpEngine::set_forward_prefetch, py::arg("unit"), py::arg("targets"))
      .def("set_backward_prefetch", &FsdpEngine::set_backward_prefetch, py::arg("unit"), py::arg("targets"))
      .def("reshard_all", &FsdpEngine::reshard_all, py::call_guard<py::gil_scoped_release>())
      .def("reset_iter_state", &FsdpEngine::reset_iter_state, py::call_guard<py::gil_scoped_release>())
      .def("reshard", &FsdpEngine::reshard, py::arg("unit"), py::call_guard<py::gil_scoped_release>())
      .def("forward_order", &FsdpEngine::forward_order)
      .def("trace",
           [](const FsdpEngine& e) {
             py::list out;
             for (const auto& ev : e.trace()) out.append(py::make_tuple(event_name(ev.kind), ev.unit));
             return out;
           },
           "Events of the last step: (kind, unit).")
      .def("memory", [](const FsdpEngine& e) { return memory_dict(e.memory()); },
           "Bytes of tensors the engine owns now, by kind.")
      .def("peak_memory", [](const FsdpEngine& e) { return memory_dict(e.peak_memory()); },
           "The highest total since reset_peak_memory(), by kind.")
      .def("reset_peak_memory", &FsdpEngine::reset_peak_memory);
}

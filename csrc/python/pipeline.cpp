// Python bindings of the pipeline schedules (csrc/parallel/pipeline/schedule.h); the
// executor that runs them is torchpar/parallel/pipeline/schedules.py.
#include "common/error.h"
#include "parallel/pipeline/schedule.h"
#include "python/bindings.h"

namespace py = pybind11;
namespace pp = torchpar::pipeline;

namespace {

// Bad sizes and broken schedules are the caller's input: ValueError, with the C++ message.
template <typename Fn>
auto as_value_error(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const torchpar::Error& e) {
    throw py::value_error(e.what());
  }
}

py::list action_list(const std::vector<pp::Action>& actions) {
  py::list out;
  for (const auto& a : actions) out.append(py::make_tuple(pp::action_name(a.type), a.microbatch, a.stage));
  return out;
}

}  // namespace

TORCHPAR_PYBIND(pipeline) {
  py::class_<pp::Schedule>(m, "PipelineSchedule",
                           "Per-rank action lists of a pipeline schedule; actions are (name, microbatch, stage).")
      .def_readonly("num_ranks", &pp::Schedule::num_ranks)
      .def_readonly("num_microbatches", &pp::Schedule::num_microbatches)
      .def_readonly("stages_per_rank", &pp::Schedule::stages_per_rank)
      .def_readonly("split_backward", &pp::Schedule::split_backward)
      .def_property_readonly("num_stages", &pp::Schedule::num_stages)
      .def("actions", [](const pp::Schedule& s, int rank) {
             if (rank < 0 || rank >= s.num_ranks) throw py::index_error("rank out of range");
             return action_list(s.actions[rank]);
           }, py::arg("rank"))
      .def("to_csv", &pp::schedule_to_csv)
      .def("forward_only", &pp::forward_only)
      .def("simulate",
           [](const pp::Schedule& s, std::optional<pp::StageCosts> costs) {
             auto r = as_value_error([&] { return pp::simulate(s, costs ? &*costs : nullptr); });
             py::dict d;
             d["makespan"] = r.makespan;
             d["busy"] = r.busy;
             d["bubble"] = r.bubble;
             d["peak_in_flight"] = r.peak_in_flight;
             d["start"] = r.start;
             return d;
           },
           py::arg("costs") = py::none(),
           "Checks the lists on a virtual clock and returns makespan, busy, bubble, peak_in_flight "
           "and start times per rank; raises ValueError on any violation. Unit costs (F 1, B 2 "
           "or 1 when split, W 1), or ``costs``: per stage, the (F, B, W) times.");

  m.def("pipeline_schedule",
        [](const std::string& kind, int p, int m_, int v) {
          return as_value_error([&] { return pp::make_schedule(pp::parse_kind(kind), p, m_, v); });
        },
        py::arg("kind"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank") = 1,
        "kind: gpipe, 1f1b, interleaved_1f1b, zb_h1, interleaved_zb or looped_bfs.");
  m.def("pipeline_schedule_from_csv",
        [](const std::string& text, int p, int m_, int v) {
          return as_value_error([&] { return pp::schedule_from_csv(text, p, m_, v); });
        },
        py::arg("text"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank") = 1);
  m.def("pipeline_theoretical_bubble",
        [](const std::string& kind, int p, int m_, int v) {
          return as_value_error([&] { return pp::theoretical_bubble(pp::parse_kind(kind), p, m_, v); });
        },
        py::arg("kind"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank") = 1);
}

// Objects handed to Python that can hold the last reference to a process group.
#pragma once

#include <memory>
#include <utility>

#include <torch/extension.h>

namespace torchpar::python {

// `new T(args...)` for Python, destroyed with the GIL released. A process group's destructor
// joins its threads (gloo's and ours), and one of them may be waiting for the GIL to release a
// tensor's Python object, so a destructor run by Python's garbage collection with the GIL held
// deadlocks. Seen in CI: a DDP's Reducer that outlived destroy_process_group on a gloo group,
// dropped at the end of a function, hung its rank in ~ProcessGroupGloo. torch binds its own
// groups with a GIL-releasing holder for the same reason.
template <typename T, typename... Args>
std::shared_ptr<T> make_shared_released_without_gil(Args&&... args) {
  return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](T* p) {
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release no_gil;
      delete p;
    } else {
      delete p;
    }
  });
}

}  // namespace torchpar::python

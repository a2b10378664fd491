// Each layer binds its own Python API in a file of csrc/python/ with
// TORCHPAR_PYBIND(name) { ... }; module.cpp runs them all, in name order, so that
// adding a binding file never touches a shared list.
#pragma once

#include <torch/extension.h>

namespace torchpar::python {

using BindFn = void (*)(pybind11::module_&);

// Registers `fn` to run when torchpar._C is imported.
struct Binding {
  Binding(const char* name, BindFn fn);
};

}  // namespace torchpar::python

#define TORCHPAR_PYBIND(name)                                                \
  static void torchpar_bind_##name(pybind11::module_& m);                    \
  static ::torchpar::python::Binding torchpar_binding_##name(#name,          \
                                                             torchpar_bind_##name); \
  static void torchpar_bind_##name(pybind11::module_& m)

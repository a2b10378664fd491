// Python bindings of the fused kernels' dispatch; the ops themselves are torch operators
// (torch.ops.torchpar.*) registered in csrc/kernels/.
#include "kernels/cpu/kernels.h"
#include "python/bindings.h"

TORCHPAR_PYBIND(kernels) {
  m.def("cpu_kernels_isa", [] { return std::string(torchpar::kernels::cpu::kernels().isa); },
        "Instruction set of the CPU kernels the fused ops run: AVX2, AVX512 or AVX512_BF16.");
  m.def("set_cpu_kernels_isa", &torchpar::kernels::cpu::use_kernels, pybind11::arg("isa"),
        "Run the fused ops' CPU kernels built for `isa` from now on (to compare them).");
  m.def(
      "copy_streaming_",
      [](at::Tensor& dst, const at::Tensor& src) { torchpar::kernels::cpu::kernels().copy_streaming(dst, src); },
      pybind11::arg("dst"), pybind11::arg("src"),
      "dst = src (contiguous float32) with the kernels' non-temporal stores: a copy roofline for "
      "kernels that write that way.");
  m.def("streaming_store_bytes", &torchpar::kernels::cpu::streaming_store_bytes,
        "Outputs of at least this many bytes are written with non-temporal stores.");
  m.def("set_streaming_store_bytes", &torchpar::kernels::cpu::set_streaming_store_bytes,
        pybind11::arg("bytes"),
        "Set that threshold (0: every output streams; a negative value: the default, half the "
        "last-level cache).");
}

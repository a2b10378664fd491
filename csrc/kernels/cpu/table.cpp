// This instruction set's table of CPU kernels (see kernels.h).
#include "kernels/cpu/kernels.h"

namespace torchpar::kernels::cpu::CPU_CAPABILITY {

#define TORCHPAR_STR(x) #x
#define TORCHPAR_XSTR(x) TORCHPAR_STR(x)

extern const CpuKernels kKernels{
    TORCHPAR_XSTR(CPU_CAPABILITY), &layer_norm_fwd,       &layer_norm_bwd,      &bias_gelu,
    &bias_gelu_bwd,                &bias_dropout_add_fwd, &bias_dropout_add_bwd,
    &copy_streaming,
};

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY

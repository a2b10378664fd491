"""Builds torchpar._C: one extension holding every C++ layer (see DESIGN.md).

CPU build by default. TORCHPAR_CUDA=1 adds the csrc/**/cuda/*.cu sources and NCCL,
compiled against a CUDA build of torch (`make build-cuda`).
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
WITH_CUDA = os.environ.get("TORCHPAR_CUDA", "0") == "1"


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def cpu_flags():
    # at::vec picks its vector width from CPU_CAPABILITY_* macros, which torch's own
    # build sets per kernel file; we build one AVX2 flavour (every x86-64 server since 2013).
    # -fopenmp: at::parallel_for is a header template over `#pragma omp parallel` in torch's
    # OpenMP builds; without the flag it silently runs on one thread. libgomp.so.1 resolves to
    # the copy torch already loaded, so there is one OpenMP runtime in the process.
    flags = ["-O3", "-std=c++20", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas", "-fopenmp"]
    if os.uname().machine == "x86_64":
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


cpp_sources = sources("csrc/**/*.cpp")
extra = {"cxx": cpu_flags()}
define_macros = []
libraries = ["rt"]
if WITH_CUDA:
    cu_sources = sources("csrc/**/*.cu")
    extra["nvcc"] = ["-O3", "--use_fast_math", "-DTORCHPAR_WITH_CUDA"]
    extra["cxx"].append("-DTORCHPAR_WITH_CUDA")
    libraries.append("nccl")
    ext = cpp_extension.CUDAExtension(
        "torchpar._C",
        cpp_sources + cu_sources,
        include_dirs=[os.path.join(ROOT, "csrc")] + [p for p in os.environ.get("NCCL_INCLUDE", "").split(":") if p],
        library_dirs=[p for p in os.environ.get("NCCL_LIB", "").split(":") if p],
        libraries=libraries,
        extra_link_args=["-fopenmp"],
        extra_compile_args=extra,
        define_macros=define_macros,
    )
else:
    ext = cpp_extension.CppExtension(
        "torchpar._C",
        cpp_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        libraries=libraries,
        extra_link_args=["-fopenmp"],
        extra_compile_args=extra,
        define_macros=define_macros,
    )

setup(
    name="torchpar",
    packages=find_packages(include=["torchpar", "torchpar.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)

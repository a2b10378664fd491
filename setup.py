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
    # -fopenmp: at::parallel_for is a header template over `#pragma omp parallel` in torch's
    # OpenMP builds; without the flag it silently runs on one thread. libgomp.so.1 resolves to
    # the copy torch already loaded, so there is one OpenMP runtime in the process.
    return ["-O3", "-std=c++20", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas", "-fopenmp"]


# at::vec picks its vector width from CPU_CAPABILITY_* macros, which torch's own build sets
# per kernel file. The extension's baseline is AVX2 (every x86-64 server since 2013);
# csrc/kernels/cpu/ is also built once per wider instruction set, each copy in its own
# namespace, and picked at run time (csrc/kernels/cpu/kernels.h).
def isa_flags(isa):
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    avx512 = avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                     "-Wno-uninitialized"]  # GCC 12: false positives in avx512fintrin.h
    march = {"AVX2": avx2, "AVX512": avx512,
             "AVX512_BF16": avx512 + ["-mavx512bf16"], "DEFAULT": []}[isa]
    vec = "AVX512" if isa.startswith("AVX512") else isa  # at::vec's width
    return march + [f"-DCPU_CAPABILITY_{vec}", f"-DCPU_CAPABILITY={isa}"]


X86 = os.uname().machine == "x86_64"
BASE_ISA = "AVX2" if X86 else "DEFAULT"
KERNEL_ISAS = ["AVX2", "AVX512", "AVX512_BF16"] if X86 else ["DEFAULT"]
KERNEL_SOURCES = sources("csrc/kernels/cpu/*.cpp")


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, plus csrc/kernels/cpu/ compiled once per KERNEL_ISAS entry."""

    def build_extension(self, ext):
        objects = []
        for isa in KERNEL_ISAS:  # the baseline first: the linker keeps the first copy of an inline function
            args = dict(ext.extra_compile_args)
            base = [f for f in args["cxx"] if f not in isa_flags(BASE_ISA)]
            args["cxx"] = base + isa_flags(isa) + ["-DTORCHPAR_KERNEL_ISA"]
            objects += self.compiler.compile(
                KERNEL_SOURCES, output_dir=os.path.join(self.build_temp, "isa-" + isa),
                macros=ext.define_macros, include_dirs=ext.include_dirs, extra_postargs=args,
                depends=ext.depends)
        ext.extra_objects = objects
        super().build_extension(ext)


def unity_source(paths, name):
    """One translation unit that includes ``paths`` (written under build/unity/ only when its text
    changes, so that an unchanged build stays up to date)."""
    path = os.path.join(ROOT, "build", "unity", name)
    text = "".join(f'#include "{os.path.relpath(p, "csrc")}"\n' for p in paths)
    if not os.path.isfile(path) or open(path).read() != text:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return os.path.relpath(path, ROOT)


# csrc/python/: the Python bindings, a few dozen lines per layer, but each file pulls in
# pybind11 and torch's Python headers (~50 s apiece on 2 cores, a third of the build). They
# compile as one unit, generated here (a new binding file still touches no list), in about the
# time of one. csrc/**/nccl/: the backend's CUDA half (NCCL), built with CUDA only.
BINDING_SOURCES = sources("csrc/python/*.cpp")
NCCL_SOURCES = sources("csrc/**/nccl/*.cpp")
cpp_sources = [s for s in sources("csrc/**/*.cpp") if s not in KERNEL_SOURCES + NCCL_SOURCES + BINDING_SOURCES]
cpp_sources.append(unity_source(BINDING_SOURCES, "python_bindings.cpp"))
extra = {"cxx": cpu_flags() + isa_flags(BASE_ISA)}
define_macros = [("TORCHPAR_KERNELS_X86", None)] if X86 else []
# libcrypto (OpenSSL) for HMAC-SHA256 in the TCP handshake (csrc/transport/tcp/handshake.h);
# the Makefile installs Debian's libssl-dev where its headers are missing.
libraries = ["rt", "crypto"]
common = dict(
    include_dirs=[os.path.join(ROOT, "csrc")],
    depends=KERNEL_SOURCES + BINDING_SOURCES + sources("csrc/**/*.h"),
    libraries=libraries,
    extra_link_args=["-fopenmp"],
    extra_compile_args=extra,
    define_macros=define_macros,
)
if WITH_CUDA:
    # -std=c++20: the .cu files use the .cpp files' standard (torch hands nvcc C++17 unless told).
    extra["nvcc"] = ["-O3", "--use_fast_math", "-std=c++20", "-DTORCHPAR_WITH_CUDA"]
    extra["cxx"].append("-DTORCHPAR_WITH_CUDA")
    libraries.append("nccl")
    common["include_dirs"] += [p for p in os.environ.get("NCCL_INCLUDE", "").split(":") if p]
    ext = cpp_extension.CUDAExtension(
        "torchpar._C", cpp_sources + NCCL_SOURCES + sources("csrc/**/*.cu"),
        library_dirs=[p for p in os.environ.get("NCCL_LIB", "").split(":") if p], **common)
else:
    ext = cpp_extension.CppExtension("torchpar._C", cpp_sources, **common)

setup(
    name="torchpar",
    packages=find_packages(include=["torchpar", "torchpar.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

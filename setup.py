"""Build nanscan's C++ (CPU) and C++/CUDA kernels into ``nanscan/_C*.so``.

CUDA kernels are compiled whenever torch is a CUDA build and nvcc is found -- a visible GPU is not
needed (CI compiles them on a GPU-less machine). ``NANSCAN_CUDA=0`` skips them; ``NANSCAN_CUDA=1``
makes their absence a build error. ``TORCH_CUDA_ARCH_LIST`` is honoured (default below).
``NANSCAN_CPU_AVX2=0`` builds the portable (non-AVX2) CPU kernels on x86-64.

The build writes ``nanscan/_build_info.json`` (what was compiled, for which archs, against which
torch, from which sources); ``nanscan`` reads it to refuse a stale library loudly.
"""
import glob
import importlib.util
import json
import os
import platform
import shutil
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0+PTX"  # A100, H100/H200, and PTX so newer GPUs can JIT


def find_cuda_home():
    """CUDA_HOME / CUDA_PATH if set, else the toolkit behind ``nvcc`` on PATH.

    torch guesses ``dirname(dirname(which nvcc))``, which is wrong when ``nvcc`` on PATH is a
    wrapper script (``/usr/local/bin/nvcc`` here); so look for the directory that really holds
    ``include/cuda_runtime.h`` beside ``bin/nvcc``.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in candidates:
        if os.path.exists(os.path.join(root, "bin", "nvcc")) and os.path.exists(
                os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


cuda_home = find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # must be set before torch.utils.cpp_extension is imported

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

SOURCES_CPU = ["csrc/nanscan.cpp", "csrc/refusals.cpp", "csrc/cpu/summarize.cpp", "csrc/monitor/module.cpp",
               "csrc/monitor/stamp_rows.cpp"]
SOURCES_CUDA = ["csrc/cuda/summarize.cu",  # #includes csrc/cuda/reduce.cuh and csrc/cuda/kernels.cuh
                "csrc/cuda/stamp_rows.cu"]
# Every header under csrc/. With ninja (the default) torch forces the build and ninja follows the
# compilers' own header dependencies; without it, setuptools skips the extension unless a file of
# sources + depends is newer than the library, so a header-only edit needs them listed here.
HEADERS = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", "*"), recursive=True)
                 if p.endswith((".h", ".cuh")))


def source_hash():
    """Hash of every C++/CUDA source and header (nanscan/_build.py, loaded by path: the package
    itself cannot be imported before it is built)."""
    spec = importlib.util.spec_from_file_location("_nanscan_build", os.path.join(HERE, "nanscan", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash(HERE)


def want_cuda():
    flag = os.environ.get("NANSCAN_CUDA", "").strip()
    possible = bool(torch.version.cuda) and cuda_home is not None
    why_not = ("torch is a CPU-only build" if not torch.version.cuda else
               "nvcc / the CUDA toolkit was not found (set CUDA_HOME)")
    if flag == "0":
        print("nanscan: NANSCAN_CUDA=0, building CPU kernels only")
        return False
    if flag == "1" and not possible:
        sys.exit(f"nanscan: NANSCAN_CUDA=1 but the CUDA kernels cannot be built: {why_not}")
    if flag not in ("", "0", "1"):
        sys.exit(f"nanscan: NANSCAN_CUDA must be 0, 1 or unset, got {flag!r}")
    if not possible:
        print(f"nanscan: building CPU kernels only: {why_not}")
    return possible


def cpu_flags():
    """Compiler flags of the CPU kernels: the widest x86 vector ISA the build machine has.

    An extension compiles once, for the machine it is built on (ATen compiles its own kernels once per
    capability and picks at run time), so the build takes what this machine's /proc/cpuinfo lists:
    AVX-512 (F, BW, VL, DQ: what ATen's AVX512 kernels need), else AVX2 + FMA + F16C, else at::vec's
    portable code. The library is then for machines with that ISA -- as torch's own AVX512 kernels run
    where torch finds it. NANSCAN_CPU_AVX512=0 stops at AVX2; NANSCAN_CPU_AVX2=0 uses neither.
    Wider lanes change how the FP32 sums are split across lanes, so their last bits may differ between
    an AVX2 and an AVX-512 build (never between runs or thread counts of one build).
    """
    flags = ["-O3", "-fopenmp", "-Wno-unknown-pragmas"]  # the C++ standard is left to torch (C++20 for torch >= 2.12)
    if platform.machine() in ("x86_64", "AMD64") and os.environ.get("NANSCAN_CPU_AVX2", "1") != "0":
        try:
            with open("/proc/cpuinfo") as f:
                cpu_features = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            cpu_features = []
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}
        if avx512 <= set(cpu_features) and os.environ.get("NANSCAN_CPU_AVX512", "1") != "0":
            # at::vec picks its 512-bit implementation from this macro.
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                      "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
        elif {"avx2", "fma", "f16c"} <= set(cpu_features):
            # at::vec picks its 256-bit implementation from this macro.
            flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


class Build(BuildExtension):
    def run(self):
        super().run()
        info = {
            "torch": torch.__version__,
            "cuda_compiled": self.distribution.nanscan_cuda,
            "cuda_version": torch.version.cuda if self.distribution.nanscan_cuda else None,
            "cuda_archs": os.environ.get("TORCH_CUDA_ARCH_LIST") if self.distribution.nanscan_cuda else None,
            "cpu_flags": cpu_flags(),
            "source_hash": source_hash(),
        }
        for target in {os.path.join(HERE, "nanscan"), os.path.join(self.build_lib, "nanscan")}:
            if os.path.isdir(target):
                with open(os.path.join(target, "_build_info.json"), "w") as f:
                    json.dump(info, f, indent=1)
        cuda = f" and CUDA kernels for {info['cuda_archs']}" if info["cuda_compiled"] else ""
        print(f"nanscan: built CPU kernels{cuda}")


use_cuda = want_cuda()
if use_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    ext = CUDAExtension(
        "nanscan._C", SOURCES_CPU + SOURCES_CUDA, depends=HEADERS,
        extra_compile_args={"cxx": cpu_flags(), "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        extra_link_args=["-fopenmp"],
    )
else:
    ext = CppExtension("nanscan._C", SOURCES_CPU, depends=HEADERS, extra_compile_args=cpu_flags(),
                       extra_link_args=["-fopenmp"])

# ninja compiles the sources in parallel (MAX_JOBS of them) where it is installed; torch's BuildExtension
# falls back to one compile after another where it is not. torch looks for it on PATH: a venv's ninja
# (`pip install ninja`, as the Makefile does) is beside this interpreter, on PATH only when the venv is
# activated, so its directory goes first.
_bin = os.path.dirname(sys.executable)
if os.path.exists(os.path.join(_bin, "ninja")):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")
dist_kwargs = dict(ext_modules=[ext], cmdclass={"build_ext": Build.with_options(use_ninja=True)})
from setuptools.dist import Distribution  # noqa: E402

Distribution.nanscan_cuda = use_cuda
setup(**dist_kwargs)

"""Instruction mix of the Triton stage-1 kernel, compiled ahead of time (no GPU needed).

Compiles ``nanscan.kernels.triton_kernels._stage1_kernel`` for a CUDA target (default sm_90, the
H100 / H200) with the launch configuration the launcher (``nanscan.kernels.triton``) uses for each
input dtype (single tensor, 16-byte aligned data pointer), then reads the cubin with the
``cuobjdump`` that ships with Triton and prints, per dtype: registers per thread, the SASS
instructions of the fast full-tile loop (the kernel's first loop), the elements and bytes each
thread loads per iteration and with which load instructions, instructions per element, resident
programs per SM on sm_90 (from the registers and shared memory), and for a 16M-element tensor its
chunk count, waves on a 132-SM H200 and how full the last wave is (programs per SM); ``-v`` adds
every loop of the kernel and an opcode histogram of the first.

    .venv/bin/python -m benchmarks.triton_isa                 # the working tree's kernel
    .venv/bin/python -m benchmarks.triton_isa --rev 8e80e4b   # the kernel at a git revision
    .venv/bin/python -m benchmarks.triton_isa --file K.py     # a copy of triton_kernels.py (or of an
                                                              # older triton.py that held everything)
    .venv/bin/python -m benchmarks.triton_isa --check         # + compile every launcher variant

These are static counts (what a thread executes per element on the clean fast path), not timings.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be real JITFunctions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_ELEM = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}
DTYPES = ["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "int32", "bool"]


KERNELS_PATH = "nanscan/kernels/triton_kernels.py"  # the kernels and their constants
LAUNCHER_PATH = "nanscan/kernels/triton.py"  # the launcher; before the split, kernels and launcher
KERNELS_MODULE = "nanscan.kernels.triton_kernels"


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout


def _exec_source(src: str, name: str, kernels=None):
    """A module executed from src, written to a file first (@triton.jit reads the source back from
    it). With kernels, src's imports from nanscan.kernels.triton_kernels get that module."""
    path = os.path.join(tempfile.mkdtemp(prefix="nanscan_isa_"), name + ".py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    saved = sys.modules.get(KERNELS_MODULE)
    if kernels is not None:
        sys.modules[KERNELS_MODULE] = kernels
    try:
        spec.loader.exec_module(mod)
    finally:
        if kernels is not None:
            if saved is None:
                sys.modules.pop(KERNELS_MODULE, None)
            else:
                sys.modules[KERNELS_MODULE] = saved
    return mod


def load_modules(rev: str | None, file: str | None = None):
    """(kernels, launcher): the modules with the kernels and their constants, and with the launch
    configuration (_block_for, _stage1_options, _iters_for). Working tree by default; at a git
    revision, triton_kernels.py and that revision's launcher, or for revisions from before the split
    the one triton.py that held both; with file, a copy of triton_kernels.py (with the working
    tree's launcher) or of such an older triton.py."""
    if rev is None and file is None:
        from nanscan.kernels import triton as launcher
        from nanscan.kernels import triton_kernels as kernels
        return kernels, launcher
    launcher_src = None
    if file is not None:
        with open(file) as f:
            src = f.read()
    else:
        try:
            src = _git_show(rev, KERNELS_PATH)
            launcher_src = _git_show(rev, LAUNCHER_PATH)
        except subprocess.CalledProcessError:  # before the split: everything in triton.py
            src = _git_show(rev, LAUNCHER_PATH)
    kernels = _exec_source(src, "triton_kernels_at_rev")
    if hasattr(kernels, "summarize"):  # a triton.py from before the split: kernels and launcher
        return kernels, kernels
    if launcher_src is None:
        with open(importlib.util.find_spec("nanscan.kernels.triton").origin) as f:
            launcher_src = f.read()
    return kernels, _exec_source(launcher_src, "triton_launcher_at_rev", kernels)


def block_for(kernels, launcher, kind: int, itemsize: int) -> int:
    """The launcher's tile size (revisions before _block_for: _BLOCK_BY_ITEMSIZE)."""
    if hasattr(launcher, "_block_for"):
        return launcher._block_for(kind, itemsize)
    return kernels._BLOCK_BY_ITEMSIZE[itemsize]


def compile_stage1(kernels, launcher, dtype: torch.dtype, arch: int, multi: bool = False, aligned: bool = False):
    """The stage-1 kernel as the launcher would compile it for dtype: single tensor (x_ptr 16-byte
    aligned), or multi-tensor (pointers from the table; aligned: the group's ALIGNED flag)."""
    kind, acc64, view_as = kernels._DTYPE_INFO[dtype]
    read = view_as or dtype
    fn = kernels._stage1_kernel
    const = {"KIND": kind, "ACC64": acc64, "CODE": kernels._PTR_CODE[read], "MULTI": multi, "ALIGNED": aligned,
             "BLOCK": block_for(kernels, launcher, kind, read.itemsize)}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name == "x_ptr":
            sig[name] = "*i64" if multi else "*" + _ELEM[read]
        elif name == "part_f":
            sig[name] = "*fp64"
        elif name in ("meta", "part_i") or name.endswith("_tab"):
            sig[name] = "*i64"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the launcher's fresh / aligned tensors get
    options = (launcher._stage1_options(kind, read.itemsize) if hasattr(launcher, "_stage1_options")
               else {"num_warps": kernels._NUM_WARPS})
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                            options=dict(options))
    return kernel, const["BLOCK"], read.itemsize


# sm_90 (H100 / H200) limits per SM: 64K 32-bit registers allocated per warp in units of 256, at
# most 64 warps and 32 thread blocks, 228 KiB of shared memory (1 KiB of it reserved per block).
def programs_per_sm(regs: int, num_warps: int, shared: int) -> int:
    """Resident 4-warp programs per SM on sm_90 for a kernel of `regs` registers per thread
    (CUDA's occupancy rules; what the hardware schedules, independent of the grid)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (65536 // per_warp) // num_warps
    by_warps = 64 // num_warps
    by_smem = (228 * 1024) // (shared + 1024)
    return min(by_regs, by_warps, by_smem, 32)


def waves(kernels, launcher, dtype: torch.dtype, numel: int, per_sm: int, sms: int = 132):
    """(chunks, waves, programs per SM in the last wave) of a single-tensor launch of numel
    elements of dtype with per_sm resident programs per SM."""
    kind, _, view_as = kernels._DTYPE_INFO[dtype]
    block = block_for(kernels, launcher, kind, (view_as or dtype).itemsize)
    chunks = -(-numel // (block * launcher._iters_for(-(-numel // block))))
    resident = per_sm * sms
    last = chunks - (-(-chunks // resident) - 1) * resident
    return chunks, chunks / resident, last / sms


def compile_stage2(kernels, arch: int, multi: bool):
    fn = kernels._stage2_kernel
    const = {"MULTI": multi, "BLOCK2": kernels._STAGE2_BLOCK}
    sig = {name: "constexpr" if name in const else "*fp64" if name in ("part_f", "out")
           else "*i64" if name in ("part_i", "meta") or name.endswith("_tab") else "i32" for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": kernels._NUM_WARPS})


def check_all(kernels, launcher, arch: int) -> int:
    """Compile every kernel variant the launchers can produce (so a GPU run cannot be the first to
    find a compile error); returns the number of variants."""
    count = 0
    for dtype in kernels._DTYPE_INFO:
        for multi, aligned in ((False, False), (True, False), (True, True)):
            compile_stage1(kernels, launcher, dtype, arch, multi, aligned)
            count += 1
    for multi in (False, True):
        compile_stage2(kernels, arch, multi)
        count += 1
    return count


def cuobjdump(args, cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], check=True, capture_output=True, text=True).stdout


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_loops(sass: str):
    """[(start, end, [opcodes])] for every backward branch, in address order."""
    instrs = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in map(_LINE.search, sass.splitlines()) if m]
    loops = []
    for addr, op, rest in instrs:
        if op == "BRA":
            target = re.search(r"0x([0-9a-f]+)", rest)
            if target and int(target.group(1), 16) < addr:
                lo = int(target.group(1), 16)
                loops.append((lo, addr, [o for a, o, _ in instrs if lo <= a <= addr]))
    return sorted(loops)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="git revision of the kernels (triton_kernels.py, or triton.py before the "
                    "split) and the launcher (default: working tree)")
    ap.add_argument("--file", help="a copy of nanscan/kernels/triton_kernels.py (or of a triton.py from "
                    "before the split) to compile instead")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--check", action="store_true", help="also compile every launcher variant (slow)")
    ap.add_argument("dtypes", nargs="*", default=DTYPES)
    args = ap.parse_args(argv)
    kernels, launcher = load_modules(args.rev, args.file)
    print(f"triton {triton.__version__}, sm_{args.arch}, {kernels._NUM_WARPS} warps, "
          f"kernel from {args.file or args.rev or 'working tree'}")
    print(f"{'dtype':<14}{'regs':>5}{'loop instr':>11}{'elem/thr':>9}{'B/thr':>6}  {'loads':<16}{'instr/elem':>10}"
          f"{'prog/SM':>8}  16M elements on 132 SMs: chunks, waves, programs/SM in the last wave")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        kernel, block, itemsize = compile_stage1(kernels, launcher, dtype, args.arch)
        cubin = kernel.asm["cubin"]
        regs = re.search(r"REG:(\d+)", cuobjdump(["-res-usage"], cubin)).group(1)
        per_sm = programs_per_sm(int(regs), kernels._NUM_WARPS, kernel.metadata.shared)
        chunks, w, last = waves(kernels, launcher, dtype, 16 * 2**20, per_sm)
        loops = sass_loops(cuobjdump(["-sass"], cubin))
        # the first loop is the unmasked full-tile loop (the fast path) in every version so far
        ops = loops[0][2]
        per_thread = block // (kernels._NUM_WARPS * 32)
        ldg = collections.Counter(o for o in ops if o.startswith("LDG"))
        loads = " ".join(f"{v}x{k}" for k, v in ldg.items())
        print(f"{name:<14}{regs:>5}{len(ops):>11}{per_thread:>9}{per_thread * itemsize:>6}  {loads:<16}"
              f"{len(ops) / per_thread:>10.2f}{per_sm:>8}  {chunks}, {w:.2f}, {last:.1f}")
        if args.verbose:
            for lo, hi, lops in loops:
                n_ldg = sum(1 for o in lops if o.startswith("LDG"))
                print(f"    loop {lo:#06x}-{hi:#06x}: {len(lops)} instructions, {n_ldg} loads")
            hist = collections.Counter(o.split(".")[0] for o in ops)
            print("    fast loop opcodes:", ", ".join(f"{k} {v}" for k, v in hist.most_common()))
    if args.check:
        count = check_all(kernels, launcher, args.arch)
        print(f"compiled all {count} launcher variants of stage 1 and stage 2 for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

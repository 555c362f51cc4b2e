"""`python -m nanscan info` and `demo` run as a user runs them."""
import json
import subprocess
import sys

import nanscan
from nanscan import _ops


def run(*args):
    return subprocess.run([sys.executable, "-m", "nanscan", *args], capture_output=True, text=True, timeout=300)


def test_info_json_tells_backends_and_cuda_build():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["backends"] == nanscan.available_backends()
    assert data["cuda_kernels_compiled"] == data["cuda_kernels_registered"] == _ops.has_cuda_kernels()
    assert data["library_error"] is None and data["torch"]


def test_demo_prints_a_row_per_example_and_backend():
    out = run("demo")
    assert out.returncode == 0, out.stderr
    assert "sumsq overflowed (inputs finite)" in out.stdout
    assert out.stdout.count("empty ") >= 2  # the empty tensor on cpu and on reference

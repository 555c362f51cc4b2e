"""`python -m nanscan info` and `demo` run as a user runs them."""
import json
import re
import subprocess
import sys

import pytest

import nanscan
from nanscan import _ops, report


def run(*args):
    return subprocess.run([sys.executable, "-m", "nanscan", *args], capture_output=True, text=True, timeout=600)


def test_info_json_tells_backends_and_cuda_build():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["backends"] == nanscan.available_backends()
    assert data["cuda_kernels_compiled"] == data["cuda_kernels_registered"] == _ops.has_cuda_kernels()
    assert data["library_error"] is None and data["torch"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One `nanscan demo DIR` (about a minute), shared by the tests that read its output or rerun it."""
    tmp_path = tmp_path_factory.mktemp("demo")
    return tmp_path, run("demo", str(tmp_path))


def test_demo_walks_through_the_incident(demo_run):
    tmp_path, out = demo_run
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sumsq overflowed (inputs finite)" in out.stdout
    assert out.stdout.count("empty ") >= 2  # the empty tensor on cpu and on reference
    assert "INCIDENT  step 14, phase forward, module 'embed' (activation), produced there" in out.stdout
    assert "first non-finite op aten.addmm.default in forward, module embed" in out.stdout
    # replay names the line of the demo's model (its user code), not a frame inside nanscan
    assert re.search(r"module embed, at \S*nanscan[/\\]demo_model\.py:\d+ in forward; inputs finite", out.stdout)
    assert "replay (precision=fp32, backend=eager): did not reproduce" in out.stdout
    assert (tmp_path / "bundles" / "step000014-rank0" / "manifest.json").exists()
    report = run("report", str(tmp_path / "events.jsonl"), "-o", str(tmp_path / "r.png"))
    assert report.returncode == 0 and "step 14" in report.stdout
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # part 3: the drifting fp16 activation is warned about 20+ steps before its first Inf
    warned = re.search(r"WARNING   nanscan: blocks\.1\.fc \(activation, forward, float16\) is [\d.]+ bits from overflow "
                       r"at step (\d+) .*overflows near step (\d+) at this rate", out.stdout)
    overflow = re.search(r"INCIDENT  non-finite output of module 'blocks\.1\.fc' at step (\d+), phase forward", out.stdout)
    assert warned and overflow, out.stdout
    (warn_step, predicted), actual = map(int, warned.groups()), int(overflow.group(1))
    assert actual - warn_step >= 20 and abs(predicted - actual) <= 0.25 * (actual - warn_step)
    assert "headroom warnings (" in out.stdout and (tmp_path / "headroom.png").exists()


def test_demo_twice_into_the_same_directory(demo_run):
    # The second run's incident (same step, same rank) used to find its bundle name taken: the
    # bundle was dropped with a warning and the demo died on bundle_path None (a TypeError).
    tmp_path, first = demo_run
    first_bundle = tmp_path / "bundles" / "step000014-rank0"
    assert first.returncode == 0 and first_bundle.is_dir(), first.stdout + first.stderr
    manifest = (first_bundle / "manifest.json").read_bytes()
    out = run("demo", str(tmp_path))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert f"bundle    {first_bundle}-1\n" in out.stdout and "could not write the bundle" not in out.stderr
    assert (first_bundle / "manifest.json").read_bytes() == manifest  # the first run's bundle is untouched
    assert nanscan.load_bundle(f"{first_bundle}-1").manifest["step"] == 14
    # and logs of its own: the first run's log is untouched, the second's report is of one run
    second = report.summarize_run(str(tmp_path / "events-2.jsonl"))
    assert not [n for n in second["notes"] if "more than once" in n], second["notes"]
    assert (tmp_path / "headroom-2.jsonl").exists() and (tmp_path / "headroom-2.png").exists()


def test_cli_errors_are_one_line_not_a_traceback(tmp_path):
    for args, expected in [(("show", str(tmp_path)), "is not a nanscan bundle"),
                           (("report", str(tmp_path / "missing.jsonl")), "does not exist")]:
        out = run(*args)
        assert out.returncode == 2 and expected in out.stderr and "Traceback" not in out.stderr

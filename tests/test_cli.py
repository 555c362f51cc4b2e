"""`python -m nanscan info` and `demo` run as a user runs them; the exit codes and one-line errors
of every command."""
import json
import os
import re
import subprocess
import sys

import pytest

import nanscan
from nanscan import _ops, cli, report
from tests.test_report import DROP, plain_log, write_log


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
    assert report.returncode == 1 and "step 14" in report.stdout  # (1: a finding, the incident)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # part 3: the drifting fp16 activation is warned about 20+ steps before its first Inf
    warned = re.search(r"WARNING   nanscan: blocks\.1\.fc \(activation, forward, float16\) is [\d.]+ bits "
                       r"from overflow at step (\d+) .*overflows near step (\d+) at this rate", out.stdout)
    overflow = re.search(r"INCIDENT  non-finite output of module 'blocks\.1\.fc' at step (\d+), phase forward",
                         out.stdout)
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


# ---------------------------------------------------------------------------- exit codes, one-line errors


def one_line_error(capsys, argv, code=2):
    """Run the CLI in this process; its stderr must be exactly one line, "nanscan: error: ...",
    and the exit status ``code``. Returns that line."""
    capsys.readouterr()
    try:
        status = cli.main(argv)
    except SystemExit as e:  # (argparse's own errors)
        status = e.code
    err = capsys.readouterr().err
    assert status == code, (status, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_report_outputs_that_cannot_be_written_are_one_line(tmp_path, capsys):
    """`--html <file>/x.html` ended in a FileExistsError traceback."""
    log = plain_log(tmp_path / "events.jsonl")
    err = one_line_error(capsys, ["report", log, "--html", f"{log}/x.html"])
    assert err == f"nanscan: error: --html {log}/x.html: {log} is a file, not a directory\n"
    err = one_line_error(capsys, ["report", log, "-o", f"{log}/deeper/x.png"])
    assert err == f"nanscan: error: -o {log}/deeper/x.png: {log} is a file, not a directory\n"
    err = one_line_error(capsys, ["report", log, "-o", str(tmp_path)])
    assert err == f"nanscan: error: -o {tmp_path} is a directory: give a file name (such as {tmp_path}/timeline.png)\n"
    err = one_line_error(capsys, ["report", log, "-o", log])  # would have overwritten the log with a PNG
    assert err == f"nanscan: error: -o {log} is the log being reported: it would be overwritten\n"
    assert open(log).read().startswith('{"type": "header"')
    # nothing was written, not even the text report: the error comes before the work
    assert capsys.readouterr().out == ""


def test_demo_into_a_file_is_one_line(tmp_path, capsys):
    """`nanscan demo <a file>` ended in a NotADirectoryError traceback, after a minute of demo."""
    path = tmp_path / "notes.txt"
    path.write_text("x")
    err = one_line_error(capsys, ["demo", str(path)])
    assert err == (f"nanscan: error: demo: {path} is a file, not a directory: give a directory (made if missing) "
                   "for the demo's log, bundles and plots\n")
    err = one_line_error(capsys, ["demo", str(path / "sub")])
    assert err.startswith(f"nanscan: error: demo: cannot make the directory {path / 'sub'}: ")


def test_report_of_what_is_not_a_log_is_one_line(tmp_path, capsys):
    """/dev/null and a FIFO were "does not exist"; a file that is not a log exited 0; valid JSON
    was "not valid JSON"."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    array = tmp_path / "array.json"
    array.write_text("[1,2]\n")
    readme = tmp_path / "README.md"
    readme.write_text("# a project\n\nwords\n")
    for path, expected in [("/dev/null", "/dev/null is a character device, not a file: give a JSONL event log"),
                           (str(fifo), f"{fifo} is a named pipe (FIFO), not a file"),
                           (str(array), f"{array} is not a nanscan event log: line 1 is valid JSON but not an event "
                                        "(an array, not an object)"),
                           (str(readme), f"{readme} is not a nanscan event log: line 1 is not valid JSON"),
                           (str(tmp_path / "missing.jsonl"), f"{tmp_path / 'missing.jsonl'} does not exist")]:
        err = one_line_error(capsys, ["report", path])
        assert err.startswith(f"nanscan: error: {expected}"), err


def test_report_exit_status_is_its_verdict(tmp_path, capsys):
    """0 only for an all-clear the log backs; 1 for a finding; 3 when nothing could be checked."""
    failing = write_log(tmp_path / "failing.jsonl")
    assert cli.main(["report", failing]) == 1
    assert "first anomaly not handled by the scaler: step 20" in capsys.readouterr().out
    assert cli.main(["report", plain_log(tmp_path / "clean.jsonl")]) == 0
    assert "no anomalous step in what was logged:" in capsys.readouterr().out
    bare = plain_log(tmp_path / "bare.jsonl", loss=None, grad_norm=None, update=None, nonfinite=DROP)
    assert cli.main(["report", bare]) == 3
    assert "cannot tell whether the run stayed finite" in capsys.readouterr().out


def test_report_writes_png_and_html_from_one_reading(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path / "events.jsonl")
    assert cli.main(["report", log, "-o", str(tmp_path / "out" / "t.png"), "--html", str(tmp_path / "r.html")]) == 1
    out = capsys.readouterr().out
    assert f"timeline: {tmp_path / 'out' / 't.png'}\n" in out and f"html: {tmp_path / 'r.html'}\n" in out
    assert (tmp_path / "out" / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (tmp_path / "r.html").read_text()


def test_replay_and_bisect_argument_errors_are_one_line(tmp_path, capsys):
    import torch

    bundle = nanscan.capture_bundle(str(tmp_path / "b"), model=torch.nn.Linear(4, 2), batch=torch.randn(3, 4))
    log = plain_log(tmp_path / "events.jsonl")
    err = one_line_error(capsys, ["replay", str(tmp_path / "nothing"), "--model", "tests.capture_models:drop_net"])
    assert err == f"nanscan: error: replay: {tmp_path / 'nothing'} does not exist: give a bundle directory\n"
    err = one_line_error(capsys, ["bisect", log, "--model", "tests.capture_models:drop_net"])
    assert err == (f"nanscan: error: bisect: {log} is a file, not a bundle directory "
                   "(nanscan report reads an event log)\n")
    err = one_line_error(capsys, ["replay", bundle, "--model", "tests.capture_models:drop_net", "--backend", "nope"])
    assert err.startswith("nanscan: error: --backend 'nope' is not a torch.compile backend here; known: ")
    assert "inductor" in err and "aot_eager" in err
    err = one_line_error(capsys, ["replay", bundle])  # argparse's error: one line too, exit 2
    assert err == ("nanscan replay: error: the following arguments are required: --model "
                   "(see nanscan replay --help)\n")


def test_replay_with_a_model_that_does_not_fit_the_bundle_is_one_line_exit_2(tmp_path, capsys):
    """A layer added or widened in the factory exited 1 -- "reproduced" -- with load_state_dict's traceback."""
    import torch

    from tests.test_replay import two_layers

    bundle = nanscan.capture_bundle(str(tmp_path / "b"), model=two_layers(), batch=torch.randn(3, 4))
    start = "nanscan: error: --model tests.test_replay:{} does not build the model this bundle was captured from: "
    err = one_line_error(capsys, ["replay", bundle, "--model", "tests.test_replay:a_layer_added"])
    assert err == start.format("a_layer_added") + ("missing keys (in the model, not in the bundle): added.0.weight, "
                                                   "added.0.bias\n")
    err = one_line_error(capsys, ["replay", bundle, "--model", "tests.test_replay:widened"])
    assert err == start.format("widened") + ("shape mismatches: fc1.weight (bundle [8, 4], model [16, 4]), fc1.bias "
                                             "(bundle [8], model [16]), fc2.weight (bundle [2, 8], model [2, 16])\n")
    err = one_line_error(capsys, ["replay", bundle, "--model", "tests.test_replay:three_layers_added"])
    assert err.endswith("added.0.weight, added.0.bias, added.1.weight, added.1.bias and 2 more\n"), err
    assert capsys.readouterr().out == ""  # no replay line: nothing was run


def test_exit_codes_are_documented_once(capsys):
    """One table (cli.EXIT_CODES): the --help epilog prints it, docs/cli.md lists the same codes."""
    assert sorted(cli.EXIT_CODES) == [0, 1, 2, 3]
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    docs = " ".join(open(os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")).read().split())
    for code, meaning in cli.EXIT_CODES.items():
        assert f"{code} {' '.join(meaning.split())}" in help_text
        assert f"| {code} | {' '.join(meaning.split())} |" in docs


def test_report_of_a_bundle_has_a_page_but_no_timeline(tmp_path, capsys):
    from tests.test_report import incident

    bundle = tmp_path / "step000020-rank0"
    bundle.mkdir()
    manifest = {"format": "nanscan-bundle", "version": 1, "step": 20, "state": "before-update", "training": True,
                "incident": incident(20, "forward", "block.act", "activation", False, 3)["incident"],
                "files": {"batch.pt": "0" * 64}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    err = one_line_error(capsys, ["report", str(bundle), "-o", str(tmp_path / "t.png")])
    assert err == (f"nanscan: error: -o: {bundle} is a bundle, which holds one step: there is no timeline to plot "
                   "(give the run's JSONL event log)\n")
    assert cli.main(["report", str(bundle), "--html", str(tmp_path / "b.html")]) == 1  # (its incident: a finding)
    assert "block.act" in (tmp_path / "b.html").read_text() and not (tmp_path / "b.html.png").exists()
    manifest.pop("incident")  # captured on request: the bundle checked nothing
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["report", str(bundle)]) == 3

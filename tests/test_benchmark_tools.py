"""benchmarks/results_table.py: the README's ratio table from pytest-benchmark JSONs, one or several
(gpu_check.sh writes one JSON per benchmark stage)."""
import json
import os
import re

import pytest

from benchmarks import results_table


def bench(group, label, median, baseline=False, bytes_read=None):
    extra = {"label": label, "role": "baseline" if baseline else "candidate"}
    if bytes_read is not None:
        extra["bytes_read"] = bytes_read
    return {"group": group, "name": f"test_{label}", "stats": {"median": median}, "extra_info": extra}


def run(*benchmarks, node="h200-box"):
    return {"machine_info": {"node": node, "python_version": "3.12.3"}, "datetime": "2026-12-01T22:00:00",
            "benchmarks": list(benchmarks)}


def rows(markdown):
    return [line.split(" | ") for line in markdown.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_several_runs_make_one_table_with_each_groups_ratio_from_its_own_run(tmp_path, capsys):
    kernels = run(bench("single fp32", "torch.sum", 0.010, baseline=True, bytes_read=4e9),
                  bench("single fp32", "nanscan.record[cuda]", 0.011, bytes_read=4e9))
    monitor = run(bench("train step", "train step", 0.200, baseline=True),
                  bench("train step", "train step + watch(sync)", 0.202), node="other")
    paths = []
    for name, doc in (("kernels", kernels), ("monitor", monitor)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))

    assert results_table.main([str(p) for p in paths] + ["--title", "H200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## H200\n")
    got = {(r[0].lstrip("| "), r[1]): (r[2], r[3], r[4]) for r in rows(out)}
    assert got == {
        ("single fp32", "torch.sum"): ("10.000", "1.00", "400"),
        ("single fp32", "nanscan.record[cuda]"): ("11.000", "1.10", "364"),
        ("train step", "train step"): ("200.000", "1.00", "-"),
        ("train step", "train step + watch(sync)"): ("202.000", "1.01", "-"),
    }
    assert "date 2026-12-01T22:00:00" in out  # the first run's date and machine


def test_a_group_found_in_two_runs_is_refused_not_mixed():
    first = run(bench("train step", "train step", 0.2, baseline=True))
    second = run(bench("train step", "train step + watch(sync)", 0.1))
    with pytest.raises(ValueError, match="'train step' is in runs 0 and 1"):
        results_table.merged([first, second])


def test_one_run_is_the_table_it_always_was():
    doc = run(bench("g", "base", 0.004, baseline=True), bench("g", "fast", 0.002))
    assert results_table.merged([doc]) == doc
    assert [r[3] for r in rows(results_table.table(doc))] == ["0.50", "1.00"]


def test_a_compiled_step_that_did_not_get_the_cuda_graphs_it_asked_for_says_so_in_its_label():
    # benchmarks/bench_monitor.py times the GPT-2-small step under mode="reduce-overhead"; where
    # inductor skips CUDA graphs (here: CPU tensors) the row must not pass for a CUDA-graph number.
    import torch

    from benchmarks.bench_monitor import warm_up
    from benchmarks.models import GPT

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, layers=1, heads=2, seq=16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 64, (2, 16))
    try:
        note = warm_up(torch.compile(model, mode="reduce-overhead"), opt, idx, "reduce-overhead")
        assert note.startswith(" [CUDA graphs skipped in ") and note.endswith(" graph(s)]"), note
        assert warm_up(torch.compile(model), opt, idx, "default") == ""  # inductor's default asks none
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("part", ["1", "2"])
def test_gpu_check_plan_fits_one_device_command(part):
    # The device tool runs one command for at most 600 s: each part's stage estimates must end before
    # its deadline, and the deadline must leave slack under 600 s for start-up and copying back.
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_check.sh")
    r = subprocess.run(["bash", script, "--part", part, "--plan"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "fits:" in r.stdout, r.stdout + r.stderr
    total = int(re.search(r"estimated total: (\d+) s of (\d+) s", r.stdout).group(1))
    deadline = int(re.search(r"estimated total: (\d+) s of (\d+) s", r.stdout).group(2))
    assert total < deadline <= 560
    bad = subprocess.run(["bash", script, "--part", "3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--part must be 1 or 2" in bad.stderr


@pytest.mark.skipif("cpu" not in __import__("nanscan").available_backends(), reason="the C++ CPU backend is not built")
def test_record_ratio_prints_one_row_of_run_medians_per_subject_dtype_and_thread_count(capsys):
    from benchmarks import record_ratio

    record_ratio.main(["--numel", "4096", "--pairs", "3", "--runs", "2", "--threads", "1,2"])
    table = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
             if line.startswith("| ") and "---" not in line][1:]
    assert [(r[0].strip("| "), r[1], r[2]) for r in table] == [
        (subject, dtype, threads) for dtype in ("float32", "bfloat16") for threads in ("1", "2")
        for subject in ("record", "vector_norm")]
    for row in table:
        medians = [float(cell.strip(" |")) for cell in row[3:]]
        assert len(medians) == 2 and all(m > 0 for m in medians)


def test_record_ratio_times_the_bare_op_and_cold_calls(capsys):
    from benchmarks import record_ratio

    record_ratio.main(["--numel", "4096", "--pairs", "3", "--runs", "1", "--threads", "1",
                       "--dtypes", "float32", "--subjects", "op", "--cold", "3"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line]
    assert [r[0].strip("| ") for r in rows] == ["subject", "op", "call", "torch.sum", "op", "record"]
    for row in rows[3:]:
        cold, warm = (float(cell.strip(" |")) for cell in row[1:])
        assert cold > 0 and warm > 0


def test_record_ratio_neighbour_streams_while_measured_and_is_gone_after(capsys):
    from benchmarks import record_ratio

    with record_ratio.memory_neighbour(True) as proc:
        assert proc.poll() is None  # started (it said so once its arrays were made) and running
    assert proc.poll() is not None
    record_ratio.main(["--numel", "4096", "--pairs", "3", "--runs", "1", "--threads", "1",
                       "--dtypes", "float32", "--subjects", "record", "--neighbour"])
    assert "beside a memory-streaming process" in capsys.readouterr().out


def test_record_ratio_refuses_an_unknown_subject_by_name(capsys):
    from benchmarks import record_ratio

    with pytest.raises(SystemExit):
        record_ratio.main(["--subjects", "record,median"])
    assert "unknown --subjects ['median']" in capsys.readouterr().err


def test_gpu_tests_goes_on_after_a_crash_and_a_hung_test_and_names_them(tmp_path):
    """benchmarks/gpu_tests.py: a test that kills its process (a segfault in a kernel) or hangs past
    the per-test limit is reported by name, and the tests after it in the same file still run."""
    import json
    import subprocess
    import sys

    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_crash.py").write_text(
        "import os, signal, time\n"
        "def test_before():\n    pass\n"
        "def test_segfault():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_hangs():\n    time.sleep(60)\n"
        "def test_fails():\n    assert 1 == 2\n"
        "def test_after():\n    pass\n")
    (tests / "test_fine.py").write_text("import pytest\ndef test_one():\n    pass\n"
                                        "@pytest.mark.skip(reason='x')\ndef test_skipped():\n    pass\n")
    out = tmp_path / "out"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_tests", str(tests / "test_crash.py"),
                        str(tests / "test_fine.py"), "--jobs", "2", "--per-test-timeout", "3", "--deadline", "120",
                        "--out", str(out)], cwd=repo, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads((out / "tests.json").read_text())
    outcomes = {k.rpartition("::")[2]: v for f in report["files"] for k, v in f["outcomes"].items()}
    assert outcomes == {"test_before": "passed", "test_segfault": "crashed", "test_hangs": "timed out",
                        "test_fails": "failed", "test_after": "passed", "test_one": "passed", "test_skipped": "skipped"}
    crash = next(f for f in report["files"] if f["path"].endswith("test_crash.py"))
    assert crash["restarts"] == 2 and crash["status"] == "done"
    md = (out / "tests.md").read_text()
    assert "- crashed: `" in md and "test_segfault`" in md and "- timed out: `" in md and "test_hangs`" in md
    log = (out / "tests.log").read_text()  # (every process's output, in order: three for test_crash.py)
    assert log.count("test_crash.py (start ") == 3 and "FAILED" in log and "test_fails" in log
    assert "Timeout (" in log  # (faulthandler's stacks of the hung test)


def test_gpu_tests_plan_schedules_the_whole_suite_and_says_whether_it_fits(capsys):
    from benchmarks import gpu_tests

    files = gpu_tests.suite_files()
    assert files[0] == os.path.join("tests", "test_cuda.py") and len(files) == len(set(files)) > 30
    assert gpu_tests.main(["--plan", "--jobs", "6", "--deadline", "400"]) == 0
    assert "fits:" in capsys.readouterr().out
    assert gpu_tests.main(["--plan", "--jobs", "1", "--deadline", "100"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    rows, makespan = gpu_tests.schedule(["a", "b", "c"], 2)  # (each estimated at DEFAULT_ESTIMATE)
    d = gpu_tests.DEFAULT_ESTIMATE
    assert [(s, e) for _, s, e in rows] == [(0, d), (0, d), (d, 2 * d)] and makespan == 2 * d


@pytest.mark.parametrize("model", ["gpt", "llama-1b", "host-bound"])
def test_step_profile_counts_each_variants_ops_and_times_them_interleaved(tmp_path, capsys, model):
    from benchmarks import step_profile

    if model == "llama-1b":
        pytest.importorskip("transformers")
    out = tmp_path / "profile.json"
    assert step_profile.main(["--model", model, "--steps", "1", "--warmup", "1", "--rounds", "1",
                              "--json", str(out)]) == 0
    result = json.loads(out.read_text())["models"][model]
    counts, timing = result["counts"], result["timing"]
    assert list(counts) == list(step_profile.VARIANTS) == list(timing)
    assert counts["unwatched"]["nanscan_ops"] == 0  # (no monitor, no record)
    assert all(counts[v]["nanscan_ops"] > 0 for v in step_profile.VARIANTS if v != "unwatched")
    assert timing["unwatched"]["ratio"] == 1.0 and all(timing[v]["wall_ms"] > 0 for v in timing)
    assert all(f"== {v}:" in result["top_host_ops"][v] for v in step_profile.VARIANTS)
    printed = capsys.readouterr().out
    assert "| nanscan_ops |" in result["table"] and result["table"] in printed


def test_step_profile_refuses_an_unknown_model_by_name(capsys):
    from benchmarks import step_profile

    with pytest.raises(ValueError, match="unknown model 'gpt3'.*accepted: gpt, llama-1b, host-bound"):
        step_profile.Workload("gpt3")
    with pytest.raises(SystemExit):
        step_profile.main(["--model", "gpt,gpt3", "--rounds", "0"])
    assert "unknown model 'gpt3'" in capsys.readouterr().err


def test_step_profile_puts_several_models_in_one_json(tmp_path):
    from benchmarks import step_profile

    out = tmp_path / "profile.json"
    assert step_profile.main(["--model", "host-bound,host-bound", "--steps", "1", "--warmup", "1", "--rounds", "0",
                              "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["models"]) == ["host-bound"]
    assert step_profile.main(["--model", "gpt, host-bound", "--steps", "1", "--warmup", "1", "--rounds", "0",
                              "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["models"]) == ["gpt", "host-bound"]


def test_read_cost_prints_each_decisions_parts_and_slope_and_writes_json(tmp_path, capsys):
    from benchmarks import read_cost

    out = tmp_path / "read.json"
    assert read_cost.main(["--layers", "2", "8", "--rounds", "2", "--steps", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for name in read_cost.NAMES.values():
        if not name.startswith("compiled"):
            assert name in text
    assert "distributed.active() as a read begins" in text
    assert "per record" in text
    result = json.loads(out.read_text())
    for n, records in (("2", 14), ("8", 50)):  # (each layer: output, its gradient, weight, bias, 2 grads; + 2)
        for variant in read_cost.VARIANTS:
            r = result["results"][n][variant]
            assert r["records"] == records and r["reads"] == 2 * 3
            assert 0 < r["finishing_us"] < r["whole_us"] and r["python_calls"] > 0
    assert result["results"]["2"]["cuda"]["python_calls"] == result["results"]["8"]["cuda"]["python_calls"]
    for n in ("2", "8"):
        cold = result["results"][n]["cold_call"]
        assert cold["first_call_us"] > 0 and cold["second_call_us"] > 0


def test_launch_counts_prints_what_a_stamp_asks_of_the_host_with_its_kernel_and_as_aten_ops(tmp_path, capsys):
    from benchmarks import launch_counts

    cost = launch_counts.stamp_host_cost("cpu", rounds=1, calls=20)
    # (nanscan::stamp and the stamp_rows_ it calls; the ops: the write's 29 calls besides)
    assert cost["kernel"]["dispatcher calls"] == 2 and cost["ATen ops"]["dispatcher calls"] > 20
    assert all(c["us per stamp"] > 0 for c in cost.values())
    out = tmp_path / "counts.json"
    assert launch_counts.main(["--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kernel      2 dispatcher calls" in printed and "no launches to count" in printed
    assert set(json.loads(out.read_text())["stamp"]) == {"kernel", "ATen ops"}


def test_read_cost_compiled_times_the_read_where_its_rows_lie_against_decoded_whole(tmp_path, capsys):
    from benchmarks import read_cost

    out = tmp_path / "read.json"
    assert read_cost.main(["--layers", "2", "--rounds", "1", "--steps", "3", "--compiled", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "compiled, rows in place" in text and "compiled, decoded whole" in text and "compiled (aot_eager)" in text
    result = json.loads(out.read_text())
    assert result["variants"] == list(read_cost.COMPILED_VARIANTS)
    for variant in read_cost.COMPILED_VARIANTS:
        r = result["results"]["2"][variant]
        assert r["reads"] == 3 and r["whole_us"] > 0 and r["python_calls"] > 0
    # (decoded whole, each written compiled row is made a slot: more Python calls a read)
    assert result["results"]["2"]["compiled"]["python_calls"] < result["results"]["2"]["compiled_whole"]["python_calls"]

"""Benchmark harness: every benchmark belongs to a group with one named baseline; at the end a table
of ratios (median time / baseline median time, measured side by side in this run) is printed and,
with --benchmark-json, stored in the JSON as extra_info["ratio"]."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _rows(config):
    session = getattr(config, "_benchmarksession", None)
    if session is None:
        return []
    groups = {}
    for bench in session.benchmarks:
        groups.setdefault(bench.group, []).append(bench)
    rows = []
    for group, benches in groups.items():
        base = [b for b in benches if b.extra_info.get("role") == "baseline"]
        base_median = base[0].stats.median if base else None
        for b in sorted(benches, key=lambda b: b.stats.median):
            ratio = b.stats.median / base_median if base_median else float("nan")
            b.extra_info["ratio"] = ratio
            rows.append((group, b.extra_info.get("label", b.name), b.stats.median, ratio,
                         base[0].extra_info.get("label") if base else "-"))
    return rows


def pytest_terminal_summary(terminalreporter, config):
    rows = _rows(config)
    if not rows:
        return
    tr = terminalreporter
    tr.section("nanscan ratios (median time / baseline median, same run)")
    tr.write_line(f"machine: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, "
                  f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    tr.write_line(f"{'group':<32} {'candidate':<50} {'median ms':>10} {'ratio':>7}  baseline")
    for group, label, median, ratio, base in rows:
        tr.write_line(f"{group:<32} {label:<50} {median * 1e3:>10.3f} {ratio:>7.2f}  {base}")


@pytest.fixture
def run_bench(benchmark):
    """run_bench(fn, group, label, baseline=False): time fn (synchronizing CUDA inside the timed
    function so the median covers the kernels, not just the launches)."""

    def run(fn, group, label, baseline=False, bytes_read=None):
        benchmark.group = group
        benchmark.extra_info.update(label=label, role="baseline" if baseline else "candidate",
                                    device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        if bytes_read is not None:
            benchmark.extra_info["bytes_read"] = int(bytes_read)
        if torch.cuda.is_available():
            def timed():
                out = fn()
                torch.cuda.synchronize()
                return out
        else:
            timed = fn
        return benchmark(timed)

    return run

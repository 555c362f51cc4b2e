"""The test suite in a way that survives a crash: each test file in its own pytest process, several at
once, under one deadline -- the GPU check's test stages (benchmarks/gpu_check.sh).

A process that dies inside a test (a segmentation fault in a kernel, a test past its time limit)
does not end the run: the test it was in is reported by name, as crashed or timed out, and the file
is started again after it (every test that ended already, and the one that did not, deselected).
What each process did is known from benchmarks/pytest_progress.py, which writes every test's start
and end to a file as they happen. At the deadline the running processes are interrupted and the
files not started are listed as not run.

    python -m benchmarks.gpu_tests [FILES...] [--jobs N] [--per-test-timeout S] [--deadline S]
                                   [--marker EXPR] [--out DIR] [--plan]

FILES default to the whole suite (tests/test_*.py) in the order of ``ORDER``: the files a GPU
tells most about first. ``--out`` gets three files: ``tests.log`` (every process's output, a file's
whole output appended when its process ends), ``tests.md`` (one row per file, then every failed,
crashed and timed-out test by name) and ``tests.json``. Exit status 0 when every test that ran
passed or was skipped, 1 otherwise (2: bad arguments). ``--plan`` prints the schedule the estimates
give (``ESTIMATES``) for ``--jobs`` processes against ``--deadline``, and exits 1 if it does not fit.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The files a GPU tells most about first: the kernels on CUDA tensors, the ops, the compiled path,
# real models, then the monitor and the rest.
ORDER = ["test_cuda.py", "test_summarize.py", "test_ops.py", "test_triton.py", "test_monitor_compiled.py",
         "test_compiled_real_models.py", "test_real_models.py", "test_monitor.py", "test_monitor_loops.py",
         "test_large.py", "test_capture.py", "test_replay.py", "test_skip.py", "test_headroom.py"]

# Seconds per file on the GPU machine, for --plan: upper guesses from the CPU suite (about 15 minutes
# on the 2-core CI machine, most of it the compiled-model files) plus each file's CUDA cases -- not
# yet measured there. The first run's tests.json has every file's seconds: replace these with them.
# A file not listed is estimated at DEFAULT_ESTIMATE.
ESTIMATES = {
    "test_cuda.py": 30, "test_summarize.py": 120, "test_ops.py": 60, "test_triton.py": 60,
    "test_monitor_compiled.py": 240, "test_compiled_real_models.py": 240, "test_real_models.py": 60,
    "test_monitor.py": 60, "test_monitor_loops.py": 90, "test_large.py": 30, "test_capture.py": 60,
    "test_replay.py": 40, "test_skip.py": 30, "test_headroom.py": 20, "test_distributed.py": 90,
    "test_distributed_loops.py": 90, "test_fsdp.py": 90, "test_dtensor.py": 40, "test_tensor_parallel.py": 40,
    "test_telemetry_ranks.py": 40, "test_telemetry_sinks.py": 40, "test_report_html.py": 30,
    "test_integrations.py": 60, "test_lightning.py": 60,
}
DEFAULT_ESTIMATE = 20
MAX_RESTARTS = 20  # per file: a file whose every test crashes stops here


def suite_files() -> list:
    """Every tests/test_*.py, in ORDER first, then by name."""
    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "tests", "test_*.py")))
    first = [f for f in ORDER if f in found]
    return [os.path.join("tests", f) for f in first + [f for f in found if f not in first]]


def estimate(path: str) -> int:
    return ESTIMATES.get(os.path.basename(path), DEFAULT_ESTIMATE)


def schedule(files: list, jobs: int) -> tuple:
    """``(rows, makespan)``: each file's estimated start and end when ``jobs`` processes take the
    files in order, each the next file as soon as one is free."""
    free = [0.0] * max(1, jobs)
    rows = []
    for f in files:
        k = min(range(len(free)), key=free.__getitem__)
        start = free[k]
        free[k] = start + estimate(f)
        rows.append((f, start, free[k]))
    return rows, max(free)


def plan(files: list, jobs: int, deadline: float) -> int:
    rows, makespan = schedule(files, jobs)
    print(f"gpu_tests: {len(files)} files, {jobs} at once, deadline {deadline:.0f} s")
    print(f"{'file':<40} {'estimate':>8} {'starts':>7} {'ends':>6}")
    for f, start, end in rows:
        print(f"{f:<40} {estimate(f):>8d} {start:>7.0f} {end:>6.0f}")
    total = sum(estimate(f) for f in files)
    print(f"estimated: {makespan:.0f} s with {jobs} processes ({total} s one after another)")
    if makespan > deadline:
        print(f"DOES NOT FIT: {makespan:.0f} s > deadline {deadline:.0f} s")
        return 1
    print(f"fits: ends {deadline - makespan:.0f} s before the deadline")
    return 0


class FileRun:
    """One test file: its processes (one, or more after crashes) and what their tests did."""

    def __init__(self, path: str, workdir: str, args):
        self.path, self.args = path, args
        stem = os.path.basename(path).replace(".py", "")
        self.progress = os.path.join(workdir, stem + ".progress")
        self.skip = os.path.join(workdir, stem + ".skip")
        self.log = os.path.join(workdir, stem + ".log")
        self.outcomes: dict = {}  # nodeid -> passed / failed / skipped / crashed / timed out
        self.restarts = 0
        self.proc: Optional[subprocess.Popen] = None
        self.started_at = self.seconds = 0.0
        self.status = "not run"  # then: running, done, interrupted, error
        self.note = ""

    def start(self) -> None:
        env = dict(os.environ, NANSCAN_TEST_PROGRESS=self.progress, NANSCAN_TEST_SKIP=self.skip,
                   NANSCAN_TEST_TIMEOUT=str(self.args.per_test_timeout), PYTHONUNBUFFERED="1")
        # (the files at once share the cores: each its share of threads, not one thread per core each)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, self.args.jobs))))
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
               "-p", "benchmarks.pytest_progress", self.path]
        if self.args.marker:
            cmd += ["-m", self.args.marker]
        if not self.started_at:
            self.started_at = time.time()
        with open(self.log, "a", encoding="utf-8") as log:
            log.write(f"\n===== {' '.join(cmd[1:])} (start {self.restarts + 1})\n")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.log, "a", encoding="utf-8"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.status = "running"

    def _read_progress(self) -> Optional[str]:
        """Record what the progress file says; return the test a process was in when it ended, if any."""
        current = None
        if not os.path.exists(self.progress):
            return None
        with open(self.progress, encoding="utf-8", errors="replace") as f:
            for line in f:
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind == "start":
                    current = rest
                elif kind == "end":
                    outcome, _, nodeid = rest.partition(" ")
                    self.outcomes[nodeid] = outcome
                    if nodeid == current:
                        current = None
        os.remove(self.progress)
        return current

    def finished(self, returncode: int) -> bool:
        """The process ended: True when the file is done, False when it must start again after a crash."""
        dangling = self._read_progress()
        if dangling is None:
            self.status = "done"
            if returncode not in (0, 1, 5):  # 2: interrupted, 3: internal error, 4: usage, < 0: a signal
                self.status, self.note = "error", f"pytest exited with status {returncode} outside any test"
            return True
        stacks = self.progress + ".stacks"  # (faulthandler's, for a test past its time: pytest_progress)
        text = ""
        if os.path.exists(stacks):
            with open(stacks, encoding="utf-8", errors="replace") as f:
                text = f.read()
            os.remove(stacks)
            with open(self.log, "a", encoding="utf-8") as log:
                log.write(text)
        timed_out = "Timeout (" in text
        self.outcomes[dangling] = "timed out" if timed_out else "crashed"
        how = "timed out" if timed_out else (f"signal {-returncode}" if returncode < 0 else f"exit {returncode}")
        print(f"gpu_tests: {dangling} {'timed out' if timed_out else 'crashed'} ({how}); going on after it",
              flush=True)
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            self.status, self.note = "error", f"stopped after {MAX_RESTARTS} restarts"
            return True
        with open(self.skip, "w", encoding="utf-8") as f:
            f.write("\n".join(self.outcomes) + "\n")
        return False

    def counts(self) -> dict:
        out = {k: 0 for k in ("passed", "failed", "skipped", "crashed", "timed out")}
        for outcome in self.outcomes.values():
            out[outcome] = out.get(outcome, 0) + 1
        return out


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the process group (pytest still prints its summary), SIGKILL 10 s later."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run(files: list, args) -> list:
    start = time.time()
    workdir = tempfile.mkdtemp(prefix="gpu_tests-")
    runs = [FileRun(f, workdir, args) for f in files]
    waiting, running = list(runs), []
    out_log = os.path.join(args.out, "tests.log") if args.out else None

    def collect(r: FileRun) -> None:
        r.seconds = time.time() - r.started_at
        if out_log:
            with open(r.log, encoding="utf-8", errors="replace") as src, open(out_log, "a", encoding="utf-8") as dst:
                dst.write(src.read())
        c = r.counts()
        print(f"gpu_tests: {r.path}: {r.status}, {r.seconds:.0f} s, " + ", ".join(f"{v} {k}" for k, v in c.items() if v)
              + (f" ({r.note})" if r.note else ""), flush=True)

    while waiting or running:
        if time.time() - start > args.deadline:
            for r in running:
                _stop(r.proc)
                r._read_progress()
                r.status, r.note = "interrupted", "at the deadline"
                collect(r)
            running = []
            break
        while waiting and len(running) < args.jobs:
            r = waiting.pop(0)
            r.start()
            running.append(r)
        time.sleep(0.2)
        for r in list(running):
            code = r.proc.poll()
            if code is None:
                continue
            if r.finished(code):
                running.remove(r)
                collect(r)
            else:
                r.start()
    for r in waiting:
        r.note = "the deadline came first"
    shutil.rmtree(workdir, ignore_errors=True)
    return runs


def report(runs: list, args, seconds: float) -> int:
    lines = ["| file | status | seconds | passed | failed | skipped | crashed | timed out | restarts |",
             "|---|---|---|---|---|---|---|---|---|"]
    bad = []
    for r in runs:
        c = r.counts()
        lines.append(f"| {r.path} | {r.status}{' (' + r.note + ')' if r.note else ''} | {r.seconds:.0f} | "
                     f"{c['passed']} | {c['failed']} | {c['skipped']} | {c['crashed']} | {c['timed out']} | "
                     f"{r.restarts} |")
        bad += [f"- {outcome}: `{nodeid}`" for nodeid, outcome in r.outcomes.items()
                if outcome in ("failed", "crashed", "timed out")]
    totals = {k: sum(r.counts()[k] for r in runs) for k in ("passed", "failed", "skipped", "crashed", "timed out")}
    head = (f"{len(runs)} files, {args.jobs} at once, {seconds:.0f} s: "
            + ", ".join(f"{v} {k}" for k, v in totals.items()) + "; not run: "
            + str(sum(1 for r in runs if r.status == "not run")) + " files")
    text = "\n".join([f"# Test run ({head})", ""] + lines + ([""] + ["Not passed:"] + bad if bad else [])) + "\n"
    print(text, flush=True)
    if args.out:
        with open(os.path.join(args.out, "tests.md"), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(args.out, "tests.json"), "w", encoding="utf-8") as f:
            json.dump({"seconds": seconds, "jobs": args.jobs, "totals": totals,
                       "files": [{"path": r.path, "status": r.status, "note": r.note, "seconds": round(r.seconds, 1),
                                  "restarts": r.restarts, "outcomes": r.outcomes} for r in runs]}, f, indent=1)
    failed = totals["failed"] + totals["crashed"] + totals["timed out"]
    return 1 if failed or any(r.status in ("error", "interrupted", "not run") for r in runs) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files (default: the whole suite, in ORDER)")
    parser.add_argument("--jobs", type=int, default=1, help="test processes at once (default 1)")
    parser.add_argument("--per-test-timeout", type=float, default=120.0, help="seconds one test may take (default 120)")
    parser.add_argument("--deadline", type=float, default=520.0, help="seconds for the whole run (default 520)")
    parser.add_argument("--marker", default="", help="pytest -m expression (e.g. 'not slow')")
    parser.add_argument("--out", default="", help="folder for tests.log, tests.md and tests.json")
    parser.add_argument("--plan", action="store_true", help="print the estimated schedule; exit 1 if it does not fit")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.per_test_timeout < 0 or args.deadline <= 0:
        parser.error("--jobs must be >= 1, --per-test-timeout >= 0 and --deadline > 0")
    files = args.files or suite_files()
    if args.plan:
        return plan(files, args.jobs, args.deadline)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    start = time.time()
    runs = run(files, args)
    return report(runs, args, time.time() - start)


if __name__ == "__main__":
    sys.exit(main())

"""A pytest plugin for benchmarks/gpu_tests.py: what a test process did, written as it happens, so that
a process that dies (a segmentation fault in a kernel, a hung test killed at its limit) still says
which test it was in, and a new process can go on after it.

Loaded with ``-p benchmarks.pytest_progress``; does nothing unless the environment names its files:

* ``NANSCAN_TEST_PROGRESS``: a file it appends to, one line per event, each written with one
  ``os.write`` (nothing buffered in the process): ``start <nodeid>`` when a test begins, ``end
  <outcome> <nodeid>`` when it ends (``passed``, ``failed``, ``skipped``; ``failed`` if its setup or
  teardown failed).
* ``NANSCAN_TEST_SKIP``: a file of node ids (one per line) to deselect -- the tests a crashed
  process already ran, and the one it crashed in.
* ``NANSCAN_TEST_TIMEOUT``: seconds one test may take; past them faulthandler writes every thread's
  stack to ``<progress file>.stacks`` (not to stderr, which pytest captures into a file of its own
  that dies with the process) and ends the process: the runner reports the test as timed out and
  goes on after it.
  Used where pytest-timeout is not installed, and always: its signal method cannot interrupt a
  kernel or a wait in C++, this can.
"""
from __future__ import annotations

import faulthandler
import os

import pytest

_FD = None
_STACKS = None
_TIMEOUT = 0.0


def pytest_configure(config):
    global _FD, _STACKS, _TIMEOUT
    path = os.environ.get("NANSCAN_TEST_PROGRESS")
    if path:
        _FD = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _TIMEOUT = float(os.environ.get("NANSCAN_TEST_TIMEOUT") or 0)
    if _TIMEOUT > 0:
        _STACKS = open((path or "pytest_progress") + ".stacks", "a", encoding="utf-8")


def _write(line: str) -> None:
    if _FD is not None:
        os.write(_FD, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("NANSCAN_TEST_SKIP")
    if not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        skip = {line.strip() for line in f if line.strip()}
    kept, dropped = [], []
    for item in items:
        (dropped if item.nodeid in skip else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_outcomes: dict = {}


def pytest_runtest_logstart(nodeid, location):
    _outcomes[nodeid] = "passed"
    _write(f"start {nodeid}")
    if _TIMEOUT > 0:
        faulthandler.dump_traceback_later(_TIMEOUT, exit=True, file=_STACKS)


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = "skipped"


def pytest_runtest_logfinish(nodeid, location):
    if _TIMEOUT > 0:
        faulthandler.cancel_dump_traceback_later()
    _write(f"end {_outcomes.pop(nodeid, 'passed')} {nodeid}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    global _FD, _STACKS
    if _FD is not None:
        os.close(_FD)
        _FD = None
    if _STACKS is not None:
        _STACKS.close()
        _STACKS = None

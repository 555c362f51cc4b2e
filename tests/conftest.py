"""Test setup: run Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates the kernels, i.e. before
nanscan.kernels.triton is first imported, hence here.
"""
import os

import pytest

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A missing or stale compiled library would silently shrink the test matrix to the reference
# backend; refuse to run instead (NANSCAN_ALLOW_MISSING_LIBRARY=1 to test the reference alone).
from nanscan import _ops  # noqa: E402  (after TRITON_INTERPRET is set)

if _ops.LOAD_ERROR is not None and os.environ.get("NANSCAN_ALLOW_MISSING_LIBRARY") != "1":
    raise RuntimeError(f"nanscan tests need the compiled library: {_ops.LOAD_ERROR}")


# Real trackers, kept under tmp_path (test_telemetry_sinks.py, test_telemetry_monitor.py).
@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """An offline W&B with every file under tmp_path (nothing in ~, no network)."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb; the Makefile installs it)")
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
                       "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}.items():
        monkeypatch.setenv(var, value)
    (tmp_path / "wandb").mkdir()
    yield wandb
    if wandb.run is not None:
        wandb.run.finish()


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """MLflow's default local store as of MLflow 3 (SQLite; the ./mlruns file store is in maintenance
    mode and refused by default), under tmp_path; the tracking URI only through the environment, so
    no global MLflow state outlives the test."""
    mlflow = pytest.importorskip("mlflow",
                                 reason="mlflow is not installed (pip install mlflow; the Makefile installs it)")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # (MLflow's usage pings: no network here, none wanted)
    yield mlflow, uri
    while mlflow.active_run() is not None:
        mlflow.end_run()


# A monitor left open by one test hears every later test's backward (a loss hook is global): a
# test that leaks one fails here, and the monitor is closed, so the leak never changes another test.
@pytest.fixture(autouse=True)
def no_monitor_outlives_its_test():
    from nanscan.monitor.torch_hooks import WATCHED

    before = set(WATCHED)
    yield
    leaked = [monitor for key, monitor in list(WATCHED.items()) if key not in before]
    for monitor in leaked:
        try:
            monitor.close()
        except Exception:  # (what the test left behind; its failure is reported below)
            pass
        WATCHED.pop(id(monitor.model), None)
    if leaked:
        pytest.fail(f"{len(leaked)} monitor(s) left open by this test (models: "
                    f"{', '.join(type(m.model).__name__ for m in leaked)}); close them (mon.close() or `with`)")

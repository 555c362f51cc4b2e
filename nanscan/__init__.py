"""nanscan: find where NaN and Inf first appear in PyTorch training.

Public API::

    nanscan.summarize(x, backend=None) -> TensorSummary          # one fused pass, one host copy
    nanscan.summarize_many(xs, backend=None) -> list[TensorSummary]
    nanscan.record(x) / nanscan.records(xs) -> device float64 records (no host sync)
    nanscan.available_backends() -> e.g. ["cpu", "cuda", "triton", "reference"]
    nanscan.watch(model, optimizer, scaler, ...) -> Monitor     # always-on NaN/Inf localization
    nanscan.WatchConfig(...)                                    # its options, as one frozen dataclass
    nanscan.capture_bundle / load_bundle / replay / compare / bisect_backends   # after a failure
    nanscan.log.dumps / loads, nanscan.EventLog, nanscan.guard             # NaN-safe logs
    nanscan.telemetry.Publisher / TensorBoard / WandB / MLflow / JSONL      # NaN-safe tracker sinks

The ops behind them are ``torch.ops.nanscan.summarize`` / ``summarize_many`` (C++ CPU and CUDA) and
``torch.ops.nanscan.triton_summarize`` / ``triton_summarize_many``; all have fake kernels and stay
inside ``torch.compile`` graphs. ``NANSCAN_BACKEND`` picks a backend process-wide.
"""
from nanscan._ops import BACKENDS, ExtensionError, available_backends, build_info
from nanscan.capture import (BackendResult, BisectResult, Bundle, BundleError, Comparison, ReplayResult,
                             bisect_backends, capture_bundle, compare, load_bundle, replay)
from nanscan import telemetry
from nanscan.guard import guard
from nanscan.log import EventLog
from nanscan.monitor import (Incident, Ledger, Monitor, NonFiniteError, SpikeEvent, SpikePolicy, SpikeWarning,
                             WatchConfig, all_reduce_records, watch)
from nanscan.record import RECORD_SIZE, Field, TensorSummary
from nanscan.summary import record, records, summarize, summarize_many

from nanscan._version import __version__

__all__ = [
    "BackendResult", "BisectResult", "Bundle", "BundleError", "Comparison", "ReplayResult", "bisect_backends",
    "capture_bundle", "compare", "load_bundle", "replay", "guard", "EventLog",
    "BACKENDS", "ExtensionError", "Field", "Incident", "Ledger", "Monitor", "NonFiniteError", "RECORD_SIZE",
    "SpikeEvent", "SpikePolicy", "SpikeWarning",
    "TensorSummary", "all_reduce_records", "available_backends", "build_info", "record", "records", "summarize",
    "summarize_many", "telemetry", "watch", "WatchConfig", "__version__",
]

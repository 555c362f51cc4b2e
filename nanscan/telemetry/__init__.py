"""Telemetry: nanscan's per-step scalars sent to the trackers users already have, NaN-safe by
construction (docs/telemetry.md).

A sink is any callable ``fn(step: int, scalars: dict[str, float])`` or one of :class:`TensorBoard`,
:class:`WandB`, :class:`MLflow`, :class:`JSONL`; a :class:`Publisher` sends each step's scalars to
all of them. No NaN or Inf ever reaches a sink: a non-finite ``X`` is sent as ``X_nonfinite = 1``
and ``X`` is left out (:func:`finite_scalars`). A sink that raises is warned about once and dropped;
training never stops for telemetry. Names are ``nanscan/<stat>/<name>`` (:func:`scalar_name`).

The optional packages (``tensorboard``, ``wandb``, ``mlflow``) are imported only when their sink is
made.
"""
from nanscan.telemetry.publisher import Publisher, check_sink
from nanscan.telemetry.scalars import NONFINITE_SUFFIX, PREFIX, finite_scalars, nonfinite_name, scalar_name
from nanscan.telemetry.sinks import JSONL, MLflow, Sink, TensorBoard, WandB, mlflow_key

__all__ = [
    "JSONL", "MLflow", "NONFINITE_SUFFIX", "PREFIX", "Publisher", "Sink", "TensorBoard", "WandB", "check_sink",
    "finite_scalars", "mlflow_key", "nonfinite_name", "scalar_name",
]

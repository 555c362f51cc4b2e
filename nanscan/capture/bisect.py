"""Backend bisection driven by the captured batch: eager, aot_eager, aot_eager_decomp_partition,
inductor -- which of them produce non-finite values? No hand-written pass/fail function: the
predicate is "is the step's output finite", and each backend is compared with eager."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from nanscan.capture.bundle import Bundle, load_bundle
from nanscan.capture.compare import Comparison, compare
from nanscan.capture.replay import _autocast, _float_tensors, prepare, run_step
from nanscan.record import TensorSummary
from nanscan.summary import summarize

# torch.compile backends (not nanscan's kernel backends, nanscan.BACKENDS)
COMPILE_BACKENDS = ("eager", "aot_eager", "aot_eager_decomp_partition", "inductor")


@dataclasses.dataclass
class BackendResult:
    """``finite``: the step's output had no NaN/Inf (None when the backend failed). ``comparison``:
    against the eager output (None for eager itself or on failure). ``error``: why the backend
    failed to compile or run (reported, not raised)."""

    finite: Optional[bool]
    comparison: Optional[Comparison]
    error: Optional[str]
    summary: Optional[TensorSummary] = None

    def __str__(self) -> str:
        if self.error:
            return f"failed: {self.error}"
        state = "finite" if self.finite else f"NON-FINITE ({self.summary})"
        return state if self.comparison is None else f"{state}; vs eager: {self.comparison}"


def bisect_backends(bundle, model: torch.nn.Module, forward: Optional[Callable] = None,
                    backends=COMPILE_BACKENDS) -> dict:
    """Run the bundle's step (forward only) under each backend, restoring the recorded state and
    pre-step RNG before each run; returns ``{backend: BackendResult}`` in ``backends`` order."""
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    results: dict = {}
    eager = None
    for backend in backends:
        try:
            torch._dynamo.reset()
            _, batch, device = prepare(b, model)
            with torch.no_grad(), _autocast(b.manifest, device, None):
                out = run_step(model, batch, forward, None if backend == "eager" else backend)
            tensors = _float_tensors(out)
            if not tensors:
                raise TypeError(f"forward returned no floating tensor ({type(out).__name__})")
            t = tensors[0].detach()
            s = summarize(t)
            comparison = compare(eager, t) if eager is not None and backend != "eager" else None
            if backend == "eager":
                eager = t.clone()
            results[backend] = BackendResult(finite=s.is_finite, comparison=comparison, error=None, summary=s)
        except Exception as e:  # a backend that fails to compile is a finding, not a crash
            results[backend] = BackendResult(finite=None, comparison=None, error=f"{type(e).__name__}: {e}")
    return results

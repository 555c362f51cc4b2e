"""Backend bisection driven by the captured batch: eager, aot_eager, aot_eager_decomp_partition,
inductor -- which of them produce non-finite values? No hand-written pass/fail function: the
predicate is "is the step's output finite", and each backend is compared with eager. The result
set says its conclusion in words (:attr:`BisectResult.conclusion`)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from nanscan.capture.bundle import Bundle, load_bundle
from nanscan.capture.compare import Comparison, compare
from nanscan.capture.provenance import float_tensors
from nanscan.capture.replay import _autocast, prepare, run_step
from nanscan.record import TensorSummary
from nanscan.summary import summarize

# torch.compile backends (not nanscan's kernel backends, nanscan.BACKENDS)
COMPILE_BACKENDS = ("eager", "aot_eager", "aot_eager_decomp_partition", "inductor")
# What each compiled backend adds to the one before it in COMPILE_BACKENDS: where a NaN that the
# previous one did not make comes from.
_ADDS = {"aot_eager": "AOT autograd's tracing (dynamo + aot_eager, no decompositions)",
         "aot_eager_decomp_partition": "the decompositions and the forward/backward partition",
         "inductor": "inductor's generated code"}


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


class BisectResult(dict):
    """``{backend: BackendResult}`` in the order run, plus what they add up to: ``conclusion`` (one
    sentence) and ``str()`` (a line per backend, then the conclusion), which the CLI prints."""

    @property
    def nonfinite(self) -> list:
        return [n for n, r in self.items() if r.finite is False]

    @property
    def finite(self) -> list:
        return [n for n, r in self.items() if r.finite is True]

    @property
    def failed(self) -> list:
        return [n for n, r in self.items() if r.error is not None]

    @property
    def conclusion(self) -> str:
        bad, good, failed = self.nonfinite, self.finite, self.failed
        skipped = f" ({', '.join(failed)} failed to run: not checked)" if failed and (bad or good) else ""
        if not bad and not good:
            return (f"every backend failed ({len(self)}): nothing was checked -- does the model fit the bundle "
                    "it was captured from?")
        if not bad:
            return (f"finite on every backend that ran{skipped}: the forward did not reproduce the failure "
                    "(replay it with the backward: nanscan replay)")
        if not good:
            return (f"non-finite on every backend{' that ran' if failed else ''}{skipped}: not a compiler bug -- "
                    "the model, its weights or its data make the NaN/Inf (nanscan replay names the op)")
        eager = self.get("eager")
        if eager is not None and eager.finite is False:
            return (f"non-finite in eager, finite under {', '.join(good)}{skipped}: the compiled graph computes "
                    "differently (fused or reordered ops kept the values in range): not a compiler bug, the "
                    "eager model is on the edge")
        first = next(n for n in self if n in bad)
        order = list(self)
        before = order[order.index(first) - 1] if order.index(first) > 0 else None
        where = _ADDS.get(first, first)
        if before is not None and self[before].finite is True:
            where = f"{where}: {before} is finite, {first} is not"
        if eager is None or eager.finite is None:
            return f"non-finite under {', '.join(bad)}, finite under {', '.join(good)}{skipped}: backends disagree"
        return (f"finite in eager, non-finite under {', '.join(bad)}{skipped}: a compiler bug candidate, "
                f"first in {where}")

    def __str__(self) -> str:
        lines = [f"{name:<28} {result}" for name, result in self.items()]
        return "\n".join(lines + [f"conclusion: {self.conclusion}"])


def bisect_backends(bundle, model: torch.nn.Module, forward: Optional[Callable] = None,
                    backends=COMPILE_BACKENDS) -> BisectResult:
    """Run the bundle's step (forward only) under each backend, restoring the recorded state and
    pre-step RNG before each run; returns a :class:`BisectResult` (``{backend: BackendResult}``
    in ``backends`` order, with its ``conclusion``). A backend's output is non-finite when any
    floating tensor it returned is (an HF output's loss or logits)."""
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    results = BisectResult()
    eager = None
    for backend in backends:
        try:
            torch._dynamo.reset()
            _, batch, device = prepare(b, model)
            with torch.no_grad(), _autocast(b.manifest, device, None):
                out = run_step(model, batch, forward, None if backend == "eager" else backend)
            tensors = [t.detach() for t in float_tensors(out)]
            if not tensors:
                raise TypeError(f"forward returned no floating tensor ({type(out).__name__})")
            summaries = [summarize(t) for t in tensors]
            s = next((s for s in summaries if not s.is_finite), summaries[0])
            t = tensors[0]
            comparison = compare(eager, t) if eager is not None and backend != "eager" else None
            if backend == "eager":
                eager = t.clone()
            results[backend] = BackendResult(finite=all(x.is_finite for x in summaries), comparison=comparison,
                                             error=None, summary=s)
        except Exception as e:  # a backend that fails to compile is a finding, not a crash
            results[backend] = BackendResult(finite=None, comparison=None, error=f"{type(e).__name__}: {e}")
    return results

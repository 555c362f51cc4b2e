"""What the monitor keeps so that it can write a failure bundle (see :mod:`nanscan.capture.bundle`).

At the start of each checked step: independent clones of the batch given to ``mon.step(batch)``
(later in-place edits do not reach the bundle), the RNG states, the autocast state the forward
runs under, and -- only with ``keep_pre_update_state`` -- a copy of model / optimizer / scaler
state (one extra copy of all state in memory and a copy per step). Two steps are kept: async mode
and update-phase incidents are reported one step late.

A batch the bundle cannot store as it is (a dataclass, a ``BatchEncoding``, a custom object: see
"Batches" in :mod:`nanscan.capture.bundle`) is kept as far as it can be, with one
``RuntimeWarning`` per monitor for each kind of loss; keeping the root module's forward inputs
never raises, since it runs inside the watched forward.
"""
from __future__ import annotations

import copy
import os
import warnings
from typing import Optional

from nanscan.warn import warn as _warn  # a warning that a "-W error" filter cannot turn into an exception


class StepCapture:
    def __init__(self, model, optimizer, scaler, capture_dir: Optional[str], keep_pre_update_state: bool,
                 rank: int, mode: str):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.capture_dir, self.keep_pre_update_state = capture_dir, keep_pre_update_state
        self.rank, self.mode = rank, mode
        self.saved: dict = {}  # step -> what was kept before it
        self.bundle_path: Optional[str] = None
        self.bundle_step: Optional[int] = None
        self.warned: set = set()  # the kinds of batch loss warned about (once per monitor each)

    def remember(self, step: int, batch=None, forward_inputs=None, inputs_of: Optional[str] = None) -> None:
        """Keep what the bundle of ``step`` needs: ``batch`` (given to ``mon.step(batch)``) or the
        root module's ``forward_inputs`` ``(args, kwargs)`` of the step's first forward (never
        raises: what cannot be stored is dropped, warned once per monitor)."""
        from nanscan.capture import bundle as B

        pre_state = None
        if self.keep_pre_update_state:
            pre_state = ({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                         copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
                         copy.deepcopy(self.scaler.state_dict()) if self.scaler is not None else None)
        if forward_inputs is not None:  # inside the watched forward: never raises
            try:
                kept = B.clone_forward_inputs(*forward_inputs)  # model(x), model(**batch), model(a, b=...)
            except Exception as e:  # pragma: no cover - the cloner drops what it cannot keep
                kept = None
                self._warn_once("failed", f"nanscan: the failure bundle cannot keep the batch of step {step} ({e!r}); "
                                          "a bundle of such a step has no batch. (Warned once per monitor.)")
        else:  # mon.step(batch): the user's call; an element that cannot be stored raises TypeError here
            kept = B.clone_batch(batch) if batch is not None else None
        for kind, message in B.batch_notices(kept):
            self._warn_once(kind, message)
        self.saved[step] = {"batch": kept, "rng": B.capture_rng(), "inputs_of": inputs_of,
                            "autocast": B.autocast_state(), "pre_state": pre_state, "training": self.model.training}
        for old in [k for k in self.saved if k < step - 1]:
            del self.saved[old]

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            _warn(message, RuntimeWarning, stacklevel=3)

    def note_autocast(self, step: int, inside: bool = False) -> None:
        """Called as the model's forward begins -- or, with ``inside``, at the first module called
        inside it (Note [autocast inside the forward], autocast_probe.py): autocast as the forward
        sees it."""
        if step in self.saved:
            from nanscan.capture.bundle import autocast_state

            self.saved[step]["autocast"] = autocast_state()
            self.saved[step]["autocast_entered"] = "inside the model's forward" if inside else None

    def write(self, incident, capture_dir: str, step: int, *, current_step: int, applied_this_step) -> str:
        """Write the bundle of ``step`` into ``capture_dir`` as ``step<step>-rank<rank>``, or under the
        first free ``-1``, ``-2``, ... suffix when that exists (a rerun); returns the path written.

        The state marker is "before-update" when the check ran before ``optimizer.step`` (sync mode,
        non-update phases, the current step) or when the pre-update state was kept; otherwise it is
        honestly "after-update"."""
        from nanscan.capture import bundle as B

        saved = self.saved.get(step)
        if saved is None:
            raise RuntimeError(f"nanscan: nothing was kept for step {step}, cannot write its bundle")
        if saved["batch"] is None:
            warnings.warn("nanscan: the bundle has no batch: pass it to mon.step(batch) to make it replayable",
                          RuntimeWarning, stacklevel=4)
        pre = saved["pre_state"]
        if pre is not None:
            before = True
        elif incident is not None:
            before = self.mode == "sync" and incident.phase != "update" and step == current_step
        else:  # guard: a step that failed on its own; the update ran only if its hook fired
            before = step == current_step and not applied_this_step
        model_state, opt_state, scaler_state = pre if pre is not None else (
            self.model.state_dict(), self.optimizer.state_dict() if self.optimizer is not None else None,
            self.scaler.state_dict() if self.scaler is not None else None)
        # new_name: a rerun into the same capture_dir (same step and rank) writes step...-rank0-1 and
        # keeps both; bundle_path is the path actually written.
        self.bundle_path = B.write_bundle(
            os.path.join(capture_dir, f"step{step:06d}-rank{self.rank}"), new_name=True,
            batch=saved["batch"] or {"args": [], "kwargs": {}, "single": False}, rng=saved["rng"],
            model_state=model_state, optimizer_state=opt_state, scaler_state=scaler_state,
            state_when="before-update" if before else "after-update", training=saved["training"],
            autocast=saved["autocast"], precision=B.model_precision(self.model),
            incident=incident.to_dict() if incident is not None else None,
            step=step, extra={"mode": self.mode, "keep_pre_update_state": self.keep_pre_update_state,
                              **({"inputs_of": saved["inputs_of"]} if saved.get("inputs_of") else {}),
                              **({"autocast_entered": saved["autocast_entered"]}
                                 if saved.get("autocast_entered") else {})})
        self.bundle_step = step
        return self.bundle_path

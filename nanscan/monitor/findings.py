"""What a monitor has found: its incidents (the first non-finite value of each step and phase) and
its offenders (every non-finite value, by step), judged one :class:`~nanscan.monitor.read.Read` at a
time, with the agreement across ranks. What to do about a finding -- raise, warn, capture -- is the
monitor's policy; this module only says what was found.
"""
from __future__ import annotations

import dataclasses
import glob
from typing import Optional

from nanscan.monitor import distributed
from nanscan.monitor.attribution import first_incidents, offenders, other_offenders
from nanscan.vocabulary import PHASE_ORDER

__all__ = ["Findings"]


# Note [one incident per step and phase]: an incident is the *first* non-finite value of its step
# and phase. A step can be read more than once -- optimizer.step(closure) reads after every closure
# call, and LBFGS evaluates the closure many times in one step, at parameters it moved in between --
# and a later read of the same step finds the same fault (or what followed from it) again: it adds
# nothing to the incidents, the log or the warnings. Eval forwards are read one by one and keep
# their incidents each (phase "eval").


# Note [eager frames beside compiled ones]: under torch.compile(model) the modules' hooks run inside
# the graphs (traced rows, in production order among themselves) or, in a frame that dynamo runs
# eagerly -- past its recompile limit, after a graph break it cannot resume inside a nested call
# (transformers' models), the root's hooks always --, as eager hooks, whose rows go into the eager
# window. Every eager record carries the host's count of compiled rows stamped before it (Note
# [stamps counted on the host] in csrc/monitor/stamp_rows.cpp), which places it among the compiled
# rows: one production order, and the same attribution as eager. That count is right only while
# every stamp's host code ran once for its device write; where the host's total disagrees with the
# device's (a CUDA graph replayed stamps without the host), how the two sequences interleaved is
# unknown, and a forward or backward incident of a step with eager module rows beside compiled ones
# says so (order_known=False, produced=None) instead of naming a place as certain. So does a backward
# incident of such a step where the compiled graphs record no gradients (torch 2.11 with the default
# compiled_grads="hooks"): a gradient made inside a graph is then among no rows at all.


def _training_order(incident) -> tuple:
    return incident.step, PHASE_ORDER[incident.phase]


class Findings:
    """Incidents in training order and offenders by step, of one monitor."""

    def __init__(self, allow: tuple, rank: int):
        self.allow, self.rank = allow, rank
        self.incidents: list = []
        self._keys: set = set()  # (step, phase) of the training incidents in self.incidents
        self.offenders: dict = {}  # step -> names of every non-finite value found in it (not only the first)

    def judge(self, read) -> list:
        """The incidents of ``read`` that are new (Note [one incident per step and phase]), in
        training order; every non-finite name goes into :attr:`offenders`."""
        if not read.bad:  # (a clean read: nothing to attribute)
            return []
        found = first_incidents(read.slots, read.values, read.bad, allow=self.allow, rank=self.rank,
                                reduced_grads=distributed.active(),
                                handled_step=read.step if read.handled else None, position=read.position)
        if found and read.compiled:
            mixed = {phase: read.steps_mixing_eager_and_compiled(phase) for phase in ("forward", "backward")}
            if mixed["forward"] or mixed["backward"]:  # Note [eager frames beside compiled ones]
                found = [dataclasses.replace(inc, produced=None, inputs=(), order_known=False)
                         if inc.phase in mixed and inc.step in mixed[inc.phase] else inc for inc in found]
        if read.training:
            found = [inc for inc in found if (inc.step, inc.phase) not in self._keys]
        if read.bad:
            for step, names in offenders(read.slots, read.bad, allow=self.allow, position=read.position).items():
                known = self.offenders.setdefault(step, [])
                known.extend(n for n in names if n not in known)
        return found

    def agree(self, read, found: list) -> tuple:
        """``(found, report)``: the incident to report of this read (None: none; never one GradScaler
        handled), agreed across ranks in training (every rank reports the same incident in the same
        step). Another rank's incident stands for its step and phase here too."""
        report = found[0] if found and not found[0].handled_by_scaler else None
        if read.training and distributed.active():
            report = distributed.agree(report)
            if report is not None and report.rank != self.rank:
                # The first failing rank's incident, in training order: before this rank's own later
                # ones (a gradient reduced from it).
                found = [inc for inc in found if (inc.step, inc.phase) != (report.step, report.phase)]
                if (report.step, report.phase) not in self._keys:
                    found.append(report)
        return found, report

    def add(self, found: list) -> None:
        """Into :attr:`incidents` in training order, (step, phase): a read may hold an earlier step's
        update next to this step's forward, and the first failing rank's incident may be earlier in
        the step than this rank's own."""
        incidents = self.incidents
        for inc in sorted(found, key=_training_order):
            if inc.phase != "eval":
                self._keys.add((inc.step, inc.phase))
            where = len(incidents)
            while where and _training_order(incidents[where - 1]) > _training_order(inc):
                where -= 1
            incidents.insert(where, inc)

    def also(self, read, report) -> str:
        """The rest of a warned incident's message: the step's other values made non-finite (by
        name), how many were computed from non-finite values (counted: ``mon.offenders`` lists
        them), and ``allow=`` only for values that look intended (-inf fills)."""
        if report.step not in self.offenders:
            return ""
        made, spread, fills = other_offenders(read.slots, read.values, read.bad, allow=self.allow, report=report,
                                              position=read.position)
        parts = []
        if made:
            shown = ", ".join(made[:8]) + (f" and {len(made) - 8} more" if len(made) > 8 else "")
            parts.append(f" Also non-finite in this step: {shown}.")
        if spread:
            parts.append(f" {spread} value(s) in this step were computed from non-finite ones (mon.offenders "
                         f"lists every name).")
        if fills:
            patterns = tuple(dict.fromkeys(glob.escape(n) for n in fills))
            parts.append(f" If these -inf fills are intended (masks, padding): watch(..., allow={patterns!r}).")
        return "".join(parts)

    def allow_patterns(self) -> tuple:
        """fnmatch patterns matching exactly every non-finite value found so far."""
        return tuple(dict.fromkeys(glob.escape(n) for names in self.offenders.values() for n in names))

    @property
    def first(self) -> Optional[object]:
        return self.incidents[0] if self.incidents else None

"""What a monitor found, as its user reads it: the properties of :class:`~nanscan.monitor.monitor.Monitor`
that answer "where, when, what else" -- incidents, offenders, spikes, headroom warnings, the bundle,
the step. Read-only views of the parts that hold them (findings, outcomes, the step capture, the step
state); nothing here changes the monitor.
"""
from __future__ import annotations

from typing import Optional

from nanscan.monitor.headroom import HeadroomWatch
from nanscan.monitor.incident import Incident

__all__ = ["Results"]


class Results:
    """Mixed into :class:`~nanscan.monitor.monitor.Monitor`."""

    @property
    def step_index(self) -> int:
        """The current step (counted from 0; one per optimizer step, see the module docstring)."""
        return self.state.index

    @property
    def failing_step(self) -> int:
        """The step a training error happened in: the one a ``with mon.step():`` block just ended by
        raising, else the current step (:func:`nanscan.guard` logs and captures this one)."""
        return self._failed_step if self._failed_step is not None else self.state.index

    @property
    def headroom(self) -> Optional[HeadroomWatch]:
        """The headroom watch (None when off, or turned off by its own failure)."""
        headroom = self._headroom
        return headroom if headroom is not None and not headroom.off else None

    @property
    def spikes(self) -> list:
        """The loss / gradient-norm spikes found so far (:class:`~nanscan.monitor.spikes.SpikeEvent`;
        ``watch(..., spikes=True)``; those found before a failure of the spike warnings turned them
        off included)."""
        return self._spikes.events if self._spikes is not None else []

    @property
    def headroom_events(self) -> list:
        """The headroom warnings given so far (:class:`~nanscan.monitor.headroom.HeadroomEvent`)."""
        return self.headroom.events if self.headroom is not None else []

    @property
    def bundle_path(self) -> Optional[str]:
        """The bundle written at the first reported incident (or by :func:`nanscan.guard`), or None."""
        return self._capturer.bundle_path

    def allow_patterns(self) -> tuple:
        """fnmatch patterns matching exactly every non-finite value found so far (see
        :attr:`offenders`), for ``watch(..., allow=...)`` when those values are intended."""
        return self.findings.allow_patterns()

    def allow_line(self) -> str:
        """``allow=(...)`` ready to paste, from :meth:`allow_patterns`."""
        return f"allow={self.allow_patterns()!r}"

    @property
    def incidents(self) -> list:
        """Every incident found so far, in training order (step, then phase)."""
        return self.findings.incidents

    @property
    def offenders(self) -> dict:
        """Step -> the names of every non-finite value found in it (not only the first)."""
        return self.findings.offenders

    @property
    def incident(self) -> Optional[Incident]:
        """The first incident, or None."""
        return self.findings.first

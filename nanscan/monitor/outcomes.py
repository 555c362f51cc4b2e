"""What a landed :class:`~nanscan.monitor.read.Read` leads to, in order: the scalars read with the
records (clip norm, loss scale, a fused-AMP optimizer's ``found_inf``) into the ledger and the step
log; the findings (:mod:`~nanscan.monitor.findings`) and their agreement across ranks; the step log,
headroom and telemetry; then the policy for a reported incident -- the bundle (once), the log line,
and raise, warn or only record (``on_nonfinite``).

Each consumer is given the read; none reaches back into the monitor. A failure of headroom or
telemetry is nanscan's own: warned once, that consumer turned off, training goes on.
"""
from __future__ import annotations

from typing import Callable, Optional

from nanscan.guard import attach_note
from nanscan.monitor.config import WatchConfig
from nanscan.monitor.findings import Findings
from nanscan.monitor.headroom import HeadroomWatch
from nanscan.monitor.incident import Incident, NonFiniteError
from nanscan.monitor.ledger import Ledger
from nanscan.monitor.read import Read
from nanscan.monitor.skipping import StepSkipper, limit_note
from nanscan.monitor.spikes import SpikeWatch
from nanscan.monitor.stepcapture import StepCapture
from nanscan.monitor.steplog import StepLog
from nanscan.warn import warn

__all__ = ["Outcomes"]


class Outcomes:
    """The consumers of one monitor's reads. ``write_bundle(incident)`` writes the failure bundle
    of the incident's step (the monitor's ``capture``)."""

    def __init__(self, config: WatchConfig, ledger: Ledger, findings: Findings, steplog: Optional[StepLog],
                 headroom: Optional[HeadroomWatch], capturer: StepCapture,
                 write_bundle: Callable[[Incident], str], skipper: Optional[StepSkipper] = None,
                 spikes: Optional[SpikeWatch] = None):
        self.config, self.ledger, self.findings = config, ledger, findings
        self.steplog, self.headroom, self.capturer = steplog, headroom, capturer
        self._write_bundle = write_bundle
        self.fused_applied: dict = {}  # step -> did a fused-AMP update apply (read before the update)
        self.raised = False  # a NonFiniteError was raised (close() then records, never raises)
        # on_nonfinite="skip": the monitor sets before_update around the read in the optimizer's step
        # pre-hook (the only read whose update can still be skipped); a reported incident there leaves
        # skip_report for it to act on.
        self.skipper = skipper
        self.spikes = spikes
        self.before_update = False
        self.skip_report: Optional[Incident] = None

    def decide(self, read: Read, raise_incident: Optional[bool]) -> None:
        """Everything a read leads to; ``raise_incident`` False warns, None records silently."""
        self.take_extras(read)
        found = self.findings.judge(read)
        if self.steplog is not None:
            self.steplog.observe(read)
        if self.headroom is not None and read.training:
            self._check_headroom(read)
        if read.training and self.steplog is not None and self.steplog.health is not None:
            self._observe_health(read)
        if read.training and self.spikes is not None:
            self._observe_spikes(read)
        found, report = self.findings.agree(read, found)
        self.findings.add(found)
        if report is None:
            self.log_incidents(found)
            return
        self._act_on(read, report, found, raise_incident)

    def take_extras(self, read: Read) -> None:
        """The scalars read with the records: the clip norm and loss scale (step log, ledger), and a
        fused-AMP optimizer's ``found_inf`` (the update was skipped: AMP handled the step)."""
        step, steplog = read.step, self.steplog
        for what, value in read.extras.items():
            if what == "clip_norm":
                if steplog is not None:
                    steplog.clip_norm(step, value)
            elif what == "scale":
                self.ledger.scale_history.append((step, value))
                if steplog is not None:
                    steplog.scale(step, value)
            elif what == "found_inf":
                applied = value == 0
                read.handled = read.handled or not applied  # the fused kernel skipped the update
                if self.ledger.decide(step, applied):  # async: the step already ended
                    if steplog is not None:
                        steplog.decided(step, "applied" if applied else "skipped")
                else:
                    self.fused_applied[step] = applied

    def _act_on(self, read: Read, report, found: list, raise_incident: Optional[bool]) -> None:
        """The policy for a reported incident: the bundle (once), the log, then raise, warn or only
        record (``on_nonfinite``; ``raise_incident`` False warns, None records)."""
        capture_error = None
        try:
            if self.config.capture_dir is not None and self.capturer.bundle_path is None and report.phase != "eval":
                self._write_bundle(report)
        except Exception as e:  # the incident stays the primary finding; the capture failure is attached
            capture_error = e
            warn(f"nanscan could not write the bundle: {e!r}", RuntimeWarning, stacklevel=5)
        self.log_incidents(found)
        policy = self.config.on_nonfinite
        if policy == "record" or raise_incident is None:  # None: an earlier incident is raised
            return
        not_skipped = None  # (why a step that skip would take cannot be undone: raised instead)
        if policy == "skip" and raise_incident and self.before_update and self.skipper.allowed:
            not_skipped = self.skipper.cannot_undo(read.step, report)
            if not_skipped is None:
                self.skip_report = report
                return
        if policy == "warn" or not raise_incident or (policy == "skip" and not self.before_update):
            # (skip, outside the pre-update read: the step ended without an update to skip -- warned)
            warn(str(report) + self.findings.also(read, report), RuntimeWarning, stacklevel=5)
            return
        error = NonFiniteError(report)
        self.raised = True
        error.bundle_path = bundle_path = self.capturer.bundle_path
        if bundle_path:
            attach_note(error, f"nanscan wrote the failure bundle: {bundle_path}")
        if capture_error is not None:
            attach_note(error, f"nanscan could not write the bundle: {capture_error!r}")
        note = not_skipped or (limit_note(self.skipper) if policy == "skip" else None)
        if note is not None:
            attach_note(error, note)
        raise error

    def _check_headroom(self, read: Read) -> None:
        """Headroom of a landed read's rows (:meth:`HeadroomWatch.check`)."""
        try:
            self.headroom.check(read, self.steplog)
        except Exception as error:  # pragma: no cover - nanscan's own failure never stops training
            self.headroom = None
            warn(f"nanscan: the headroom check failed and is turned off: {error!r}", RuntimeWarning, stacklevel=5)

    def _observe_health(self, read: Read) -> None:
        """Telemetry's look at a read (:mod:`nanscan.monitor.health`)."""
        try:
            self.steplog.health.observe(read)
        except Exception as error:  # pragma: no cover - telemetry never stops training
            self.steplog.health.fail()
            if self.steplog.health.ranks is None:
                self.steplog.health = None
            warn(f"nanscan: telemetry failed and is turned off: {error!r}", RuntimeWarning, stacklevel=5)

    def _observe_spikes(self, read: Read) -> None:
        """The module outputs' numbers for the spike baselines (:mod:`nanscan.monitor.spikes`)."""
        try:
            self.spikes.observe(read)
        except Exception as error:  # pragma: no cover - nanscan's own failure never stops training
            self.spikes = self.steplog.spikes = None
            warn(f"nanscan: the spike warnings failed and are turned off: {error!r}", RuntimeWarning, stacklevel=5)

    def log_incidents(self, incidents) -> None:
        if self.steplog is not None:
            capturer = self.capturer
            for inc in incidents:
                self.steplog.incident(inc, capturer.bundle_path if inc.step == capturer.bundle_step else None)

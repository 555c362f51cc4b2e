"""What a landed :class:`~nanscan.monitor.read.Read` leads to, in order: the scalars read with the
records (clip norm, loss scale, a fused-AMP optimizer's ``found_inf``) into the ledger and the step
log; the findings (:mod:`~nanscan.monitor.findings`) and their agreement across ranks; the step log,
headroom and telemetry; then the policy for a reported incident -- the bundle (once), the log line,
and raise, warn or only record (``on_nonfinite``).

The read goes to the consumers in one list (:class:`~nanscan.monitor.consumers.ReadConsumer`: the
step log, headroom, telemetry, the spike baselines, in that order); none reaches back into the
monitor. A failure of one is nanscan's own: warned once, that consumer turned off, training goes on.
"""
from __future__ import annotations

from typing import Callable, Optional

from nanscan.guard import attach_note
from nanscan.monitor.config import WatchConfig
from nanscan.monitor.consumers import tell
from nanscan.monitor.findings import Findings
from nanscan.monitor.incident import Incident, NonFiniteError
from nanscan.monitor.ledger import Ledger
from nanscan.monitor.read import Read
from nanscan.monitor.skipping import StepSkipper, limit_note
from nanscan.monitor.stepcapture import StepCapture
from nanscan.monitor.steplog import StepLog
from nanscan.warn import warn

__all__ = ["Outcomes"]


class Outcomes:
    """What one monitor's reads lead to. ``consumers``: the read consumers, in order (the step log
    first: headroom writes into its steps); ``steplog`` (also one of them, or None) has the extras and
    the incidents written; ``write_bundle(incident)`` writes the failure bundle of the incident's
    step (the monitor's ``capture``)."""

    def __init__(self, config: WatchConfig, ledger: Ledger, findings: Findings, steplog: Optional[StepLog],
                 consumers: list, capturer: StepCapture, write_bundle: Callable[[Incident], str],
                 skipper: Optional[StepSkipper] = None):
        self.config, self.ledger, self.findings = config, ledger, findings
        self.steplog, self.consumers, self.capturer = steplog, list(consumers), capturer
        # A consumer walks the reads' rows (else a clean read is decided in its blocks: Note [a clean
        # read comes back as one number] in readback.py). (Kept when they are all turned off: the
        # rows are then copied for nobody, which costs time, never an answer.)
        self.rows_wanted = bool(self.consumers)
        self._write_bundle = write_bundle
        self.fused_applied: dict = {}  # step -> did a fused-AMP update apply (read before the update)
        self.raised = False  # a NonFiniteError was raised (close() then records, never raises)
        # on_nonfinite="skip": the monitor sets before_update around the read in the optimizer's step
        # pre-hook (the only read whose update can still be skipped); a reported incident there leaves
        # skip_report for it to act on.
        self.skipper = skipper
        self.before_update = False
        self.skip_report: Optional[Incident] = None

    def decide(self, read: Read, raise_incident: Optional[bool]) -> None:
        """Everything a read leads to; ``raise_incident`` False warns, None records silently."""
        if read.extras and self.take_extras(read.step, read.extras):
            read.handled = True  # the fused kernel skipped the update
        found = self.findings.judge(read)
        if self.consumers:
            tell(self.consumers, lambda consumer: consumer.observe(read))
        found, report = self.findings.agree(read, found)
        if report is None:
            if found:
                self.findings.add(found)
                self.log_incidents(found)
            return
        self.findings.add(found)
        self._act_on(read, report, found, raise_incident)

    def take_extras(self, step: int, extras: dict) -> bool:
        """The scalars read with the records of ``step``: the clip norm and loss scale (step log,
        ledger), and a fused-AMP optimizer's ``found_inf``; True when that says the update was skipped
        (AMP handled the step)."""
        steplog = self.steplog
        skipped = False
        for what, value in extras.items():
            if what == "clip_norm":
                if steplog is not None:
                    steplog.clip_norm(step, value)
            elif what == "scale":
                self.ledger.scale_history.append((step, value))
                if steplog is not None:
                    steplog.scale(step, value)
            elif what == "found_inf":
                applied = value == 0
                skipped = skipped or not applied
                if self.ledger.decide(step, applied):  # async: the step already ended
                    if steplog is not None:
                        steplog.decided(step, "applied" if applied else "skipped")
                else:
                    self.fused_applied[step] = applied
        return skipped

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

    def log_incidents(self, incidents) -> None:
        if self.steplog is not None and self.steplog.logging:
            capturer = self.capturer
            for inc in incidents:
                self.steplog.incident(inc, capturer.bundle_path if inc.step == capturer.bundle_step else None)

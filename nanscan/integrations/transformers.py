"""``nanscan`` in the HF ``Trainer``: one callback.

    from nanscan.integrations.transformers import NanscanCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[NanscanCallback()])

The callback calls :func:`nanscan.watch` on the Trainer's model and optimizer when training begins
(the optimizer exists by then; an ``accelerate`` wrapper is unwrapped to the torch optimizer its
hooks need) and closes the monitor when training ends (a run that ended by raising has its monitor closed
when the next run on the model begins: HF calls no callback on an exception). Keyword arguments go to ``watch``
(``capture_dir=``, ``log=``, ``allow=``, ``every=``, ...). The incident is ``callback.monitor.incident``;
with ``on_nonfinite="raise"`` (the default) the ``NonFiniteError`` stops ``trainer.train()``.
The loss HF models return (``output.loss``) is recorded as the loss. Not with
``TrainingArguments(torch_compile=True)``: the Trainer compiles the model before any callback runs,
and hooks added to a compiled model never run (``watch`` refuses it); use ``model = torch.compile``
after ``watch`` in your own loop instead.
"""
from __future__ import annotations

from typing import Optional

from transformers import TrainerCallback

import nanscan


class NanscanCallback(TrainerCallback):
    def __init__(self, **watch_options):
        self.watch_options = watch_options
        self.monitor: Optional[nanscan.Monitor] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.monitor is None and model is not None:
            _close_stale_monitor(model)
            self.monitor = nanscan.watch(model, optimizer, **self.watch_options)  # (watch unwraps accelerate's)
            self.monitor.opened_by_callback = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            monitor, self.monitor = self.monitor, None
            self.last_monitor = monitor
            monitor.close()


def _close_stale_monitor(model) -> None:
    """The Trainer calls no callback when ``train()`` ends by raising (a ``NonFiniteError`` among
    others), so a monitor a callback opened can outlive its run. A new run on the same model closes
    it -- after an incident it records and never raises again -- instead of failing "already
    watched". A monitor the user opened is left alone (``watch`` then says it is watched)."""
    from nanscan.monitor.torch_hooks import WATCHED as _WATCHED

    stale = _WATCHED.get(id(model))
    if stale is not None and getattr(stale, "opened_by_callback", False):
        try:
            stale.close()
        except nanscan.NonFiniteError:  # (its incident is in stale.incidents)
            pass

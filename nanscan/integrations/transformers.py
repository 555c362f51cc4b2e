"""``nanscan`` in the HF ``Trainer``: one callback.

    from nanscan.integrations.transformers import NanscanCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[NanscanCallback()])

The callback calls :func:`nanscan.watch` on the Trainer's model and optimizer when training begins
(the optimizer exists by then; an ``accelerate`` wrapper is unwrapped to the torch optimizer its
hooks need) and closes the monitor when training ends. Keyword arguments go to ``watch``
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
            optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
            self.monitor = nanscan.watch(model, optimizer, **self.watch_options)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            monitor, self.monitor = self.monitor, None
            self.last_monitor = monitor
            monitor.close()

"""Autocast as the model's modules see it, not as the root's hooks see it.

Note [autocast inside the forward]
Autocast is usually entered around the model (``with torch.autocast(...): loss = model(x)``), where
the root module's forward pre-hook sees it. Accelerate -- and so the HF Trainer with ``bf16=True`` or
``fp16=True`` -- instead replaces ``model.forward`` with an autocast-decorated function, and a class
may decorate its own ``forward`` with ``torch.autocast``: autocast begins after the root's hooks ran,
and a reading taken there says "off" for a step whose matmuls ran in bf16 (a bundle that says "replay
as recorded" would then replay in fp32). So when the root sees autocast off, the monitor arms this
probe: a global forward pre-hook that takes the reading again at the first module called inside the
root's forward, in the same thread, and removes itself. It costs one Python call per step, on steps
whose root saw no autocast (steps under an outer autocast cost nothing), and it only ever turns an
"off" reading into "on": a reading it cannot take (a model with no submodules) leaves the root's.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

_DEVICE_TYPES = ("cpu", "cuda")


def autocast_enabled(device_types=_DEVICE_TYPES) -> bool:
    """Autocast is on for one of ``device_types`` in this thread now."""
    for device_type in device_types:
        try:
            if torch.is_autocast_enabled(device_type):
                return True
        except Exception:  # a device type this torch does not know: no autocast there
            continue
    return False


class AutocastProbe:
    """One-shot reading of autocast inside the outermost forward (Note [autocast inside the forward])."""

    def __init__(self):
        self._handle = None
        self._thread: Optional[int] = None
        self._root = None
        self._seen: Optional[Callable[[], None]] = None

    def arm(self, root: torch.nn.Module, seen: Callable[[], None]) -> None:
        """Call ``seen()`` if autocast is on when the first module inside ``root``'s forward is
        called (in this thread); ``root``'s own next call disarms it."""
        self.disarm()
        self._thread, self._root, self._seen = threading.get_ident(), root, seen
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._fire)

    def _fire(self, module, args):
        if threading.get_ident() != self._thread:
            return None  # another thread's module: not this forward's
        seen = self._seen
        is_root = module is self._root
        self.disarm()
        if not is_root and seen is not None and autocast_enabled():
            try:
                seen()
            except Exception:  # a reading nanscan could not note must never stop the forward
                pass
        return None

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle, self._root, self._seen = None, None, None

"""How the monitor hears of a step's events: :class:`Triggers`, the one way the hooks outside the
monitor tell it something, and, where torch has no hook for an event, GradScaler's ``scale`` and
``step`` (wrapped on the scaler instance) and the closure of ``optimizer.step(closure)``. Each piece
only plumbs: what an event means is the monitor's (its StepState's) business.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["Triggers", "wrap_scaler", "wrap_closure"]


class Triggers:
    """The events the hooks outside :mod:`~nanscan.monitor.monitor` report to one monitor -- the one way
    in, so that no other file calls into the monitor's own methods. Each is a bound method of the
    monitor, named here once:

    * from the eager hooks (:mod:`~nanscan.monitor.eager`, called back by the C++ hooks):
      ``forward_begins(info, args, kwargs) -> phase or None`` (an outermost watched call starts: the
      monitor decides step and phase), ``forward_aborted()`` (it raised and the loop went on),
      ``forward_ends(info)``, ``model_returned_loss(output)`` (the root returned ``output["loss"]``);
    * from the process-wide wrappers (:mod:`~nanscan.monitor.torch_hooks`): ``backward_called(tensor)``
      (Note [the loss is what backward is called on]), ``higher_order()`` (a gradient taken with
      ``create_graph=True``), ``clipped(parameters, total_norm, norm_type)`` (Note [grad norm before
      clipping]), ``module_registered(parent, name, child)`` (Note [modules changed after watch])."""

    __slots__ = ("forward_begins", "forward_aborted", "forward_ends", "model_returned_loss", "backward_called",
                 "higher_order", "clipped", "module_registered")

    def __init__(self, **events: Callable):
        missing = [name for name in self.__slots__ if name not in events]
        unknown = sorted(set(events) - set(self.__slots__))
        if missing or unknown:
            raise TypeError(f"Triggers: missing {missing}, unknown {unknown}")
        for name, call in events.items():
            setattr(self, name, call)


class _Restore:
    """A handle that puts the scaler's own methods back (unless someone wrapped them again since)."""

    def __init__(self, scaler, wrappers: dict):
        self.scaler, self.wrappers = scaler, wrappers

    def remove(self) -> None:
        for name, wrapper in self.wrappers.items():
            if self.scaler.__dict__.get(name) is wrapper:
                delattr(self.scaler, name)


def wrap_scaler(scaler, scale: Callable, step: Callable) -> _Restore:
    """GradScaler has no hooks; two methods of this scaler instance are wrapped.

    ``scale(loss, original_scale)`` is called for ``scaler.scale(loss)`` of a one-element tensor
    (any other argument goes straight to the scaler's own). ``step(original_step, optimizer, args,
    kwargs)`` is called for ``scaler.step(optimizer, ...)``: when GradScaler skips the update,
    optimizer.step never runs, so the step would end unseen -- after the loop's ``zero_grad``
    dropped the gradients and ``scaler.update()`` changed the scale: the monitor ends it right
    there, with the unscaled gradients still in place. Returns the handle that unwraps them."""
    import torch

    original_step, original_scale = scaler.step, scaler.scale

    def scale_wrapper(outputs):
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            return scale(outputs, original_scale)
        return original_scale(outputs)

    def step_wrapper(optimizer, *args, **kwargs):
        return step(original_step, optimizer, args, kwargs)

    scaler.step, scaler.scale = step_wrapper, scale_wrapper
    return _Restore(scaler, {"step": step_wrapper, "scale": scale_wrapper})


def wrap_closure(optimizer, args: tuple, kwargs: dict, after: Callable[[], None]) -> Optional[tuple]:
    """For an optimizer step pre-hook: when the step was given a closure (``optimizer.step(closure)``:
    Lightning's automatic optimization, LBFGS), ``(args, kwargs)`` with that closure wrapped so that
    ``after()`` runs each time it returns -- after the forward and backward it runs, before the
    update --; None when there is no closure."""
    at = 1 if args and args[0] is optimizer else 0  # (torch passes the optimizer itself as args[0])
    closure = kwargs.get("closure") if "closure" in kwargs else (args[at] if len(args) > at else None)
    if not callable(closure):
        return None

    def closure_then(*c_args, **c_kwargs):
        result = closure(*c_args, **c_kwargs)
        after()
        return result

    if "closure" in kwargs:
        return args, dict(kwargs, closure=closure_then)
    return tuple(args[:at]) + (closure_then,) + tuple(args[at + 1:]), kwargs

"""``nanscan.watch(model, optimizer)``: checks what it is given, builds the :class:`WatchConfig`,
and starts a :class:`~nanscan.monitor.monitor.Monitor`; and the exit handler that reads what a monitor
left open still holds."""
from __future__ import annotations

import atexit
import inspect
from typing import Optional

import torch

from nanscan import _ops
from nanscan.monitor.config import WatchConfig
from nanscan.monitor.incident import NonFiniteError
from nanscan.monitor.monitor import Monitor
from nanscan.monitor.skipping import check_skip_can_protect
from nanscan.monitor.torch_hooks import WATCHED as _WATCHED
from nanscan.monitor.torch_hooks import install, unwrap
from nanscan.monitor.traced import drop_graphs_compiled_without_hooks, hold_hook_guards
from nanscan.warn import warn

__all__ = ["watch"]


@atexit.register
def _close_at_exit() -> None:
    """A monitor left open at exit still reads what it holds (async mode's last step, the last
    update): an incident there is printed, never lost silently."""
    for monitor in list(_WATCHED.values()):
        try:
            monitor.close()
        except NonFiniteError as error:
            import sys

            print(f"nanscan (at exit, monitor never closed): {error}", file=sys.stderr)
        except Exception as error:  # pragma: no cover - nothing may fail at exit
            import sys

            print(f"nanscan: closing a monitor at exit failed: {error!r}", file=sys.stderr)


def watch(model, optimizer=None, scaler=None, *, config: Optional[WatchConfig] = None, **options) -> Monitor:
    """Watch ``model`` for non-finite values, every ``every`` steps, cheaply enough to leave on.
    One call: the training loop needs no change (steps end at ``optimizer.step``; see
    :mod:`nanscan.monitor.monitor`).

    The keyword options are the fields of :class:`~nanscan.monitor.config.WatchConfig` (their
    meaning, defaults and accepted values are documented there; ``help(nanscan.watch)`` lists
    them): ``activations``, ``activation_grads``, ``compiled_grads``, ``grads``, ``params``,
    ``buffers``, ``optimizer_state``, ``every``, ``mode``, ``on_nonfinite``, ``allow``, ``backend``,
    ``capture_dir``, ``keep_pre_update_state``, ``log``, ``eval_forwards``, ``headroom_bits``,
    ``headroom_cast``. ``config``: a whole ``WatchConfig``; options given beside it replace its
    fields. Every option is validated here: a wrong type or value (or an unknown option) is a
    ``TypeError`` / ``ValueError`` naming what is accepted.

    Watch before ``torch.compile``. The loss is the tensor the step calls ``.backward()`` on
    (Note [the loss is what backward is called on]); the logged grad norm is the one before
    clipping (Note [grad norm before clipping]). ``optimizer`` may be accelerate's
    ``AcceleratedOptimizer`` (its torch optimizer, and its GradScaler when ``scaler`` is None, are
    used).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"nanscan.watch expects a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        raise ValueError("nanscan.watch: this model is already torch.compile-d; hooks added now would never "
                         "run inside the compiled graph. Call nanscan.watch(model) first, then torch.compile(model)")
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError("nanscan.watch: this model was compiled in place (model.compile()); hooks added now would "
                         "never run inside the compiled graph. Call nanscan.watch(model) first, then model.compile()")
    if not any(True for _ in model.parameters()):
        raise ValueError("nanscan.watch: the model has no parameters; there is nothing to train or watch")
    optimizer, scaler = unwrap(optimizer, scaler)
    if optimizer is not None and not (callable(getattr(optimizer, "register_step_pre_hook", None))
                                      and hasattr(optimizer, "param_groups")):
        raise TypeError(f"nanscan.watch: optimizer must be a torch.optim.Optimizer (or None), got "
                        f"{type(optimizer).__name__}: {optimizer!r}"[:300])
    if scaler is not None and not (callable(getattr(scaler, "step", None))
                                   and callable(getattr(scaler, "scale", None))):
        raise TypeError(f"nanscan.watch: scaler must be a torch.amp.GradScaler (or None), got "
                        f"{type(scaler).__name__}: {scaler!r}"[:300])
    if scaler is not None and optimizer is None:
        raise ValueError("nanscan.watch: a GradScaler needs the optimizer it steps: watch(model, optimizer, scaler). "
                         "(Without it nanscan cannot see whether scaler.step(optimizer) applied an update.)")
    config = WatchConfig.of(config, options)
    if config.backend is not None:
        _ops.resolve_backend(config.backend, next(model.parameters()).device)  # (an unknown one is a ValueError here)
    if config.on_nonfinite == "skip" and optimizer is None:
        raise ValueError("nanscan.watch: on_nonfinite='skip' skips the optimizer's update of a non-finite step, and "
                         "no optimizer was given: watch(model, optimizer, on_nonfinite='skip')")
    if config.on_nonfinite == "skip":
        check_skip_can_protect(model, optimizer, config.every)
    if id(model) in _WATCHED:
        raise ValueError("nanscan.watch: this model is already watched; close the first Monitor "
                         "(mon.close() or leave its `with` block) before watching it again")
    if config.activations:
        dropped = drop_graphs_compiled_without_hooks(model)
        if dropped:
            warn(f"nanscan.watch: dropped {dropped} torch.compile graph(s) of this model's classes compiled "
                          f"before this watch (dynamo does not guard on module hooks and would reuse them without "
                          f"this monitor's hooks); they recompile at the next call", RuntimeWarning, stacklevel=2)
    monitor = Monitor(model, optimizer, scaler, config)
    install()
    if config.activations:  # (Note [two instances of one class]; released by close)
        hold_hook_guards()
        monitor.holds_hook_guards = True
    _WATCHED[id(model)] = monitor
    return monitor


def _signature() -> inspect.Signature:
    """watch's signature as help() and IDEs show it: the options are WatchConfig's fields, keyword-only,
    with their defaults (written once, in the dataclass)."""
    import dataclasses

    positional = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
                  for n, d in (("model", inspect.Parameter.empty), ("optimizer", None), ("scaler", None))]
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(WatchConfig)]
    config = inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None)
    return inspect.Signature(positional + options + [config], return_annotation="Monitor")


watch.__signature__ = _signature()

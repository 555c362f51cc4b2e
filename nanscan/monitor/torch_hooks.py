"""Where the monitor meets torch outside the model's own hooks: the few torch entry points every
training loop goes through, wrapped once (at the first ``watch``) to tell every open monitor, and
the wrappers users pass in place of an optimizer. Each wrapper is the plain call while dynamo
traces, and a failure of nanscan's own there is warned about, never raised into training.

* ``Tensor.backward``: the loss (Note [the loss is what backward is called on]), and
  ``create_graph=True`` with ``torch.autograd.grad`` (a gradient penalty: :meth:`Monitor._higher_order`);
* ``torch.nn.utils.clip_grad_norm_``: the grad norm before clipping (Note [grad norm before clipping]);
* torch's module registration hook: modules set after ``watch`` (Note [modules changed after watch]).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from nanscan.warn import warn

WATCHED: dict = {}  # id(model) -> its open Monitor


def _tell(what: str, call) -> None:
    """``call(monitor)`` for every open monitor; a failure of nanscan's own is warned, never raised."""
    for monitor in list(WATCHED.values()):
        try:
            call(monitor)
        except Exception as error:
            warn(f"nanscan: {what} failed: {error!r}", RuntimeWarning)


def install() -> None:
    """Every wrapper, once per process."""
    _install_backward_hook()
    _install_clip_hook()
    _install_module_hook()


# Note [the loss is what backward is called on]: a watched training step's loss is recorded (phase
# "loss", its inputs the model's outputs) however the loop computes it -- inside the model (HF
# ``output.loss``), outside it (``F.cross_entropy(model(x), y) + penalty``), through
# ``accelerator.backward``, Lightning or HF Trainer: all of them end in ``Tensor.backward``, which
# is wrapped once, at the first ``watch``, to tell every open monitor. It records a floating
# scalar in a checked step; ``check_loss`` stays for the rare loop that calls
# ``torch.autograd.backward`` / ``torch.autograd.grad`` itself. While dynamo traces, the wrapper is
# the plain call (nothing of it enters a graph).
_original_backward = None


def _install_backward_hook() -> None:
    global _original_backward
    if _original_backward is not None:
        return
    _original_backward = original = torch.Tensor.backward
    compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        if WATCHED and not compiling():
            _tell("recording the loss at backward", lambda monitor: monitor.triggers.backward_called(self))
            if create_graph:
                _tell("noting a higher-order gradient", lambda monitor: monitor.triggers.higher_order())
        return original(self, gradient, retain_graph, create_graph, inputs)

    torch.Tensor.backward = backward
    original_grad = torch.autograd.grad

    @functools.wraps(original_grad)
    def grad(*args, **kwargs):
        if WATCHED and kwargs.get("create_graph") and not compiling():
            _tell("noting a higher-order gradient", lambda monitor: monitor.triggers.higher_order())
        return original_grad(*args, **kwargs)

    torch.autograd.grad = grad


# Note [grad norm before clipping]: the step log's ``grad_norm`` is the norm before clipping -- what
# HF Trainer and Lightning log. The gradients the monitor reads before the update are the clipped
# ones, so ``torch.nn.utils.clip_grad_norm_`` (which HF Trainer, accelerate and Lightning call by
# that name) is wrapped once, at the first ``watch``: the total norm it returns (a device scalar,
# no sync) is read with the step's records. Several calls in a step (one per parameter group)
# combine as the L2 norm of their norms. A norm other than L2 leaves the step's ``grad_norm``
# None (unknown), never the clipped value. A name imported before nanscan
# (``from torch.nn.utils import clip_grad_norm_``) is not wrapped: the log then has the clipped norm.
_original_clip = None


def _install_clip_hook() -> None:
    global _original_clip
    if _original_clip is not None:
        return
    _original_clip = original = torch.nn.utils.clip_grad_norm_
    compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):
        if not WATCHED or compiling():
            return original(parameters, max_norm, norm_type, *args, **kwargs)
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        total = original(parameters, max_norm, norm_type, *args, **kwargs)
        _tell("noting the gradient norm before clipping",
              lambda monitor: monitor.triggers.clipped(parameters, total, norm_type))
        return total

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def run_eagerly_as_frame(fn):
    """Have dynamo run ``fn`` -- and everything it calls -- eagerly whenever ``fn`` is a frame of its
    own, while still inlining it where it is called from code dynamo traces. Returns ``fn``.

    Why: nanscan's hooks are called by torch, and dynamo compiles every Python frame it is not told
    to skip. A module's forward hooks are frames of their own wherever ``Module._call_impl`` runs
    eagerly: the root's
    under ``torch.compile(model)``, and every module's in a forward that dynamo runs eagerly in part
    (a graph break it cannot resume inside a nested call -- transformers' models have several --,
    a frame past its recompile limit). Compiled there, a hook would be a graph of its own per
    module: recompiled at every module (it guards on the module's row) until dynamo's recompile
    limit, writing its rows from graphs whose notes describe one hook, not the module's forward --
    and the attribution named the wrong module. Run eagerly, a hook there is the eager hook: its
    records go into the eager window, placed among the compiled rows by the host's stamp count
    (Note [stamps counted on the host] in csrc/monitor/stamp_rows.cpp). Inlined into a graph that
    dynamo traces (a module called from compiled code), it takes the compiled path. The module
    registration hook (a model that sets a module in its forward) is host bookkeeping: never a
    graph either. (One call per code object is enough; closures share theirs.) Where this torch has
    no per-code execution strategy, nothing changes."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    except Exception:  # pragma: no cover - older torch
        pass
    return fn


# Note [modules changed after watch]: the hooks are installed on the modules the model had at watch.
# A module set later (a head replaced for fine-tuning, with ``optimizer.add_param_group``) has none:
# what it makes reaches its parent as a value nanscan never saw made, which the parent would be
# blamed for. torch's global module registration hook tells every open monitor; the parent's calls
# then say "cannot tell" (a flag of its C++ hook), its parameters are collected again at the step's
# end, and a warning says to watch again to watch the new module.
_module_hook_handle = None


def _install_module_hook() -> None:
    global _module_hook_handle
    if _module_hook_handle is not None:
        return

    @run_eagerly_as_frame
    def module_registered(parent, name, child):
        if WATCHED:
            _tell("noting a module set after watch",
                  lambda monitor: monitor.triggers.module_registered(parent, name, child))
        return None

    _module_hook_handle = torch.nn.modules.module.register_module_module_registration_hook(module_registered)


def _graph_nodes(node, limit: Optional[int] = None):
    """The nodes of the autograd graph from ``node``, each once (up to ``limit`` of them).

    Note [autograd nodes known by identity while alive]: a node's Python object lives only while
    something holds it -- ``next_functions`` makes a new one for a node whose old object was freed
    -- so an ``id`` outlives its object and can name another node later. The walk holds every node
    it has visited (``seen`` keeps them, not only their ids), so an id is one node for the whole
    walk; with ids alone a node was taken for one already visited (torch 2.11: a model's own loss
    was found not to reach its parameters)."""
    stack, seen = [node], {}
    while stack and (limit is None or len(seen) < limit):
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen[id(n)] = n
        yield n
        stack.extend(f for f, _ in getattr(n, "next_functions", ()))


def graph_has_compiled_function(node, limit: int = 4096) -> bool:
    """Whether an autograd graph holds a node of a compiled graph (``CompiledFunctionBackward``):
    asked only in a step whose forward recorded nothing, to tell a model compiled before it was
    watched (its hooks never run) from a loss of the parameters alone."""
    return any("CompiledFunction" in type(n).__name__ for n in _graph_nodes(node, limit))


def graph_reaches(node, variable_ids: frozenset) -> bool:
    """Whether an autograd graph from ``node`` accumulates into one of the tensors whose ids are
    ``variable_ids`` (a model's trainable parameters: their ``AccumulateGrad`` nodes). Walks the
    graph until it finds one -- at once for a loss of the model, the whole graph for another
    model's (asked only while several models are watched: Note [whose loss])."""
    for n in _graph_nodes(node):
        variable = getattr(n, "variable", None)
        if variable is not None and id(variable) in variable_ids:
            return True
    return False


def unwrap(optimizer, scaler):
    """The torch optimizer (and its GradScaler) inside a wrapper users pass as their optimizer --
    accelerate's ``AcceleratedOptimizer`` (``accelerator.prepare``): a torch ``Optimizer`` subclass
    that never ran ``Optimizer.__init__`` (no hooks of its own) and holds the real one as
    ``.optimizer`` and, with fp16, its scaler as ``.scaler``. Its ``step`` steps the inner
    optimizer (through the scaler), so the inner one's hooks see every update."""
    for _ in range(4):  # (a wrapper of a wrapper)
        inner = getattr(optimizer, "optimizer", None)
        if (optimizer is None or inner is None or inner is optimizer or "_optimizer_step_pre_hooks" in vars(optimizer)
                or not callable(getattr(inner, "register_step_pre_hook", None))):
            break
        if scaler is None and callable(getattr(getattr(optimizer, "scaler", None), "step", None)):
            scaler = optimizer.scaler
        optimizer = inner
    return optimizer, scaler

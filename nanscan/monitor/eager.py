"""Eager hooks: what the monitor records while a module runs outside a compiled graph.

Per module call, a forward pre-hook and a forward hook; per recorded module output that has an
autograd node, one pre-hook on that node (it receives the gradient flowing into the output): in
C++ with the default kernels (``csrc/monitor/grad_sink.cpp``: no Python in the backward), a Python
hook (:meth:`EagerHooks._on_grad`) otherwise. Each forward hook does only list / dict work and
queues the tensor in :class:`nanscan.monitor.slots.Slots` (summarized in batches): everything a
hook needs about its module (name, whether it works in place, the root flag) is in a
:class:`ModuleInfo` built once at ``watch``.

What is recorded, in production order:

* a module's output tensors (every floating / complex tensor in tuples, lists, dicts and
  ``ModelOutput``-like mappings, with their real shapes). An output that is one of the module's
  inputs or a child's output returned unchanged is not recorded twice.
* a module's input tensors that no earlier record explains: with a parent module running, such a
  tensor was made by an op in the parent's own body (a functional op, e.g. ``F.softmax`` in an
  attention module, feeding ``self.proj``): it is recorded as the *parent's* value, produced from
  the parent's inputs. Inputs of the outermost module are the batch (recorded for attribution,
  never an incident themselves).
* in the backward, the gradient flowing into each recorded output. The module whose backward made
  that gradient is the output's consumer: when exactly one module took the tensor as an input,
  the gradient is named after it (``produced`` there when the gradients of that consumer's
  outputs were finite); otherwise it is named ``"<producer> (output grad)"``.

Forwards that run inside a backward (activation checkpointing recomputing them) are not recorded:
they were recorded when they first ran.
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import Optional

import torch

from nanscan.monitor.slots import Slot

ROOT = "(model)"
_current_graph_task_id = torch._C._current_graph_task_id


def _run_eagerly_as_frame(fn):
    """Have dynamo run ``fn`` -- and everything it calls -- eagerly whenever ``fn`` is a frame of its
    own, while still inlining it where it is called from code dynamo traces.

    Why: ``torch.compile(model)`` calls the root module's hooks outside the compiled forward, each
    as a frame of its own, so a root hook that dynamo compiles adds a graph (3 graphs where the
    unwatched model has 1; default and ``fullgraph=True`` alike). Run eagerly there, the root hooks
    do the eager bookkeeping (the step, the batch) at no graph cost. Where the root is called from
    inside a compiled function (a compiled training step), its hooks are inlined and take the
    compiled path like every other module's. Where this torch has no per-code execution strategy,
    nothing changes (an extra graph, the same answers)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    except Exception:  # pragma: no cover - older torch
        pass
    return fn


class ModuleInfo:
    """What the hooks of one module need, computed once at ``watch``."""

    __slots__ = ("name", "module", "is_root", "inplace", "eager", "last_inputs", "last_outputs", "__weakref__")

    def __init__(self, name: str, module: torch.nn.Module, is_root: bool):
        self.name, self.is_root = name, is_root
        self.module = weakref.ref(module)
        # A module that overwrites its input (nn.ReLU(inplace=True), Dropout(inplace=True), ...):
        # queued records are summarized before it runs.
        self.inplace = bool(getattr(module, "inplace", False))
        self.eager = False  # its outputs were changed in place after its hook once: never batch them
        self.last_inputs: tuple = ()  # slot indices of the inputs / outputs of its last call this window
        self.last_outputs: tuple = ()


def _root_hooks(pre, post):
    """The root's hooks as functions with code objects of their own (see _run_eagerly_as_frame)."""

    def root_pre_hook(module, args, kwargs):
        return pre(module, args, kwargs)

    def root_post_hook(module, args, kwargs, output):
        return post(module, args, kwargs, output)

    return _run_eagerly_as_frame(root_pre_hook), _run_eagerly_as_frame(root_post_hook)


def float_tensors(value, prefix: str, out: list) -> list:
    """Append ``(label, tensor)`` for every floating / complex tensor inside ``value``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            out.append((prefix, value))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            float_tensors(v, f"{prefix}[{i}]", out)
    elif isinstance(value, dict) or (hasattr(value, "items") and hasattr(value, "keys")):
        for k, v in value.items():
            float_tensors(v, f"{prefix}.{k}", out)
    return out


class _Frame:
    """One running module call: its info and the slot indices of its inputs and outputs."""

    __slots__ = ("info", "inputs", "outputs")

    def __init__(self, info, inputs):
        self.info, self.inputs, self.outputs = info, inputs, ()


class EagerHooks:
    """Forward and backward hooks of one watched model. ``monitor`` provides ``slots`` (where to
    record), ``step_index``, ``_forward_begins`` / ``_forward_ends`` (step and phase decisions) and
    ``traced`` (the compiled path, which takes over inside ``torch.compile``)."""

    def __init__(self, monitor, infos: list, record_grads: bool):
        self.monitor = monitor
        self.infos = infos
        self.record_grads = record_grads
        self.stack: list = []  # running module calls (None for a call that is not recorded)
        # id(tensor) -> (weakref, version, slot index), per phase: eval forwards have slots of their own
        self._known: dict = {"forward": {}, "eval": {}}
        self.known: dict = self._known["forward"]
        self.slots = monitor.slots
        self.phase: Optional[str] = None  # "forward" / "eval" while an outermost call records, else None
        self.backward_seen = False  # a gradient was recorded since the step began
        self.recorded_forward = False  # a training forward was recorded in this read window
        self.root_outputs: tuple = ()

    def install(self) -> list:
        handles = []
        for info in self.infos:
            module = info.module()
            pre, post = self._pre_hook(info), self._post_hook(info)
            if info.is_root:
                pre, post = _root_hooks(pre, post)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        return handles

    def reset(self, phase: str = "forward") -> None:
        """A new read window of ``phase``: its earlier slot indices are void."""
        self._known[phase].clear()
        if phase == "eval":
            return
        self.stack.clear()
        self.backward_seen = False
        for info in self.infos:
            info.last_inputs = info.last_outputs = ()

    # --------------------------------------------------------------- tensor identity
    def _remember(self, t: torch.Tensor, index: int) -> None:
        self.known[id(t)] = (weakref.ref(t), None if t.is_inference() else t._version, index)

    # --------------------------------------------------------------- forward
    # The hooks run for every module call: locals instead of attribute lookups, the single-tensor
    # input / output handled without the generic walk, the tensor-identity map inlined.
    def _pre_hook(self, info: ModuleInfo):
        monitor, hooks = self.monitor, self
        alive, is_root, inplace = info.module, info.is_root, info.inplace
        is_compiling, Tensor = torch.compiler.is_compiling, torch.Tensor

        def pre_hook(module, args, kwargs):
            if is_compiling():
                return monitor.traced.write_inputs(info, args, kwargs)
            if module is not alive():  # a copy of the model (deepcopy, EMA) carries the hooks: not ours
                return None
            stack = hooks.stack
            if _current_graph_task_id() != -1:  # recomputed inside a backward (checkpointing)
                stack.append(None)
                return None
            if not stack or is_root:
                stack.clear()  # (frames a forward that raised left behind)
                hooks._begin(info, args, kwargs)
            phase = hooks.phase
            if phase is None:
                stack.append(None)
                return None
            if len(args) == 1 and not kwargs and type(args[0]) is Tensor:
                t = args[0]
                found = (("input[0]", t),) if (t.is_floating_point() or t.is_complex()) else ()
            else:
                found = float_tensors(args, "input", []) if args else []
                if kwargs:
                    float_tensors(kwargs, "input", found)
            inputs = []
            frame = _Frame(info, inputs)
            if found:
                slots, known = hooks.slots, hooks.known
                for label, t in found:
                    entry = known.get(id(t))
                    if entry is not None and entry[0]() is t and (entry[1] is None or entry[1] == t._version):
                        index = entry[2]
                        slot = slots.slots[index]
                        if slot.consumers is None:
                            slot.consumers = [frame]
                        else:
                            slot.consumers.append(frame)
                    else:
                        parent = stack[-1] if stack else None
                        if parent is not None:  # made by an op in the parent's own body
                            slot = Slot(monitor.step_index, phase, "activation", parent.info.name, t.dtype, t.shape,
                                        tuple(parent.inputs), True, parent.info)
                        else:  # the batch: recorded for attribution only
                            slot = Slot(monitor.step_index, phase, "activation", f"{info.name}.{label}", t.dtype,
                                        t.shape, (), False)
                        slot.consumers = [frame]
                        index = slots.add(t, slot)
                        hooks._remember(t, index)
                    inputs.append(index)
                if inplace:
                    slots.flush()
            stack.append(frame)
            return None

        return pre_hook

    def _begin(self, info, args, kwargs) -> None:
        """An outermost watched call starts: the monitor decides the phase (None: not recorded)."""
        self.phase = phase = self.monitor._forward_begins(info, args, kwargs)
        if phase is not None:
            self.slots = self.monitor.slots if phase == "forward" else self.monitor.eval_slots
            self.known = self._known[phase]
            if phase == "forward":
                self.recorded_forward = True

    def _post_hook(self, info: ModuleInfo):
        monitor, hooks = self.monitor, self
        alive, name, is_root = info.module, info.name, info.is_root
        is_compiling, Tensor = torch.compiler.is_compiling, torch.Tensor
        on_grad = self._on_grad
        sink, tap = monitor.grad_sink, monitor.tap

        def post_hook(module, args, kwargs, output):
            if is_compiling():
                return monitor.traced.write_outputs(info, output)
            if module is not alive():
                return None
            stack = hooks.stack
            if not stack:
                return None
            frame = stack.pop()
            if frame is None:  # a call that is not recorded
                return None
            if frame.info is not info:  # out of step: a forward raised and left its frames behind
                stack.clear()
                return None
            phase, slots, known = hooks.phase, hooks.slots, hooks.known
            inputs = frame.inputs  # (a list no one changes after the pre-hook)
            if type(output) is Tensor:
                found = (("", output),) if (output.is_floating_point() or output.is_complex()) else ()
            else:
                found = float_tensors(output, "", [])
            outputs, loss_slot = [], None
            record_grad = hooks.record_grads and phase == "forward"
            # The root's own outputs after a compiled forward: its eager record would precede the
            # graph's rows in production order, so it only serves attribution (the loss).
            candidate = not (is_root and monitor.traced.used)
            for label, t in found:
                entry = known.get(id(t))
                if entry is not None and entry[0]() is t and (entry[1] is None or entry[1] == t._version):
                    outputs.append(entry[2])  # an input or a child's output, returned unchanged
                    continue
                slot = Slot(monitor.step_index, phase, "activation", name + label if label else name, t.dtype, t.shape,
                            inputs, candidate, info)
                slot.late = not candidate
                if is_root and label == ".loss" and phase == "forward":  # HF-style: the model returns its loss
                    slot.phase, slot.kind, slot.name, loss_slot = "loss", "loss", "loss", slot
                index = slots.add(t, slot)
                hooks._remember(t, index)
                if record_grad:
                    if sink is not None:
                        tap(t, sink, index)  # C++: the gradient is queued and summarized without Python
                    else:
                        node = t.grad_fn
                        if node is not None:
                            node.register_prehook(partial(on_grad, index, t.output_nr, monitor.slots_generation))
                outputs.append(index)
            if loss_slot is not None:  # it was computed from the model's inputs and its other outputs
                loss_slot.inputs = tuple(inputs) + tuple(o for o in outputs if slots.slots[o] is not loss_slot)
                monitor._loss_ref = weakref.ref(output["loss"]) if isinstance(output, dict) else None
            frame.outputs = outputs
            info.last_inputs, info.last_outputs = inputs, outputs
            if info.eager:
                slots.flush()
            if not stack:  # the forward ends: summarize before the loop can edit its tensors in place
                slots.flush()
                if is_root:
                    hooks.root_outputs = tuple(outputs)
                monitor._forward_ends(info)
            return None

        return post_hook

    # --------------------------------------------------------------- backward
    def _on_grad(self, index: int, output_nr: int, generation: int, grad_outputs):
        """Pre-hook of the autograd node that made a recorded output: ``grad_outputs[output_nr]``
        is the gradient flowing into that output. (Registered as a ``functools.partial``: one
        small object per output per step, where a closure would be three -- allocations are what
        make Python's garbage collector run during the step.)"""
        monitor = self.monitor
        grad = grad_outputs[output_nr] if output_nr < len(grad_outputs) else None
        if grad is None or monitor._closed or monitor.slots_generation != generation:
            return None
        slots = monitor.slots
        forward = slots.slots[index]
        slot = Slot(monitor.step_index, "backward", "grad", f"{forward.name} (output grad)", grad.dtype,
                    grad.shape, (), True, forward.owner)
        slot.grad_of = index
        forward.grad = slots.add(grad, slot)
        self.backward_seen = True
        return None

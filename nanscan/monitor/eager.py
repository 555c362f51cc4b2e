"""Eager hooks: what the monitor records while a module runs outside a compiled graph.

Per module call, a forward pre-hook and a forward hook: Python wrappers of two lines around the C++
hooks (``csrc/monitor/hooks.h``), which do the work -- walk the inputs and outputs, keep the
tensor-identity map, make a row per record, hand the tensor to the read window
(:class:`nanscan._C.Window`: summarized in batches on a device, on arrival on the CPU) and tap its
gradient: per recorded module output that has an autograd node, one C++ pre-hook on that node
receives the gradient flowing into the output (``csrc/monitor/grad_sink.h``). No Python runs in
the backward; a row becomes a Python :class:`~nanscan.monitor.slots.Slot` only when a read is
decoded and asks for it (:class:`~nanscan.monitor.slots.EagerRows`). Everything the hooks need about a module (name,
whether it works in place, the root flag) is in a :class:`ModuleInfo` built once at ``watch``.
Why C++: on a GPU the host's Python time per module is on the critical path of every step
(``benchmarks/host_cost.py``).

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

import dataclasses
import enum
import types
import weakref
from typing import Optional

import torch
import torch.utils._pytree as pytree

from nanscan.monitor.torch_hooks import run_eagerly_as_frame

ROOT = "(model)"

# The hooks' "is this call being traced?" is torch.compiler.is_compiling() written out:
# is_dynamo_compiling() (dynamo folds it to True; in eager one trivial Python call, where
# is_compiling makes two) or the flag torch.export's non-strict tracing sets. Every hook asks it on
# every module call.
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


class ModuleInfo:
    """What the hooks of one module need, computed once at ``watch``; ``index`` is its position in
    the monitor's module list (the C++ hooks know a module by it)."""

    __slots__ = ("name", "module", "is_root", "inplace", "index", "row_base", "leaf", "__weakref__")

    def __init__(self, name: str, module: torch.nn.Module, is_root: bool, index: int = 0):
        self.name, self.is_root, self.index = name, is_root, index
        self.module = weakref.ref(module)
        # A module that overwrites its input (nn.ReLU(inplace=True), Dropout(inplace=True), ...):
        # queued records are summarized before it runs.
        self.inplace = bool(getattr(module, "inplace", False))
        self.row_base = 0  # its first row in the compiled path's buffer (set by TracedRows)
        self.leaf = False  # its traced inputs are stamped with its outputs (set by TracedRows)


def hooked(info: ModuleInfo) -> bool:
    """Whether a module gets hooks: all but ``nn.Identity`` (other than the root) and TorchScript
    modules. An Identity returns its input: it records nothing, makes no value and no gradient, and
    timm puts dozens in every model (layer scale, drop path, q/k norm when off), while each hooked
    module costs host time per step and dynamo time per compile. A ``torch.jit.script`` module
    takes no Python hooks: it is watched around -- its outputs are recorded where a watched module
    consumes them, as values made in its parent's body."""
    module = info.module()
    if isinstance(module, torch.jit.ScriptModule):
        return False
    return info.is_root or type(module) is not torch.nn.Identity


# Note [hooks on copies]: a module's hooks live in its ``_forward_pre_hooks`` / ``_forward_hooks``
# dicts, which ``copy.deepcopy`` and pickling copy with it. Each hook is a bound method of the
# closure that does the work on a :class:`_HookToken`, one per hooked module:
# * ``copy.deepcopy`` (EMA, teachers, ``AveragedModel``) copies a bound method as
#   ``MethodType(fn, deepcopy(token, memo))``, and ``copy._reconstruct`` puts a module's copy in
#   ``memo[id(module)]`` before it copies the module's ``__dict__`` (the hook dicts). The token's
#   ``__deepcopy__`` returns the token itself -- the copy holds the same hook ids -- and looks up,
#   among the modules it is on (the watched one and the copies made so far, so that a copy of a copy
#   is found too), the one being copied: it remembers that module's copy, weakly (the monitor keeps
#   no copy alive). While watched, the C++ hooks tell the copy from the watched module and record
#   nothing for it; ``close()`` removes the token's hook ids from every copy still alive: none
#   costs a hook call per module call afterwards.
# * ``pickle`` / ``torch.save`` of a watched model pickles the token, which unpickles as an
#   :class:`_Unhook` whose "hook" removes itself at its first call: a loaded model is unwatched
#   (the closures themselves cannot be pickled: a whole-model checkpoint would fail).
# * Copies nanscan could not see (a ``__dict__`` copied by hand; a deep copy of a copy made after
#   close): at close the closures' C++ entry points are replaced by a function that removes the
#   hooks from the module it is called on, so such a copy is unwatched after its first call.
# A deep copy that dynamo makes while it compiles (``deepcopy_to_fake_tensor`` of a module kept as
# a graph call) is remembered the same way: a weak reference, gone with the copy.

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _remove_hooks(module, ids) -> None:
    for attribute in _HOOK_DICTS:
        hooks = getattr(module, attribute, None)
        if hooks is not None:
            for hook_id in ids:
                hooks.pop(hook_id, None)


class _Unhook:
    """What a pickled nanscan hook becomes (Note [hooks on copies]): its first call removes it."""

    def __init__(self, ids):
        self.ids = tuple(ids)

    def __getattr__(self, name):  # (the bound method's name, looked up when unpickled)
        if not name.endswith("_hook"):
            raise AttributeError(name)

        def unhook(module, *args, **kwargs):
            _remove_hooks(module, self.ids)

        return unhook


class _HookToken:
    """The ``self`` of a nanscan hook: the hook ids of one module and the modules that hold them --
    the watched one and its deep copies (Note [hooks on copies])."""

    __slots__ = ("ids", "modules")

    def __init__(self, module: torch.nn.Module):
        self.ids: list = []  # the hook handle ids of one module
        self.modules: Optional[list] = [weakref.ref(module)]  # None once closed

    def __reduce__(self):
        return _Unhook, (self.ids,)

    def __deepcopy__(self, memo):
        modules = self.modules
        if modules is None:  # closed: a copy's hooks remove themselves at its first call
            return self
        # The module being copied is one of those alive (so its id is its own): its copy is in the
        # memo already. (Compared by identity: a module may define __eq__.)
        live = [m for m in (ref() for ref in modules) if m is not None]
        copies = [memo.get(id(m)) for m in live]
        copies = [c for c in copies if isinstance(c, torch.nn.Module) and all(c is not m for m in live)]
        if (copies or len(live) < len(modules)) and self.modules is modules:  # (not closed meanwhile)
            self.modules = [weakref.ref(m) for m in live + copies]  # (the dead ones dropped)
        return self

    def close(self) -> None:
        """Remove the hooks from every copy still alive; copies made later are not remembered."""
        modules, self.modules = self.modules, None
        for ref in modules or ():
            module = ref()
            if module is not None:  # (the watched module's hooks are gone with their handles)
                _remove_hooks(module, self.ids)


def _bound(fn, token):
    return types.MethodType(fn, token)


# Values that hold no tensor: an output made of them needs no walk (and is not "cannot tell").
_LEAVES = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis), slice, range, type, enum.Enum,
           torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType, torch.nn.Module)


def children(value) -> Optional[list]:
    """``(key, item)`` pairs of a module output of a type the C++ walk does not know (it knows
    tensors, tuples, lists, dicts and mappings), as torch's pytree would walk it: a dataclass's
    fields, a pytree-registered type's children (by position), another object's attributes
    (``vars()``: an HF ``DynamicCache`` and its layers' keys and values); ``[]`` for a value that
    holds no tensor; None for one nanscan cannot see into (a generator, an object with neither
    ``__dict__`` nor a known layout) -- the caller's values computed from it are then "cannot
    tell". Called by ``gather`` in csrc/monitor/walk.h, only for such values."""
    if isinstance(value, _LEAVES):
        return []
    if dataclasses.is_dataclass(value):
        return [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None:
        items, _ = node.flatten_fn(value)
        return list(enumerate(items))
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(value, types.GeneratorType):
        return list(attributes.items())
    return None


def float_tensors(value, prefix: str, out: list) -> list:
    """Append ``(label, tensor)`` for every floating / complex tensor inside ``value``. (The compiled
    path's walk: dynamo traces it. The C++ hooks walk the same way: ``gather`` in csrc/monitor/hooks.h.)"""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            out.append((prefix, value))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            float_tensors(v, f"{prefix}[{i}]", out)
    elif isinstance(value, dict) or (hasattr(value, "items") and hasattr(value, "keys")):
        for k, v in value.items():
            float_tensors(v, f"{prefix}.{k}", out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            float_tensors(getattr(value, f.name, None), f"{prefix}.{f.name}", out)
    return out


class EagerHooks:
    """Forward hooks of one watched model: per module a pre-hook and a hook, two-line Python
    wrappers around the C++ :class:`nanscan._C.Hooks` (``csrc/monitor/hooks.h``) that take the
    compiled path (:class:`nanscan.monitor.traced.TracedRows`) while dynamo traces them. The C++
    side calls back into this object for the rare events: an outermost call begins
    (:meth:`begin`: the monitor decides step and phase), a forward ends, the model returned its
    loss."""

    def __init__(self, monitor, infos: list, record_grads: bool, extension):
        self.monitor = monitor
        self.triggers = monitor.triggers  # (the events it reports: nanscan.monitor.triggers.Triggers)
        self.infos = infos
        self.recorded_forward = False  # a training forward was recorded in this read window
        self.cpp = extension.Hooks([i.name for i in infos], [i.module for i in infos], [i.is_root for i in infos],
                                   [i.inplace for i in infos], monitor.slots, monitor.eval_slots, monitor.grad_sink,
                                   self)
        self.cpp.record_grads = record_grads
        self._pre, self._post = self.cpp.fast_hooks()  # (plain C functions: no pybind11 dispatch per call)

    def install(self, handles: list) -> None:
        """Hooks on every hooked module; each handle goes into ``handles`` as it is made, so that a
        failure midway leaves the caller able to remove every hook already installed."""
        post_only = [False] * len(self.infos)
        installed = [info for info in self.infos if hooked(info)]
        for info in installed:
            post_only[info.index] = self._post_only(info, info.module())
        self.cpp.set_post_only(post_only)
        self._closures = []  # (closure, token): retargeted at close (Note [hooks on copies])
        for info in installed:
            module = info.module()
            token = _HookToken(module)
            pre, post = self._pre_hook(info), self._post_hook(info)
            self._closures += [(pre, token), (post, token)]
            pre, post = run_eagerly_as_frame(pre), run_eagerly_as_frame(post)
            if not post_only[info.index]:
                handles.append(module.register_forward_pre_hook(_bound(pre, token), with_kwargs=True))
                token.ids.append(handles[-1].id)
            handles.append(module.register_forward_hook(_bound(post, token), with_kwargs=True))
            token.ids.append(handles[-1].id)

    @staticmethod
    def _post_only(info: ModuleInfo, module: torch.nn.Module) -> bool:
        """A module hooked by its forward hook alone: a leaf (``info.leaf``: no hooked descendant,
        not the root, not in place, no gradient taps) whose class is torch.nn's own. Its inputs are
        then recorded after its forward (the C++ post does the pre-hook's work first), which is
        right only if the forward did not change them in place -- true of torch.nn's modules
        without an ``inplace`` flag, not known of user-defined ones (they keep the pre-hook).
        Saves one Python hook frame per call, in eager (host time) and under dynamo (compile
        time): most modules of real models are torch.nn leaves."""
        return info.leaf and type(module).__module__.startswith("torch.nn.modules.")

    def close(self) -> None:
        self.cpp.release()  # (the C++ side holds this object: the cycle ends here)
        # Deep copies of the model made while watched lose the hooks now; copies nanscan did not
        # see lose them at their first call (Note [hooks on copies]).
        for closure, token in getattr(self, "_closures", ()):
            token.close()

            def unhook(*args, ids=token.ids):
                _remove_hooks(args[1], ids)

            for name, cell in zip(closure.__code__.co_freevars, closure.__closure__ or ()):
                if name in ("pre", "post"):
                    cell.cell_contents = unhook
        self._closures = []

    @property
    def phase(self) -> Optional[str]:
        """``"forward"`` / ``"eval"`` while an outermost call records, else None."""
        return self.cpp.phase

    @property
    def root_outputs(self) -> tuple:
        """Entries of the root module's outputs in its last recorded call (the loss's inputs)."""
        return self.cpp.root_outputs

    def reset(self, phase: str = "forward") -> None:
        """A new read window of ``phase``: running calls of the old one are forgotten."""
        if phase == "forward":
            self.cpp.reset()

    # --------------------------------------------------------------- called back by the C++ hooks
    def begin(self, index: int, args, kwargs):
        """An outermost watched call starts: ``(phase, step)`` its records get, or None."""
        phase = self.triggers.forward_begins(self.infos[index], args, kwargs)
        if phase is None:
            return None
        if phase == "forward":
            self.recorded_forward = True
        return phase, self.monitor.step_index

    def forward_aborted(self) -> None:
        """The last outermost forward raised (the C++ side keeps its rows for attribution only)."""
        self.triggers.forward_aborted()

    def forward_ends(self, index: int) -> None:
        self.triggers.forward_ends(self.infos[index])

    def model_loss(self, output) -> None:
        """The root returned ``output["loss"]`` (recorded as the loss): ``check_loss`` of the same
        tensor must not record it twice."""
        self.triggers.model_returned_loss(output)

    # --------------------------------------------------------------- the hooks
    # Everything a call needs is bound once here: in eager a hook is one check and one C++ call.
    # While dynamo traces them, the common calls -- module(x) -> tensor -- take a fast path that is
    # one graph op (``nanscan::stamp``) and as few traced lines as possible: dynamo traces every line
    # of every hook at every module call, and that is most of a watched model's compile time
    # (benchmarks/compile_time.py). Everything else goes through TracedRows.write_*.
    def _pre_hook(self, info: ModuleInfo):
        traced, pre, index = self.monitor.traced, self._pre, info.index
        dynamo_compiling, compiler = _dynamo_compiling, torch.compiler
        stamp, Tensor, grad_enabled = torch.ops.nanscan.stamp, torch.Tensor, torch.is_grad_enabled
        row, owner = info.row_base, traced.owner
        many, fused = torch.ops.nanscan.summarize_many, traced.fused_records  # (records inductor fuses)

        if info.leaf:  # (its inputs are stamped by its hook, with its outputs)
            def pre_hook(_token, module, args, kwargs):
                if dynamo_compiling() or compiler._is_compiling_flag:  # (= torch.compiler.is_compiling())
                    return None
                pre(index, module, args, kwargs)
        else:
            def pre_hook(_token, module, args, kwargs):
                if dynamo_compiling() or compiler._is_compiling_flag:
                    if traced.stamping and len(args) == 1 and not kwargs and type(args[0]) is Tensor:
                        t = args[0]
                        if grad_enabled() and (t.is_floating_point() or t.is_complex()):
                            stamp([t], many([t]) if fused else None, owner, row, "")
                            if type(t.numel()) is not int:
                                traced.write_shape(row, t)
                        return None
                    return traced.write_inputs(info, args, kwargs)
                pre(index, module, args, kwargs)

        return pre_hook

    def _post_hook(self, info: ModuleInfo):
        traced, cpp, post, index = self.monitor.traced, self.cpp, self._post, info.index
        dynamo_compiling, compiler = _dynamo_compiling, torch.compiler
        stamp, Tensor, grad_enabled = torch.ops.nanscan.stamp, torch.Tensor, torch.is_grad_enabled
        row, owner = info.row_base + traced.INPUTS, traced.owner  # (its first output row)
        many, fused = torch.ops.nanscan.summarize_many, traced.fused_records  # (records inductor fuses)
        grad_hook = traced.grad_hook(info, 0) if traced.grad_hooks else None  # (the gradient into its output)

        if info.is_root:
            def post_hook(_token, module, args, kwargs, output):
                if dynamo_compiling() or compiler._is_compiling_flag:  # (= torch.compiler.is_compiling())
                    return traced.write_outputs(info, output)
                # After a compiled forward the root's eager records would precede the graph's rows
                # in production order: they only serve attribution (the loss).
                cpp.root_late = traced.used
                post(index, module, args, kwargs, output)
        elif info.leaf:
            def post_hook(_token, module, args, kwargs, output):
                if dynamo_compiling() or compiler._is_compiling_flag:
                    if traced.stamping and len(args) == 1 and not kwargs and type(args[0]) is Tensor \
                            and type(output) is Tensor and grad_enabled():
                        # The input into the last input row, the output into the first output row.
                        t, first, values = args[0], row, []
                        if t.is_floating_point() or t.is_complex():
                            first, values = row - 1, [t]
                        if output.is_floating_point() or output.is_complex():
                            values.append(output)
                            if grad_hook is not None and output.requires_grad:
                                output.register_hook(grad_hook)
                        if values:
                            # (one list is on one device: an input and output on two keep the op's own records)
                            fuse = fused and (len(values) == 1 or values[0].device == values[1].device)
                            stamp(values, many(values) if fuse else None, owner, first, "")
                            for k, v in enumerate(values):
                                if type(v.numel()) is not int:
                                    traced.write_shape(first + k, v)
                        return None
                    return traced.write_leaf(info, args, kwargs, output)
                post(index, module, args, kwargs, output)
        else:
            def post_hook(_token, module, args, kwargs, output):
                if dynamo_compiling() or compiler._is_compiling_flag:
                    if traced.stamping and type(output) is Tensor and grad_enabled():
                        if output.is_floating_point() or output.is_complex():
                            stamp([output], many([output]) if fused else None, owner, row, "")
                            if type(output.numel()) is not int:
                                traced.write_shape(row, output)
                            if grad_hook is not None and output.requires_grad:
                                output.register_hook(grad_hook)
                        return None
                    return traced.write_outputs(info, output)
                post(index, module, args, kwargs, output)

        return post_hook

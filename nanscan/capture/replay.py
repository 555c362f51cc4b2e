"""Replay a bundle and name the first *op* whose inputs were finite and whose output was not.

The search runs the step under a ``TorchDispatchMode`` that sees every aten op -- functional ops
inside modules included -- forward and backward. For each op it summarizes the outputs with
nanscan's own op, and only when an output is non-finite it summarizes the inputs: the first op
with finite inputs and a non-finite output is the answer. The module is the innermost module
running when the op ran (forward), or the module whose forward created the autograd node being
executed (backward; kept in the node's ``metadata``). The Python frame is the innermost frame
outside torch and nanscan, taken when the (forward) op ran. Replay is offline: it syncs the host
once per op, which is fine there and never happens on the training hot path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanscan.capture.bundle import Bundle, load_bundle, restore_rng
from nanscan.record import TensorSummary
from nanscan.summary import records

_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib))
_NANSCAN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_META_KEY = "nanscan_forward"


def _user_frame() -> Optional[str]:
    """``file:line in function`` of the innermost frame that is the user's code."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if f.startswith(_SKIP_DIRS) or frame.filename.startswith("<frozen") or (
                f.startswith(_NANSCAN_DIR) and os.path.basename(f) != "demo_model.py"):  # the demo's model is user code
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return None


def _float_tensors(value) -> list:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta"]


class _ModuleStack:
    """Which module is running: global forward pre/post hooks push and pop qualified names."""

    def __init__(self, model: torch.nn.Module):
        self.names = {m: (n or "(model)") for n, m in model.named_modules()}
        self.stack: list = []
        self.handles: list = []

    def __enter__(self):
        reg = torch.nn.modules.module
        self.handles = [reg.register_module_forward_pre_hook(self._push),
                        reg.register_module_forward_hook(self._pop)]
        return self

    def _push(self, module, args):
        if module in self.names:
            self.stack.append(self.names[module])

    def _pop(self, module, args, output):
        if module in self.names and self.stack:
            self.stack.pop()

    def current(self) -> Optional[str]:
        return self.stack[-1] if self.stack else None

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@dataclasses.dataclass
class FirstNonFinite:
    op: str
    phase: str
    module: Optional[str]
    stack: Optional[str]
    inputs: list
    outputs: list


class _FirstNonFiniteMode(TorchDispatchMode):
    def __init__(self, modules: _ModuleStack):
        super().__init__()
        self.modules = modules
        self.found: Optional[FirstNonFinite] = None
        self.backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Allocators (empty, empty_like, new_empty ...) return uninitialized memory that may hold
        # NaN bit patterns: they produce nothing, so they are never "the first non-finite op".
        if self.found is not None or func is torch.ops.aten.detach.default or "empty" in func.__name__:
            return out
        node = torch._C._current_autograd_node() if self.backward else None
        outs = _float_tensors(out)
        if not outs:
            return out
        out_recs = records(outs).tolist()
        if all(r[0] + r[1] + r[2] == 0 for r in out_recs):
            return out
        ins = _float_tensors((args, kwargs))
        in_recs = records(ins).tolist() if ins else []
        if any(r[0] + r[1] + r[2] > 0 for r in in_recs):
            return out  # propagated: not the first
        if self.backward:
            module, stack = (node.metadata.get(_META_KEY, (None, None)) if node is not None else (None, None))
        else:
            module, stack = self.modules.current(), _user_frame()
        self.found = FirstNonFinite(
            op=str(func), phase="backward" if self.backward else "forward", module=module, stack=stack,
            inputs=[TensorSummary.from_values(r, t.dtype, t.shape) for r, t in zip(in_recs, ins)],
            outputs=[TensorSummary.from_values(r, t.dtype, t.shape) for r, t in zip(out_recs, outs)])
        return out


class _TagNodes(TorchFunctionMode):
    """Above autograd (unlike the dispatch mode, whose outputs have no grad_fn yet): tags each new
    autograd node with the module and user frame that created it, so that an op of the backward
    pass can be traced back to its forward module."""

    def __init__(self, modules: _ModuleStack):
        super().__init__()
        self.modules = modules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        where = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and _META_KEY not in t.grad_fn.metadata:
                where = where or (self.modules.current(), _user_frame())
                t.grad_fn.metadata[_META_KEY] = where
        return out


@dataclasses.dataclass
class ReplayResult:
    """What a replay found. ``reproduced``: a non-finite value appeared (in an op or the result).
    ``first_op`` / ``module`` / ``phase`` / ``stack`` / ``inputs`` / ``outputs`` describe the first op
    with finite inputs and a non-finite output (None when not found, e.g. inside an inductor-compiled
    graph, which a dispatch mode cannot see). ``result``: summary of what ``forward`` returned.
    ``anomaly_error``: the message of ``detect_anomaly`` when ``anomaly=True`` and it fired."""

    reproduced: bool
    first_op: Optional[str]
    module: Optional[str]
    phase: Optional[str]
    stack: Optional[str]
    inputs: list
    outputs: list
    result: Optional[TensorSummary]
    precision: Optional[str]
    compile_backend: Optional[str]
    anomaly_error: Optional[str] = None
    # Batch tensors, parameters and buffers that were non-finite before the step ran: then no op
    # *made* the first non-finite value -- it came in with the bundle.
    nonfinite_before: list = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        how = f"precision={self.precision or 'as recorded'}, backend={self.compile_backend or 'eager'}"
        if not self.reproduced:
            return f"replay ({how}): did not reproduce; every value stayed finite"
        if self.first_op is None and self.nonfinite_before:
            names = ", ".join(self.nonfinite_before[:8]) + (" ..." if len(self.nonfinite_before) > 8 else "")
            return (f"replay ({how}): reproduced (result {self.result}); no op made the first non-finite value: "
                    f"it was already in the bundle before the step ran ({names})")
        if self.first_op is None:
            return (f"replay ({how}): reproduced (result {self.result}), first op not observable (inside a "
                    f"compiled graph, which a dispatch mode cannot see into)")
        ins = "; ".join(str(s) for s in self.inputs) or "no floating inputs"
        return (f"replay ({how}): first non-finite op {self.first_op} in {self.phase}, module "
                f"{self.module or '(outside any module)'}, at {self.stack or '?'}; inputs finite ({ins}); "
                f"output {self.outputs[0] if self.outputs else '?'}")


def _to(value, device, fp32: bool):
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.float() if fp32 and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, fp32) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, fp32) for k, v in value.items()}
    return value


def _autocast(manifest: dict, device: torch.device, precision: Optional[str]):
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    rec = (manifest.get("autocast") or {}).get(device.type) or {}
    if not rec.get("enabled"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, rec["dtype"]))


def prepare(bundle, model: torch.nn.Module, precision: Optional[str] = None):
    """Load the bundle's state into ``model`` (and restore the pre-step RNG); returns the bundle
    and its batch on the model's device. Shared by replay and bisect."""
    if precision not in (None, "fp32"):
        raise ValueError(f"precision must be None (as recorded) or 'fp32', got {precision!r}")
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    model.load_state_dict(b.model_state)
    if precision == "fp32":
        model.float()
    model.train(bool(b.manifest.get("training", True)))
    batch = dict(b.batch)
    batch["args"] = _to(b.batch["args"], device, precision == "fp32")
    batch["kwargs"] = _to(b.batch["kwargs"], device, precision == "fp32")
    inputs_of = (b.manifest.get("extra") or {}).get("inputs_of")
    if isinstance(inputs_of, str):
        batch["inputs_of"] = inputs_of
    restore_rng(b.rng)
    return b, batch, device


def default_forward(model, batch):
    """``model(*args, **kwargs)`` of the recorded batch -- or of the submodule whose inputs they are
    (``inputs_of`` in the manifest's ``extra``: the step's outermost watched call was a submodule's,
    as in a Lightning ``training_step`` calling ``self.net(x)``)."""
    target = model.get_submodule(batch["inputs_of"]) if batch.get("inputs_of") else model
    return target(*batch["args"], **batch["kwargs"])


def run_step(model, batch, forward: Optional[Callable], compile_backend: Optional[str]):
    def user_batch(b):  # the batch as the loop had it: a dict, one tensor, or a tuple
        if b.get("mapping"):
            return dict(b["kwargs"])
        return b["args"][0] if b.get("single") else tuple(b["args"])

    fn = (lambda m, b: forward(m, user_batch(b))) if forward else default_forward
    if compile_backend is not None:
        fn = torch.compile(fn, backend=compile_backend)
    return fn(model, batch)


def replay(bundle, model: torch.nn.Module, forward: Optional[Callable[[Any, Any], Any]] = None,
           precision: Optional[str] = None, compile_backend: Optional[str] = None,
           anomaly: bool = False, backward: bool = True) -> ReplayResult:
    """Re-run the bundle's step on ``model`` under the recorded conditions (state, mode, autocast,
    pre-step RNG) or changed ones (``precision="fp32"``, ``compile_backend="inductor"`` ...) and
    find the first non-finite op. ``forward(model, batch)`` returns the loss or the output
    (``batch`` is what was captured: the tensor, or the tuple of inputs); by default the model is
    called on the recorded args / kwargs. A scalar result that requires grad is back-propagated too
    (``backward=False`` to skip), so gradient faults are found. ``model``'s parameters are
    overwritten by the bundle's state."""
    b, batch, device = prepare(bundle, model, precision)
    before = _nonfinite_before(model, batch)
    modules = _ModuleStack(model)
    mode = _FirstNonFiniteMode(modules)
    anomaly_error = None
    anomaly_ctx = torch.autograd.detect_anomaly(check_nan=True) if anomaly else contextlib.nullcontext()
    result = None
    with modules:
        try:
            with anomaly_ctx:
                tagger = _TagNodes(modules) if compile_backend is None else contextlib.nullcontext()
                with tagger, mode, _autocast(b.manifest, device, precision):
                    result = run_step(model, batch, forward, compile_backend)
                if backward and isinstance(result, torch.Tensor) and result.requires_grad and result.numel() == 1:
                    mode.backward = True
                    with mode:
                        result.backward()
        except RuntimeError as e:
            if not anomaly:
                raise
            anomaly_error = str(e)  # detect_anomaly raises on the first NaN gradient: that is the finding
    outs = _float_tensors(result) if result is not None else []
    result_summary = None
    if outs:
        rec = records([outs[0].detach()]).tolist()[0]
        result_summary = TensorSummary.from_values(rec, outs[0].dtype, outs[0].shape)
    found = mode.found
    reproduced = found is not None or (result_summary is not None and not result_summary.is_finite) \
        or anomaly_error is not None
    return ReplayResult(
        reproduced=reproduced, first_op=found.op if found else None, module=found.module if found else None,
        phase=found.phase if found else None, stack=found.stack if found else None,
        inputs=found.inputs if found else [], outputs=found.outputs if found else [],
        result=result_summary, precision=precision, compile_backend=compile_backend, anomaly_error=anomaly_error,
        nonfinite_before=before)


def _nonfinite_before(model: torch.nn.Module, batch: dict) -> list:
    """Names of the batch's tensors (``batch.args[0]``, ``batch.input_ids``) and of the model's
    parameters and buffers holding a non-finite value before the step runs (one ``records`` call;
    offline, so the host sync is fine)."""
    named = []

    def walk(value, name):
        if isinstance(value, torch.Tensor):
            if (value.is_floating_point() or value.is_complex()) and value.device.type != "meta":
                named.append((name, value.detach()))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}[{i}]")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}")

    if batch.get("mapping"):
        walk(dict(batch["kwargs"]), "batch")
    else:
        walk(tuple(batch["args"]), "batch.args")
        walk(dict(batch["kwargs"]), "batch")
    named += [(n, t.detach()) for n, t in model.named_parameters()] + [
        (n, t.detach()) for n, t in model.named_buffers() if t.is_floating_point() or t.is_complex()]
    if not named:
        return []
    try:
        counts = records([t for _, t in named])[:, :3].sum(dim=1).tolist()
    except (TypeError, ValueError, RuntimeError):  # a dtype nanscan does not summarize: say nothing, never guess
        return []
    return [n for (n, _), c in zip(named, counts) if c > 0]

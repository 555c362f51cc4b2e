"""The model's tensors as the checks read them: :class:`ModelTensors`.

Parameters (those that require grad), their gradients, floating buffers and optimizer state: who
they are (collected once, again after ``model.to(...)`` or a module set after watch), which kernels
summarize them (the backend, on their device; shard-locally for DTensors), how their records join a
read window (runs of one launch each), and what a later window needs of an earlier read (which
gradients were read and which were non-finite, whether the forward was finite) to judge the
parameters and buffers recorded after the update.
"""
from __future__ import annotations

from typing import Optional

import torch

from nanscan import _ops
from nanscan.monitor import distributed
from nanscan.monitor.eager import ROOT
from nanscan.monitor.slots import Block, Slot, at

__all__ = ["ModelTensors"]


class ModelTensors:
    """The watched model's parameters, gradients and buffers (see the module docstring)."""

    def __init__(self, model, info_of: dict, extension, backend, *, buffers: bool):
        self.model, self.info_of, self._extension, self.backend = model, info_of, extension, backend
        self.watch_buffers = buffers
        self._kernels: dict = {}  # device -> (one, many)
        self.recollect = False  # a module was set after watch: collect again at the step's end
        self.grads_read: dict = {}  # step -> (names with a gradient read, names non-finite)
        self.forward_bad: dict = {}  # step -> whether its forward had a non-finite value
        self.collect()

    def collect(self) -> None:
        """The model's parameters and floating buffers, as the checks read them."""
        model = self.model
        first_name, self._first_param = next(iter(model.named_parameters()))
        self._where = (self._first_param.device, self._first_param.dtype)
        # How the first parameter is reached from the root: (the holder's _modules or _parameters,
        # key, value) per part of its name, so that follow_moves asks a few dicts instead of
        # walking every module.
        *path, leaf = first_name.split(".")
        self._first_chain, holder = [], model
        for key in path:
            child = holder._modules[key]
            self._first_chain.append((holder._modules, key, child))
            holder = child
        self._first_chain.append((holder._parameters, leaf, self._first_param))
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in self.named_params]
        self.all_param_names = frozenset(self.param_names)
        self.param_tensors = [p for _, p in self.named_params]
        # FSDP2 / tensor parallelism: DTensor parameters (and gradients, optimizer state) are
        # summarized shard-locally (distributed.local_shards). Decided once: plain models pay nothing.
        self.sharded = distributed.has_dtensors(self.param_tensors)
        self.param_owners = [self.info_of.get(n.rpartition(".")[0] or ROOT) for n in self.param_names]
        # Plain (unsharded) parameters are held in C++ for the per-step checks: one call each for
        # their records and their gradients' records (no Python list to convert, no Python object
        # per gradient). The kernels are those of the parameters' device now; a move collects again.
        self.param_ids = None  # (made when first asked: clip_grad_norm_ tells its parameters by identity)
        self.param_set = None
        if self.param_tensors and not self.sharded:
            self.param_set = self._extension.TensorSet(self.param_tensors, self.summarize_in_cpp())
        self.named_buffers = [(n, b, self.info_of.get(n.rpartition(".")[0] or ROOT)) for n, b in model.named_buffers()
                              if b.is_floating_point() or b.is_complex()] if self.watch_buffers else []

    def follow_moves(self) -> None:
        """After ``model.to(...)`` (device or dtype) the buffers are new tensors, and with
        ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` (or ``to_empty``) so are
        the parameters: the checks would read the old ones and miss what the new ones hold. Asked
        at every step end for the price of a few dict lookups (the first parameter, by its path from
        the root: a replaced module or parameter on that path, or a new device or dtype, is a
        move); a move collects them again. Not
        for sharded models: FSDP2 registers unsharded parameters in place of the sharded ones for
        a while; they are not a move."""
        if self.recollect:
            self.recollect = False
            self.collect()
            return
        if self.sharded:
            return
        for attributes, key, value in self._first_chain:  # (a few dict lookups, not a walk of the model)
            if attributes.get(key) is not value:
                break
        else:
            first = self._first_param
            if (first.device, first.dtype) == self._where:
                return
        if next(iter(self.model.parameters()), None) is not None:  # (a model left with no parameter: kept)
            self.collect()

    def device(self) -> torch.device:
        # (The first parameter, kept: model.to() moves a Parameter's data in place, so its device
        # stays current without walking model.parameters() at every step.)
        return self._first_param.device

    def kernels_for(self, device):
        kernels = self._kernels.get(device)
        if kernels is None:
            kernels = self._kernels[device] = _ops.kernels(self.backend, device)
        return kernels

    def summarize_in_cpp(self):
        """What the C++ side (read windows, gradient sink, parameter set) summarizes with: None for the
        default kernels on a plain model -- the op, called from C++ with no Python per batch --, else
        summarize_many below (another backend; a sharded model's DTensors, as local shards)."""
        many = self.kernels_for(self.device())[1]
        return None if many is torch.ops.nanscan.summarize_many.default and not self.sharded else self.summarize_many

    def summarize_many(self, xs: list) -> torch.Tensor:
        if self.sharded:  # (a DTensor module input or optimizer state: its local shard)
            xs = distributed.local_shards(xs)
        return self.kernels_for(xs[0].device)[1](xs)

    def record_update(self, slots, step: int, optimizer, *, optimizer_state: bool, params: bool) -> None:
        """Into the read window ``slots``: parameters (``params``) and floating buffers after the
        update (one launch group each), and on request (``optimizer_state``) the optimizer state;
        read with the next step's copy. A parameter's input is the gradient the update used, read
        (and decoded) a moment ago."""
        if optimizer_state:
            # Before the parameters: the update computed them from this state (Adam's moments), so a
            # non-finite state is the first place in production order, not the parameter it spoiled.
            names = {id(p): n for n, p in self.named_params}
            for p, state in optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1 and value.is_floating_point():
                        if self.sharded:
                            value = distributed.local_shards([value])[0]
                        name = f"{names.get(id(p), '?')}.{key}"
                        slots.add(value, Slot(step, "update", "optimizer_state", name, value.dtype, value.shape))
        if params and self.named_params:
            def input_bad(k, names=self.param_names):
                grads_read = self.grads_read.get(step)  # looked up when asked: async mode decodes late
                if grads_read is None or names[k] not in grads_read[0]:
                    return None  # no gradient was read for it in this step
                return (f"{names[k]} (grad)",) if names[k] in grads_read[1] else ()

            params = self.param_tensors
            if self.param_set is not None:
                rows = self.param_set.records()
            else:  # (sharded: each rank's local shards)
                params = distributed.local_shards(params)
                rows = self.summarize_many(params)
            slots.add_block(rows, Block(step, "update", "param", self.param_names, params,
                                        self.param_owners, input_bad=input_bad), len(params))
        self.record_buffers(slots, step)

    def record_buffers(self, slots, step: int) -> None:
        """Floating buffers after the update. They are produced by their module's forward (running
        statistics) or by the loop (EMA): produced when the step's forward was finite."""
        if not self.named_buffers:
            return
        forward_bad = self.forward_bad

        def input_bad(k):
            state = forward_bad.get(step)
            return None if state is None else (("the step's forward",) if state else ())

        tensors = [b for _, b, _ in self.named_buffers]
        slots.add_block(self.summarize_many(tensors),
                        Block(step, "update", "buffer", [n for n, _, _ in self.named_buffers], tensors,
                              [o for _, _, o in self.named_buffers], input_bad=input_bad), len(tensors))

    def grad_records(self, taken: Optional[tuple] = None):
        """The parameter gradients as they are now (final: accumulated, and unscaled if
        ``scaler.unscale_`` ran): ``(records, names, owners, grads)`` of the parameters that have one,
        or None. (The records only: :meth:`grad_block` makes their rows' Block, when a read needs
        its rows.) ``taken``: what ``TensorSet.grad_records`` returned already (a read taken in one
        call: Note [a clean read in one call] in csrc/monitor/lean_read.h)."""
        names, owners = self.param_names, self.param_owners
        sparse = None
        if self.param_set is not None:  # (C++: no Python per parameter)
            records, present, sparse = taken if taken is not None else self.param_set.grad_records()
            grads = self.param_tensors  # (a gradient's dtype and shape are its parameter's)
        else:  # sharded: each rank's local shards
            records = None
            grads, present = self._extension.param_grads(self.param_tensors)
        if present is not None:
            if not present:
                return None
            names = [names[k] for k in present]
            owners = [owners[k] for k in present]
            if self.param_set is not None:
                grads = [grads[k] for k in present]
        if sparse:  # a sparse gradient's record is of its (coalesced) values: their dtype and shape
            grads = list(grads)
            for position, values in sparse.items():
                grads[position] = values
        if records is None:
            grads = distributed.local_shards(grads)
            records = self.summarize_many(grads)
        return records, names, owners, grads

    def grad_names(self, names) -> frozenset:
        """The names of the gradients read (``names``, from :meth:`grad_records`) as a set."""
        return self.all_param_names if names is self.param_names else frozenset(names)

    def grad_block(self, step: int, taken: tuple, rows, explained: bool) -> Block:
        """The :class:`Block` of the parameter gradients ``taken`` by :meth:`grad_records`. A
        gradient's inputs: the gradients of its module's outputs and the module's forward inputs in
        this window (``rows``: the window's hook records, or None) -- when ``explained``: without
        the gradients of module outputs (or past a ``create_graph=True`` backward) the gradient a
        weight received is unknown, so it gets no inputs and "produced" is None rather than judged
        from the forward inputs alone."""
        _, names, owners, grads = taken

        def inputs(k):  # (asked only when a gradient is decoded as non-finite)
            owner = owners[k]
            return () if owner is None or rows is None else rows.rows.weight_inputs(owner.index)

        return Block(step, "backward", "grad", names, grads, owners, inputs=inputs if explained else None, param=True)

    def note_read(self, step: int, slots: list, grad_start: Optional[int], bad: set) -> None:
        """What later windows need of a landed training read of ``step`` (its ``slots``, the parameter
        gradients' block from ``grad_start`` if they were read, the non-finite rows ``bad``): which
        parameters had a gradient read (and which of those were non-finite) for the update records,
        and whether the forward was finite for the buffer records. Kept for the last few steps."""
        if grad_start is not None:
            s = slots[grad_start]
            bad_names = {s.names[i - s.start] for i in bad if s.start <= i < s.start + len(s.names)} if bad else set()
            self.grads_read[s.step] = (self.grad_names(s.names), bad_names)
        self.forward_bad[step] = bool(bad) and any(s.phase == "forward" and s.candidate
                                                   for s in (at(slots, i) for i in bad))
        self._forget_old_reads()

    def note_clean_read(self, step: int, grad_names) -> None:
        """:meth:`note_read` of a training read of ``step`` with nothing non-finite, whose parameter
        gradients ``grad_names`` (from :meth:`grad_records`; None: not read) were read."""
        if grad_names is not None:
            self.grads_read[step] = (self.grad_names(grad_names), set())
        self.forward_bad[step] = False
        if len(self.grads_read) > 6 or len(self.forward_bad) > 6:
            self._forget_old_reads()

    def _forget_old_reads(self) -> None:
        """All but the last three reads are forgotten (looked for once more than six are kept: a read
        adds one of each). Reads, not steps: with ``every=N`` the update of a read is decoded with
        the next read, N steps later (async mode: a read later still), and must find its step here
        -- kept by step distance, one read in six lost its gradients and said "cannot tell"."""
        for kept in (self.grads_read, self.forward_bad):
            if len(kept) > 6:
                for old in list(kept)[:-3]:  # (steps in the order read: the oldest first)
                    del kept[old]


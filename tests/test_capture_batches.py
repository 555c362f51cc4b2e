"""Failure bundles of batches that are not tensors or plain containers (issue 27, item 13): a
dataclass, an HF ``BatchEncoding`` (``model(**enc)`` and ``model(enc)``), a custom object, a
generator. The watched forward must never raise for them: the bundle keeps what it can (every
tensor, bit for bit, cloned before the forward), warns once per monitor, and names what it
converted (``batch_types``) or dropped (``batch_dropped``) in the manifest."""
import collections
import dataclasses
import enum
import json
import os
import warnings

import pytest
import torch
from torch import nn

import nanscan
from nanscan.capture import bundle as B

FAULT_SCALE = 1e4  # exp(lin(x) * 1e4) overflows: the forward itself makes the inf
OK_SCALE = 1e-2


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: torch.Tensor
    ids: list
    name: str = "train"


class Opaque:
    """A batch object of the user's that is neither a mapping nor a dataclass."""

    def __init__(self, x):
        self.x = x


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale):
        return torch.exp(self.lin(x) * scale)


class DataclassNet(nn.Module):  # model(batch), batch a dataclass
    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, batch):
        return self.body(batch.x, batch.scale)


class KwNet(nn.Module):  # model(**enc)
    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, input_ids=None, scale=None):
        return self.body(input_ids, scale)


class MappingNet(nn.Module):  # model(enc): reads it by key
    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, enc):
        return self.body(enc["input_ids"], enc["scale"])


class ExtraNet(nn.Module):  # model(x, meta, tokens=generator): uses x, ignores meta, consumes the generator
    def __init__(self):
        super().__init__()
        self.body = Body()
        self.consumed = []

    def forward(self, x, meta=None, tokens=None):
        if tokens is not None:
            self.consumed.append(list(tokens))
        return self.body(x, torch.full((8,), FAULT_SCALE if getattr(meta, "fault", False) else OK_SCALE))


class OpaqueNet(nn.Module):  # model(obj), obj a custom object
    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, obj):
        return self.body(obj.x, obj.scale)


def scale(step, fault_at):
    return torch.full((8,), FAULT_SCALE if step == fault_at else OK_SCALE)


def bits_equal(a, b):
    """Equal bit for bit (dtype, shape and every byte, NaN patterns included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def batch_warnings(caught, what):
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and what in str(w.message)]


def train(tmp_path, model, make_inputs, steps=4, fault_at=2):
    """A watched loop: ``model(*args, **kwargs)`` of ``make_inputs(step)``; after each backward the
    loop edits every tensor it gave in place (that must not reach the bundle). Returns the error,
    the monitor, the pristine copies of each step's inputs and the warnings."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path))
    originals, done = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(nanscan.NonFiniteError) as err, mon:
            for step in range(steps):
                args, kwargs, tensors = make_inputs(step)
                originals.append({k: t.clone() for k, t in tensors.items()})
                model(*args, **kwargs).sum().backward()
                for t in tensors.values():
                    t.zero_()  # in-place edit before the bundle is written (at opt.step)
                opt.step()
                opt.zero_grad()
                done.append(step)
    assert done == list(range(fault_at))  # every step trained; the planted inf is what stopped the run
    assert err.value.incident.step == fault_at and mon.bundle_path == err.value.bundle_path
    return err.value, mon, originals[fault_at], caught


# ------------------------------------------------------------------------------ (a) a dataclass
def test_dataclass_batch_trains_and_its_fields_are_kept(tmp_path):
    def make(step):
        b = Batch(x=torch.randn(4, 8), scale=scale(step, 2), ids=[step, torch.arange(3)])
        return (b,), {}, {"x": b.x, "scale": b.scale, "ids": b.ids[1]}

    error, mon, orig, caught = train(tmp_path, DataclassNet(), make)
    assert len(batch_warnings(caught, "dataclass")) == 1  # once per monitor, not once per step
    (message,) = batch_warnings(caught, "dataclass")
    assert "Batch" in str(message.message) and "as a dict" in str(message.message)
    assert not batch_warnings(caught, "cannot store")
    bundle = nanscan.load_bundle(mon.bundle_path)
    kept = bundle.inputs
    assert set(kept) == {"x", "scale", "ids", "name"} and kept["name"] == "train" and kept["ids"][0] == 2
    assert bits_equal(kept["x"], orig["x"]) and bits_equal(kept["scale"], orig["scale"])
    assert bits_equal(kept["ids"][1], orig["ids"])
    assert bundle.batch_types == {"args[0]": f"{Batch.__module__}.{Batch.__qualname__}"}
    assert bundle.batch_dropped == [] and bundle.manifest["batch_dropped"] == []
    # replay gets the fields as a dict; the loop's forward rebuilds the class
    torch.manual_seed(0)
    result = nanscan.replay(bundle, DataclassNet(), forward=lambda m, b: m(Batch(**b)).sum())
    assert result.reproduced and result.first_op == "aten.exp.default"


def test_dataclass_batch_given_to_mon_step(tmp_path):
    torch.manual_seed(0)
    model = DataclassNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path))
    b = Batch(x=torch.randn(4, 8), scale=scale(0, 0), ids=[])
    x = b.x.clone()
    with pytest.warns(RuntimeWarning, match="dataclass"), pytest.raises(nanscan.NonFiniteError), mon:
        with mon.step(b):
            model(b).sum().backward()
            opt.step()
    assert bits_equal(nanscan.load_bundle(mon.bundle_path).inputs["x"], x)


# ------------------------------------------------------------------------------ (b) BatchEncoding
@pytest.mark.parametrize("call", ["model(**enc)", "model(enc)"])
def test_batch_encoding_batch_trains_and_replays(tmp_path, call):
    BatchEncoding = pytest.importorskip("transformers").BatchEncoding

    model = KwNet() if call == "model(**enc)" else MappingNet()

    def make(step):
        enc = BatchEncoding({"input_ids": torch.randn(4, 8), "scale": scale(step, 2)})
        if call == "model(**enc)":
            return (), enc, dict(enc)  # the loop calls model(**enc)
        return (enc,), {}, dict(enc)

    error, mon, orig, caught = train(tmp_path, model, make)
    assert not batch_warnings(caught, "nanscan: the ")  # a mapping is kept whole: nothing to warn about
    bundle = nanscan.load_bundle(mon.bundle_path)
    kept = bundle.inputs
    assert type(kept) is dict and set(kept) == {"input_ids", "scale"}
    assert bits_equal(kept["input_ids"], orig["input_ids"]) and bits_equal(kept["scale"], orig["scale"])
    if call == "model(enc)":  # one positional input, replayed as model(dict)
        assert bundle.batch["single"] and not bundle.batch.get("mapping")
        assert bundle.batch_types == {"args[0]": "transformers.tokenization_utils_base.BatchEncoding"}
    else:  # keyword arguments, replayed as model(**dict)
        assert bundle.batch.get("mapping") and bundle.args == []
    torch.manual_seed(0)
    result = nanscan.replay(bundle, type(model)())  # the default replay makes the loop's call
    assert result.reproduced and result.first_op == "aten.exp.default"


def test_plain_dict_given_positionally_replays_as_one_input(tmp_path):
    # model(d), d a dict: stored as one positional input, so the default replay calls model(d), not model(**d)
    def make(step):
        d = {"input_ids": torch.randn(4, 8), "scale": scale(step, 1)}
        return (d,), {}, dict(d)

    error, mon, orig, caught = train(tmp_path, MappingNet(), make, fault_at=1)
    bundle = nanscan.load_bundle(mon.bundle_path)
    assert bundle.batch["single"] and bits_equal(bundle.inputs["input_ids"], orig["input_ids"])
    torch.manual_seed(0)
    assert nanscan.replay(bundle, MappingNet()).first_op == "aten.exp.default"


# ------------------------------------------------------------------------------ (c) custom objects
def test_custom_object_and_generator_are_dropped_the_tensors_kept(tmp_path):
    class Flag:
        def __init__(self, fault):
            self.fault = fault

    model = ExtraNet()

    def make(step):
        x = torch.randn(4, 8)
        return (x, Flag(step == 2)), {"tokens": (i * step for i in range(3))}, {"x": x}

    error, mon, orig, caught = train(tmp_path, model, make)
    assert model.consumed == [[0, 0, 0], [0, 1, 2], [0, 2, 4]]  # the generators reached the model whole
    (warned,) = batch_warnings(caught, "cannot store")  # one warning for the monitor, not one a step
    assert "Flag" in str(warned.message) and "generator" in str(warned.message) and "None" in str(warned.message)
    bundle = nanscan.load_bundle(mon.bundle_path)
    assert bits_equal(bundle.args[0], orig["x"]) and bundle.args[1] is None and bundle.kwargs == {"tokens": None}
    assert [d["path"] for d in bundle.batch_dropped] == ["args[1]", "kwargs.tokens"]
    assert bundle.batch_dropped[0]["type"].endswith("Flag") and bundle.batch_dropped[1]["type"] == "generator"


def test_whole_custom_object_batch_trains_and_is_dropped(tmp_path):
    class Obj:
        def __init__(self, step):
            self.x, self.scale = torch.randn(4, 8), scale(step, 1)

    for run in range(2):  # one warning per monitor: a second monitor warns again, once
        obj_model = OpaqueNet()
        error, mon, orig, caught = train(tmp_path / str(run), obj_model, lambda s: ((Obj(s),), {}, {}), fault_at=1)
        assert len(batch_warnings(caught, "cannot store")) == 1
        bundle = nanscan.load_bundle(mon.bundle_path)
        assert bundle.inputs is None and bundle.batch["single"]
        assert bundle.batch_dropped == [{"path": "args[0]", "type": f"{Obj.__module__}.{Obj.__qualname__}"}]


def test_unstorable_batch_never_raises_under_warnings_as_errors(tmp_path):
    torch.manual_seed(0)
    model = ExtraNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with nanscan.watch(model, opt, capture_dir=str(tmp_path)):
            for _step in range(3):
                model(torch.randn(4, 8), Opaque(None)).sum().backward()
                opt.step()
                opt.zero_grad()


# ------------------------------------------------------------------------------ the cloner and the manifest
def test_clone_forward_inputs_keeps_what_it_can():
    class Color(enum.IntEnum):
        RED = 1

    Pair = collections.namedtuple("Pair", "a b")
    t = torch.arange(4.0)
    loop = []
    loop.append(loop)  # refers to itself
    deep = t
    for _ in range(40):
        deep = [deep]
    kept = B.clone_forward_inputs((Pair(t, Color.RED), loop, deep), {"f": torch.float32})
    a, b = kept["args"][0]
    assert bits_equal(a, t) and a.data_ptr() != t.data_ptr() and type(b) is int and b == 1
    assert kept["args"][1] == [None]  # the self-reference
    assert kept["kwargs"] == {"f": None}
    dropped = {d["path"]: d["type"] for d in kept["dropped"]}
    assert dropped["args[1][0]"] == "list" and dropped["kwargs.f"] == "torch.dtype"
    assert any(p.startswith("args[2]") for p in dropped)  # deeper than a bundle may nest
    assert kept["types"]["args[0]"].endswith("Pair") and kept["types"]["args[0][1]"].endswith("Color")
    with pytest.raises(TypeError, match="cannot store a batch element"):  # the user's own calls stay strict
        B.clone_batch((t, Opaque(t)))


def test_deep_batch_bundle_still_loads(tmp_path):
    deep = torch.ones(2)
    for _ in range(40):
        deep = [deep]
    kept = B.clone_forward_inputs((torch.zeros(3), deep))
    path = B.write_bundle(str(tmp_path / "b"), batch=kept, rng=B.capture_rng(), model_state={})
    bundle = nanscan.load_bundle(path)
    assert bits_equal(bundle.args[0], torch.zeros(3)) and len(bundle.batch_dropped) == 1


def _rewrite_manifest(path, edit):
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    edit(manifest)
    manifest["digest"] = B.manifest_digest(manifest)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def test_manifest_batch_fields_are_checked_and_optional(tmp_path):
    kept = B.clone_forward_inputs((torch.ones(2), Opaque(1)))
    path = B.write_bundle(str(tmp_path / "b"), batch=kept, rng=B.capture_rng(), model_state={})
    assert not os.path.exists(os.path.join(path, "dropped"))
    assert set(torch.load(os.path.join(path, "batch.pt"), weights_only=True)) == {"args", "kwargs", "single"}
    assert nanscan.load_bundle(path).batch_dropped[0]["path"] == "args[1]"

    # a bundle written before the fields existed loads, with nothing dropped or converted
    _rewrite_manifest(path, lambda m: (m.pop("batch_dropped"), m.pop("batch_types")))
    old = nanscan.load_bundle(path)
    assert old.batch_dropped == [] and old.batch_types == {} and old.args[1] is None

    for field, value in (("batch_dropped", "args[1]"), ("batch_dropped", [{"path": 1, "type": "x"}]),
                         ("batch_types", {"args[0]": 3}), ("batch_dropped_total", -1)):
        _rewrite_manifest(path, lambda m, field=field, value=value: (
            m.pop("batch_dropped", None), m.pop("batch_types", None), m.pop("batch_dropped_total", None),
            m.__setitem__(field, value)))
        with pytest.raises(nanscan.BundleError, match=field):
            nanscan.load_bundle(path)


def test_a_manifest_lists_at_most_256_dropped_elements(tmp_path):
    kept = B.clone_forward_inputs(([Opaque(i) for i in range(300)], torch.ones(2)))
    path = B.write_bundle(str(tmp_path / "b"), batch=kept, rng=B.capture_rng(), model_state={})
    bundle = nanscan.load_bundle(path)
    assert len(bundle.batch_dropped) == 256 and bundle.manifest["batch_dropped_total"] == 300
    assert bundle.args[0] == [None] * 300 and bits_equal(bundle.args[1], torch.ones(2))
    assert "and 294 more" in B.batch_notices(kept)[0][1]

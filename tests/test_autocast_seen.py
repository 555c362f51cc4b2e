"""A bundle records the autocast its step actually ran under, wherever the loop entered it: around
the model, inside an Accelerate-wrapped forward (the HF Trainer with bf16=True), or in a forward the
class decorated itself."""
import json
import os

import pytest
import torch
from torch import nn

import nanscan


def _manifest(capture_dir):
    (bundle,) = os.listdir(capture_dir)
    with open(os.path.join(capture_dir, bundle, "manifest.json")) as f:
        return json.load(f)


class SelfCast(nn.Module):
    """A model whose class enters bf16 autocast in its own forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train_to_fault(model, tmp_path, around=None, steps=3, fault_step=1):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path))
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for step in range(steps):
            if step == fault_step:
                with torch.no_grad():
                    model.fc2.weight[0, 0] = float("nan")
            ctx = torch.autocast("cpu", dtype=around) if around is not None else torch.autocast("cpu", enabled=False)
            with ctx:
                out = model(torch.randn(4, 8))
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert err.value.incident.step == fault_step
    return _manifest(tmp_path)


def test_autocast_a_class_enters_in_its_own_forward_is_recorded(tmp_path):
    m = _train_to_fault(SelfCast(), tmp_path)
    assert m["autocast"]["cpu"] == {"enabled": True, "dtype": "bfloat16"}
    assert m["extra"]["autocast_entered"] == "inside the model's forward"


def test_autocast_around_the_model_is_recorded_as_before(tmp_path):
    model = SelfCast()
    model.forward = SelfCast.forward.__wrapped__.__get__(model)  # the undecorated forward: autocast comes from the loop
    m = _train_to_fault(model, tmp_path, around=torch.bfloat16)
    assert m["autocast"]["cpu"] == {"enabled": True, "dtype": "bfloat16"}
    assert "autocast_entered" not in m["extra"]


def test_no_autocast_is_recorded_as_off_and_the_probe_leaves_no_hook(tmp_path):
    model = SelfCast()
    model.forward = SelfCast.forward.__wrapped__.__get__(model)
    before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    m = _train_to_fault(model, tmp_path)
    assert m["autocast"]["cpu"]["enabled"] is False and "autocast_entered" not in m["extra"]
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == before


def test_accelerate_mixed_precision_bf16_is_recorded(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    torch.manual_seed(0)
    # (accelerate keeps one state per process and refuses another mixed precision: a test before
    # this one may have made an Accelerator without it)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    mon = nanscan.watch(inner, optimizer, capture_dir=str(tmp_path))
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    inner[2].weight[0, 0] = float("nan")
            out = model(torch.randn(4, 8))
            assert out.dtype == torch.float32  # (accelerate casts the output back: only the inside ran in bf16)
            accelerator.backward(out.pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    assert err.value.incident.step == 2
    m = _manifest(tmp_path)
    assert m["autocast"]["cpu"] == {"enabled": True, "dtype": "bfloat16"}
    assert m["extra"]["autocast_entered"] == "inside the model's forward"


def test_hf_trainer_bf16_bundle_says_autocast_on(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nanscan.integrations.transformers import NanscanCallback
    from tests.test_integrations import Batches, PlantInfWeight
    from tests.test_real_models import gpt2

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
        report_to=[], save_strategy="no", logging_steps=100, disable_tqdm=True, use_cpu=True, bf16=True,
        dataloader_num_workers=0, seed=0)
    callback = NanscanCallback(capture_dir=str(tmp_path / "cap"))
    with pytest.raises(nanscan.NonFiniteError) as err:
        transformers.Trainer(model=gpt2(), args=args, train_dataset=Batches(),
                             callbacks=[callback, PlantInfWeight(1)]).train()
    assert err.value.incident.name == "transformer.h.0.mlp.c_fc"
    callback.monitor.close()  # HF calls no callback on the exception: the monitor is still open
    m = _manifest(tmp_path / "cap")
    assert m["autocast"]["cpu"] == {"enabled": True, "dtype": "bfloat16"}
    assert m["extra"]["autocast_entered"] == "inside the model's forward"
    assert m["model_precision"]["converted"] == []  # fp32 weights: autocast, not a converted model


def _fsdp_bundle(rank, world, out_dir):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from nanscan.capture.bundle import load_bundle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    path = nanscan.capture_bundle(os.path.join(out_dir, "b"), model=model, batch=torch.randn(4, 8))
    return load_bundle(path).manifest["model_precision"]


def test_fsdp2_mixed_precision_policy_is_recorded(tmp_path):
    # FSDP2 keeps fp32 shards and computes in the policy's bf16: the dtypes of the stored parameters
    # alone would say fp32.
    from tests import ranks

    (precision,) = ranks.spawn(_fsdp_bundle, 1, tmp_path, str(tmp_path))
    assert precision["param_dtypes"] == {"float32": 8 * 16 + 16 + 16 + 1}
    expected = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None,
                "cast_forward_inputs": True}
    assert precision["fsdp_mixed_precision"] == {"(model)": expected, "0": expected}

"""One-call integrations: the HF Trainer callback on a tiny GPT-2, clean and with a planted fault
(an infinite weight in a named module at step 1)."""
import pytest
import torch

import nanscan

transformers = pytest.importorskip("transformers")


class Batches(torch.utils.data.Dataset):
    """A tiny LM dataset."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class PlantInfWeight(transformers.TrainerCallback):
    """Before training step `step`, one weight of `transformer.h.0.mlp.c_fc` becomes +inf."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")


def trainer(tmp_path, callbacks, **arguments):
    from tests.test_real_models import gpt2

    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                   report_to=[], save_strategy="no", logging_steps=100, disable_tqdm=True, use_cpu=True,
                   dataloader_num_workers=0, seed=0)
    args = transformers.TrainingArguments(**{**options, **arguments})
    return transformers.Trainer(model=gpt2(), args=args, train_dataset=Batches(), callbacks=callbacks)


def test_hf_trainer_callback_clean_run(tmp_path):
    from nanscan.integrations.transformers import NanscanCallback

    callback = NanscanCallback()
    trainer(tmp_path, [callback]).train()
    mon = callback.last_monitor
    assert mon.incidents == [] and mon.ledger.attempted == 3 and mon.ledger.applied == 3


def test_hf_trainer_callback_names_the_planted_fault(tmp_path):
    from nanscan.integrations.transformers import NanscanCallback

    callback = NanscanCallback()
    with pytest.raises(nanscan.NonFiniteError) as err:
        trainer(tmp_path, [callback, PlantInfWeight(1)]).train()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (
        1, "forward", "transformer.h.0.mlp.c_fc", "activation", True)
    callback.monitor.close()  # HF calls no callback on the exception: the monitor is still open


def test_accelerate_recipe_from_the_readme():
    # README, "Accelerate": watch the unwrapped model, the torch optimizer inside accelerate's
    # wrapper and accelerate's GradScaler (None without fp16), after accelerator.prepare.
    accelerate = pytest.importorskip("accelerate")
    from torch import nn

    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=4))
    mon = nanscan.watch(accelerator.unwrap_model(model), optimizer.optimizer, accelerator.scaler)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for step, (x, y) in enumerate(loader):
            if step == 3:
                with torch.no_grad():
                    accelerator.unwrap_model(model)[2].weight[0, 0] = float("nan")
            loss = (model(x) - y).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (3, "forward", "2", "activation", True)
    assert mon.ledger.applied == 3


def test_hf_trainer_callback_after_a_nonfinite_error_a_new_run_on_the_model_is_watched(tmp_path):
    from nanscan.integrations.transformers import NanscanCallback

    first = trainer(tmp_path, [NanscanCallback(), PlantInfWeight(1)])
    with pytest.raises(nanscan.NonFiniteError):
        first.train()  # HF calls no callback on the exception: the monitor stays open
    model = first.model
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = 0.0
    callback = NanscanCallback()
    args = first.args
    transformers.Trainer(model=model, args=args, train_dataset=Batches(), callbacks=[callback]).train()
    mon = callback.last_monitor
    assert mon.incidents == [] and mon.ledger.applied == 3
    user = nanscan.watch(model)  # the callback's monitors are all closed
    with pytest.raises(ValueError, match="already watched"):
        NanscanCallback().on_train_begin(args, None, None, model=model)  # a user's monitor is left alone
    user.close()


def test_hf_trainer_telemetry_reaches_report_to_at_the_trainers_steps(tmp_path, monkeypatch):
    # telemetry="trainer": every report_to integration gets the points in its on_log, at the global
    # step of the step they describe -- the same step the Trainer logs that step's loss at.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nanscan.integrations.transformers import NanscanCallback

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    callback = NanscanCallback(telemetry="trainer", telemetry_every=1)
    run = trainer(tmp_path, [callback], report_to=["tensorboard"], logging_steps=1)
    run.train()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/nanscan/loss", "train/nanscan/rms/transformer.h.0.mlp.c_fc",
            "train/nanscan/grad_norm/transformer.h.0.mlp.c_fc.weight"} <= tags, sorted(tags)[:20]
    ours = {e.step: e.value for e in acc.Scalars("train/nanscan/loss")}
    theirs = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(ours) == [1, 2, 3] == sorted(theirs)
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5)
    assert all(not any(k.startswith("nanscan/") for k in entry) for entry in run.state.log_history)


def test_hf_trainer_telemetry_without_a_reporting_integration_refuses_to_start(tmp_path):
    from nanscan.integrations.transformers import NanscanCallback

    with pytest.raises(ValueError, match="report_to"):
        trainer(tmp_path, [NanscanCallback(telemetry="trainer")]).train()


class PlantNaNOutput(transformers.TrainerCallback):
    """At training step ``step`` only, ``transformer.h.0.mlp.c_fc``'s output becomes NaN (a passing
    fault: the next steps are clean)."""

    def __init__(self, step):
        self.step, self.handle = step, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if state.global_step == self.step:
            self.handle = model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: o * float("nan"))


def test_hf_trainer_survives_a_nonfinite_step_with_skip_and_keeps_the_bundle(tmp_path):
    from nanscan.integrations.transformers import NanscanCallback

    callback = NanscanCallback(on_nonfinite="skip", capture_dir=str(tmp_path / "bundles"))
    run = trainer(tmp_path, [callback, PlantNaNOutput(1)])
    with pytest.warns(RuntimeWarning, match="skipped the update of step 1"):
        run.train()
    mon = callback.last_monitor
    assert mon.ledger.skipped_steps == [1] and mon.ledger.applied == 2
    # The NaN comes from a forward hook added after watch's: c_fc's output was finite when nanscan read
    # it, so the value was produced inside the MLP's forward, by none of its watched children.
    assert (mon.incident.step, mon.incident.name, mon.incident.produced) == (1, "transformer.h.0.mlp", True)
    assert mon.bundle_path is not None and "step000001" in mon.bundle_path
    assert run.state.global_step == 3  # the Trainer counts the skipped step as taken (its batch is consumed)
    assert all(torch.isfinite(p).all() for p in run.model.parameters())

"""The Lightning callback (nanscan.integrations.lightning) on a tiny LightningModule: clean runs,
planted faults in a named module (forward, backward-only, loss), 32-bit and bf16-mixed precision.
Lightning's automatic optimization runs the forward and backward inside optimizer.step(closure):
the incident must still name the step and stop it before its update."""
import pytest
import torch
from torch import nn

import nanscan

pl = pytest.importorskip("lightning.pytorch")


class Sq(nn.Module):
    """Identity in the forward; when ``fault`` is set, x + sqrt(x * 0): finite forward, NaN gradient."""

    def __init__(self):
        super().__init__()
        self.fault = False

    def forward(self, x):
        return x + torch.sqrt(x * 0.0) if self.fault else x


class Tiny(pl.LightningModule):
    def __init__(self, loss_fault_step=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), Sq(), nn.Linear(16, 1))
        self.loss_fault_step = loss_fault_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)  # (Lightning code often calls submodules, not self(...))
        loss = (out - y).pow(2).mean()
        if self.global_step == self.loss_fault_step:
            loss = torch.log(loss - 1e6)  # the loss itself goes NaN
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class Plant(pl.Callback):
    """Before training step ``step``: ``kind`` "weight" makes a weight of net.2 +inf, "backward" turns
    on the backward-only fault in net.3."""

    def __init__(self, step, kind):
        self.step, self.kind = step, kind

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            if self.kind == "weight":
                with torch.no_grad():
                    pl_module.net[2].weight[0, 0] = float("inf")
            else:
                pl_module.net[3].fault = True


def loader():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(callbacks, max_steps=5, precision="32-true", module=None):
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, num_sanity_val_steps=0)
    module = module or Tiny()
    trainer.fit(module, loader())
    return module


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_clean_fit_has_no_incident_and_every_step_applied(precision):
    from nanscan.integrations.lightning import NanscanCallback

    callback = NanscanCallback()
    fit([callback], precision=precision)
    mon = callback.last_monitor
    assert mon is not None and callback.monitor is None  # closed at the end of fit
    assert mon.incidents == [] and mon.ledger.attempted == 5 and mon.ledger.applied == 5


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_planted_weight_overflow_is_named_and_its_update_never_applied(precision):
    from nanscan.integrations.lightning import NanscanCallback

    callback = NanscanCallback()
    module = Tiny()
    with pytest.raises(nanscan.NonFiniteError) as err:
        fit([callback, Plant(2, "weight")], precision=precision, module=module)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (2, "forward", "net.2", "activation", True)
    mon = callback.last_monitor
    assert mon.ledger.applied == 2  # steps 0 and 1; step 2 was stopped before its update
    assert torch.isfinite(module.net[0].weight).all()  # no non-finite update reached the weights


def test_backward_only_fault_is_named_inside_the_closure():
    from nanscan.integrations.lightning import NanscanCallback

    callback = NanscanCallback()
    with pytest.raises(nanscan.NonFiniteError) as err:
        fit([callback, Plant(3, "backward")])
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (3, "backward", "net.3", "grad", True)


def test_the_loss_lightning_backpropagates_is_recorded_as_the_loss():
    from nanscan.integrations.lightning import NanscanCallback

    callback = NanscanCallback()
    with pytest.raises(nanscan.NonFiniteError) as err:
        fit([callback], module=Tiny(loss_fault_step=1))
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (1, "loss", "loss", "loss", True)


def test_a_closure_step_without_lightning_is_read_after_the_closure():
    # The same mechanism on a plain loop: optimizer.step(closure) (LBFGS style).
    model = nn.Sequential(nn.Linear(4, 4), Sq(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    with pytest.raises(nanscan.NonFiniteError) as err, nanscan.watch(model, opt) as mon:
        for step in range(4):
            model[1].fault = step == 2

            def closure():
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind) == (2, "backward", "1", "grad")
    assert mon.ledger.applied == 2


def test_fp16_mixed_precision_uses_the_trainers_grad_scaler():
    # fp16 AMP is not offered on CPU by name; the MixedPrecision plugin with a CPU GradScaler is the
    # same code path as "16-mixed" on a GPU (scaler.scale / unscale_ / step / update).
    from lightning.pytorch.plugins.precision import MixedPrecision

    from nanscan.integrations.lightning import NanscanCallback

    callback = NanscanCallback()
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback, Plant(2, "weight")],
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    with pytest.raises(nanscan.NonFiniteError) as err:
        trainer.fit(Tiny(), loader())
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.name, inc.kind, inc.produced) == (2, "forward", "net.2", "activation", True)
    mon = callback.last_monitor
    assert mon.scaler is trainer.precision_plugin.scaler
    # The first steps' gradient overflow (scale 65536 in fp16) is GradScaler's to handle: recorded, not raised.
    assert all(i.handled_by_scaler for i in mon.incidents if i.step < 2)
    ledger = mon.ledger
    assert ledger.attempted == 3 and 2 in ledger.skipped_steps  # step 2 was stopped before its update
    assert ledger.applied == 3 - len(ledger.skipped_steps)


def test_capture_keeps_the_inputs_of_the_submodule_training_step_calls_and_replay_uses_them(tmp_path):
    # Tiny.training_step calls self.net(x), not self(x): the root's forward never runs.
    from nanscan.integrations.lightning import NanscanCallback

    callback = NanscanCallback(capture_dir=str(tmp_path))
    module = Tiny()
    with pytest.raises(nanscan.NonFiniteError) as err:
        fit([callback, Plant(2, "weight")], module=module)
    path = err.value.bundle_path
    assert path is not None
    bundle = nanscan.load_bundle(path)
    assert bundle.manifest["extra"]["inputs_of"] == "net"
    x = bundle.batch["args"][0]
    assert x.shape == (4, 8)
    result = nanscan.replay(path, Tiny())  # (Tiny has no forward: replay must call net, as the step did)
    assert result.reproduced and result.nonfinite_before == ["net.2.weight"]  # the planted +inf, before the step


class LogsLoss(Tiny):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss


def test_telemetry_reaches_the_trainers_loggers_at_the_steps_lightning_logs(tmp_path):
    import csv

    from nanscan.integrations.lightning import NanscanCallback

    csv_logger = pl.loggers.CSVLogger(str(tmp_path), name="run", version=0)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=csv_logger, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[NanscanCallback(telemetry="trainer", telemetry_every=1)])
    trainer.fit(LogsLoss(), loader())
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    ours = {int(r["step"]): float(r["nanscan/loss"]) for r in rows if r.get("nanscan/loss")}
    theirs = {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}
    assert sorted(ours) == [0, 1, 2, 3] == sorted(theirs)
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-6)
    assert any(r.get("nanscan/rms/net.2") for r in rows) and any(r.get("nanscan/grad_norm/net.2.weight") for r in rows)


def test_telemetry_through_a_trainer_without_a_logger_refuses_to_start():
    from nanscan.integrations.lightning import NanscanCallback

    with pytest.raises(ValueError, match="needs a logger"):
        fit([NanscanCallback(telemetry="trainer")])


class NaNOnce(pl.Callback):
    """At training step ``step`` only, net.3's backward-only fault (finite forward, NaN gradient)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.net[3].fault = trainer.global_step == self.step


def test_a_nonfinite_step_is_skipped_and_fitting_goes_on(tmp_path):
    from nanscan.integrations.lightning import NanscanCallback

    callback = NanscanCallback(on_nonfinite="skip", capture_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="skipped the update of step 2"):
        module = fit([callback, NaNOnce(2)], max_steps=5)
    mon = callback.last_monitor
    assert mon.ledger.skipped_steps == [2] and mon.ledger.applied == 4
    assert (mon.incident.step, mon.incident.phase, mon.incident.name) == (2, "backward", "net.3")
    assert mon.bundle_path is not None
    assert all(torch.isfinite(p).all() for p in module.parameters())

"""Failure bundles, replay to the first non-finite op, backend bisection, and the CLI."""
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

import nanscan
from nanscan.capture.bundle import capture_rng
from tests.capture_models import POISON, drop_net, log_net

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_dropout_training(capture_dir, seed=2, steps=10):
    """A loop with dropout and random augmentation whose NaN depends on the dropout mask drawn in
    the failing step. The loop edits the batch in place after the forward. Returns the error and
    the RNG state right after the failing step."""
    model, forward = drop_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(seed)
    mon = nanscan.watch(model, opt, capture_dir=str(capture_dir))
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for _ in range(steps):
            x = torch.rand(4, 8) + 0.1  # random augmentation
            x[0, 0] = POISON
            with mon.step(x):
                try:
                    loss = mon.check_loss(forward(model, x))
                    x.mul_(0.0)  # in-place edit after the forward: must not reach the bundle
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                finally:
                    after = capture_rng()
    return err.value, after, mon


def test_bundle_replays_the_dropout_mask_of_the_failing_step(tmp_path):
    error, rng_after_step, mon = run_dropout_training(tmp_path)
    inc = error.incident
    assert (inc.step, inc.phase, inc.name, inc.produced) == (1, "forward", "drop", True)
    assert error.bundle_path == mon.bundle_path == str(tmp_path / "step000001-rank0")
    bundle = nanscan.load_bundle(mon.bundle_path)
    assert bundle.inputs[0, 0].item() == pytest.approx(POISON) and bundle.inputs[1, 1].item() > 0  # originals
    assert bundle.manifest["state"] == "before-update" and bundle.manifest["training"] is True
    assert bundle.manifest["incident"]["name"] == "drop"

    model, forward = drop_net()
    result = nanscan.replay(bundle, model, forward=forward)
    assert result.reproduced and (result.first_op, result.module, result.phase) == ("aten.mul.Tensor", "drop", "forward")
    assert result.inputs and all(s.is_finite for s in result.inputs)
    assert result.outputs[0].posinf_count == 1 and "test_capture" not in (result.stack or "")

    bundle.rng = rng_after_step  # the state after the step draws another mask: no NaN
    model, forward = drop_net()
    assert not nanscan.replay(bundle, model, forward=forward).reproduced


def test_replay_names_a_functional_op_inside_a_module_and_fp32_replay(tmp_path):
    model = log_net()
    x = torch.randn(4, 8)
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=x)
    result = nanscan.replay(path, log_net())
    assert (result.first_op, result.module, result.phase) == ("aten.log.default", "block", "forward")
    assert result.stack and "capture_models.py" in result.stack and "in forward" in result.stack
    assert "aten.log.default" in str(result)


class SqrtGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * torch.sqrt(self.w)


def test_replay_finds_a_backward_only_fault(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SqrtGate(), nn.Linear(8, 1))
    with torch.no_grad():
        model[1].w[2] = 0.0
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=torch.randn(4, 8))
    result = nanscan.replay(path, model, forward=lambda m, x: m(x).sum())
    assert result.reproduced and (result.phase, result.module) == ("backward", "1")
    assert result.result.is_finite  # the loss itself was finite: only the gradient was not
    # detect_anomaly(check_nan=True) looks for NaN only: this gradient is +-inf, so it stays silent
    # while nanscan's op search names it.
    anomaly = nanscan.replay(path, model, forward=lambda m, x: m(x).sum(), anomaly=True)
    assert anomaly.anomaly_error is None and anomaly.first_op == result.first_op
    nan_path = nanscan.capture_bundle(str(tmp_path / "nan"), model=log_net(), batch=torch.randn(4, 8))
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):
        nan_anomaly = nanscan.replay(nan_path, log_net(), forward=lambda m, x: m(x).sum(), anomaly=True)
    assert nan_anomaly.anomaly_error and "nan" in nan_anomaly.anomaly_error.lower()


def test_fp32_replay_of_a_half_model_does_not_overflow(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)).half()
    x = torch.full((2, 8), 200.0).half()
    with torch.no_grad():
        model[0].weight.fill_(50.0)  # 8 * 200 * 50 = 80000 > 65504: inf in fp16, fine in fp32
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=x)
    manifest = nanscan.load_bundle(path).manifest
    assert manifest["model_precision"]["converted"] == ["float16"] and manifest["inputs"][0]["dtype"] == "float16"
    assert nanscan.replay(path, model).reproduced
    fp32 = nanscan.replay(path, model, precision="fp32")
    assert not fp32.reproduced and fp32.result.dtype == torch.float32


def test_bundle_refuses_tampering_and_never_runs_a_malicious_pickle(tmp_path):
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=log_net(), batch=torch.randn(2, 8))
    batch_file = os.path.join(path, "batch.pt")
    with open(batch_file, "r+b") as f:
        f.truncate(40)
    with pytest.raises(nanscan.BundleError, match="batch.pt does not match the hash"):
        nanscan.load_bundle(path)

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(batch_file, "wb") as f:
        pickle.dump({"args": [Evil()], "kwargs": {}}, f)
    manifest_file = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_file))
    from nanscan.capture.bundle import _sha256

    manifest["files"]["batch.pt"] = _sha256(batch_file)  # the attacker forged the hash too
    json.dump(manifest, open(manifest_file, "w"))
    with pytest.raises(nanscan.BundleError, match="batch.pt could not be loaded safely"):
        nanscan.load_bundle(path)
    assert not marker.exists()
    with pytest.raises(nanscan.BundleError, match="not a nanscan bundle"):
        nanscan.load_bundle(str(tmp_path))


def test_capture_is_atomic_never_overwrites_and_holds_no_copy_of_the_model(tmp_path, monkeypatch):
    model = log_net()
    params = {p.data_ptr() for p in model.parameters()}
    saved = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, **k: (saved.append(obj), real_save(obj, f, **k))[1])
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=torch.randn(2, 8))
    model_state = saved[2]
    assert {t.data_ptr() for t in model_state.values()} == params  # the parameters themselves, no copy
    assert sorted(os.listdir(tmp_path)) == ["b"]  # no temporary directory left behind
    with pytest.raises(FileExistsError):
        nanscan.capture_bundle(path, model=model, batch=torch.randn(2, 8))
    manifest = nanscan.load_bundle(path).manifest
    env = manifest["environment"]
    assert {"torch", "cuda", "cudnn_benchmark", "deterministic_algorithms", "tf32_matmul"} <= set(env)
    assert manifest["autocast"]["cpu"]["enabled"] is False


def test_bisect_backends_on_cpu(tmp_path):
    model = log_net()
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=torch.randn(4, 8))
    results = nanscan.bisect_backends(path, model, backends=("eager", "aot_eager", "inductor"))
    assert list(results) == ["eager", "aot_eager", "inductor"]
    assert all(r.error is None and r.finite is False for r in results.values())
    healthy = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    path2 = nanscan.capture_bundle(str(tmp_path / "c"), model=healthy, batch=torch.randn(4, 8))
    results = nanscan.bisect_backends(path2, healthy, backends=("eager", "aot_eager", "inductor"))
    assert all(r.finite for r in results.values()) and results["eager"].comparison is None
    assert results["inductor"].comparison.max_abs_error < 1e-5 and results["inductor"].comparison.nonfinite_actual == 0
    broken = nanscan.bisect_backends(path2, healthy, backends=("eager", "no_such_backend"))
    assert broken["no_such_backend"].error and broken["no_such_backend"].finite is None


def test_cli_show_replay_bisect(tmp_path):
    _, _, mon = run_dropout_training(tmp_path)
    env = dict(os.environ, PYTHONPATH=REPO)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "nanscan", *args], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=600)

    shown = cli("show", mon.bundle_path)
    assert shown.returncode == 0 and "incident     activation 'drop' in forward" in shown.stdout
    replayed = cli("replay", mon.bundle_path, "--model", "tests.capture_models:drop_net")
    assert replayed.returncode == 1 and "aten.mul.Tensor" in replayed.stdout and "drop" in replayed.stdout, replayed.stderr
    fp32 = cli("replay", mon.bundle_path, "--model", "tests.capture_models:drop_net", "--fp32")
    assert fp32.returncode == 1  # the overflow is fp32's own: still reproduced
    bisected = cli("bisect", mon.bundle_path, "--model", "tests.capture_models:drop_net")
    assert bisected.returncode == 1 and "eager" in bisected.stdout and "inductor" in bisected.stdout, bisected.stderr


def test_replay_compiled_with_aot_eager_still_finds_the_op(tmp_path):
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=log_net(), batch=torch.randn(4, 8))
    torch._dynamo.reset()
    result = nanscan.replay(path, log_net(), compile_backend="aot_eager", backward=False)
    assert result.reproduced and result.first_op == "aten.log.default" and result.compile_backend == "aot_eager"


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.gate = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.lin(x + 0.0 * self.gate)


@pytest.mark.parametrize("keep", [False, True])
def test_update_phase_bundle_state_marker(tmp_path, keep):
    # Adam with eps=0 turns gate's zero gradient into a NaN update at step 0; it is seen at step 1.
    torch.manual_seed(0)
    model = GatedNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path), keep_pre_update_state=keep)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for _ in range(3):
            x = torch.randn(4, 8)
            with mon.step(x):
                mon.check_loss(model(x).sum()).backward()
                opt.step()
                opt.zero_grad()
    assert (err.value.incident.step, err.value.incident.phase) == (0, "update")
    bundle = nanscan.load_bundle(mon.bundle_path)
    assert bundle.manifest["state"] == ("before-update" if keep else "after-update")
    gate = bundle.model_state["gate"]
    assert torch.isfinite(gate).all() if keep else torch.isnan(gate).all()
    assert bundle.manifest["step"] == 0


def test_dict_batch_bundle_replays_as_keyword_arguments(tmp_path):
    # HF style: model(**batch). Kept with mon.step(batch) or from the forward's keyword inputs, the
    # bundle stores the mapping as keyword arguments; replay calls model(**batch).
    class KwNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, input_ids=None, scale=None):
            return torch.log(self.lin(input_ids) * scale)  # log of a negative where scale < 0

    for explicit in (True, False):
        torch.manual_seed(0)
        model = KwNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        mon = nanscan.watch(model, opt, capture_dir=str(tmp_path / f"b{explicit}"))
        batch = {"input_ids": torch.randn(4, 8), "scale": -torch.ones(8)}
        with pytest.raises(nanscan.NonFiniteError), mon:
            if explicit:
                with mon.step(batch):
                    model(**batch).sum().backward()
                    opt.step()
            else:
                model(**batch).sum().backward()
                opt.step()
        bundle = nanscan.load_bundle(mon.bundle_path)
        assert set(bundle.inputs) == {"input_ids", "scale"} and torch.equal(bundle.kwargs["scale"], batch["scale"])
        torch.manual_seed(0)
        result = nanscan.replay(bundle, KwNet())
        assert result.reproduced and result.first_op == "aten.log.default"
        user = nanscan.replay(bundle, KwNet(), forward=lambda m, b: m(**b).sum())  # the loop's own forward
        assert user.reproduced and user.first_op == "aten.log.default"


@pytest.mark.parametrize("where", ["batch", "weight"])
def test_replay_of_a_bundle_that_was_already_non_finite_says_so(tmp_path, where):
    # A NaN that came in with the batch (or sits in a weight since an earlier step) was made by no op
    # of the step: replay names what was non-finite before the step ran, not "not observable".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path))
    x = torch.randn(2, 4)
    if where == "batch":
        x[1, 2] = float("nan")
    else:
        with torch.no_grad():
            model[2].weight[0, 1] = float("inf")
    with pytest.raises(nanscan.NonFiniteError), mon:
        model(x).sum().backward()
        opt.step()
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    result = nanscan.replay(mon.bundle_path, fresh)
    expected = "batch.args[0]" if where == "batch" else "2.weight"
    assert result.reproduced and result.first_op is None and result.nonfinite_before == [expected]
    assert "already in the bundle before the step ran" in str(result) and expected in str(result)

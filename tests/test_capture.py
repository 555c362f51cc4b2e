"""Failure bundles, replay to the first non-finite op, backend bisection, and the CLI."""
import errno
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import nanscan
from nanscan.capture import bundle as B
from nanscan.capture.bundle import capture_rng
from nanscan.capture.bundle_format import _sha256
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
    assert result.reproduced
    assert (result.first_op, result.module, result.phase) == ("aten.mul.Tensor", "drop", "forward")
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


def edit_manifest(path, edit, forge_digest=True):
    """Edit a bundle's manifest.json as an attacker would: ``edit(manifest)`` then, with
    ``forge_digest``, recompute its digest so that only the later checks can catch it."""
    manifest_file = os.path.join(path, "manifest.json")
    with open(manifest_file) as f:
        manifest = json.load(f)
    edit(manifest)
    if forge_digest:
        manifest["digest"] = B.manifest_digest(manifest)
    with open(manifest_file, "w") as f:
        json.dump(manifest, f)


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
    edit_manifest(path, lambda m: m["files"].update({"batch.pt": _sha256(batch_file)}))  # hash forged too
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
    assert (replayed.returncode == 1 and "aten.mul.Tensor" in replayed.stdout
            and "drop" in replayed.stdout), replayed.stderr
    fp32 = cli("replay", mon.bundle_path, "--model", "tests.capture_models:drop_net", "--fp32")
    assert fp32.returncode == 1  # the overflow is fp32's own: still reproduced
    bisected = cli("bisect", mon.bundle_path, "--model", "tests.capture_models:drop_net")
    assert bisected.returncode == 1 and "eager" in bisected.stdout and "inductor" in bisected.stdout, bisected.stderr


def test_replay_compiled_with_aot_eager_still_finds_the_op(tmp_path):
    from torch._dynamo.utils import counters

    path = nanscan.capture_bundle(str(tmp_path / "b"), model=log_net(), batch=torch.randn(4, 8))
    torch._dynamo.reset()
    counters.clear()
    result = nanscan.replay(path, log_net(), compile_backend="aot_eager", backward=False)
    # the step was compiled (dynamo runs a frame entered under a dispatch mode eagerly: replay
    # must not enter its mode before the compiled call), and the op search saw the graph's ops
    assert counters["frames"]["ok"] >= 1
    assert result.reproduced and result.first_op == "aten.log.default" and result.compile_backend == "aot_eager"
    assert result.module is None and "module (module unknown: inside the compiled graph)" in str(result)
    # inductor fuses the log into a kernel the op search cannot see into: it says so
    torch._dynamo.reset()
    counters.clear()
    fused = nanscan.replay(path, log_net(), compile_backend="inductor", backward=False)
    assert counters["frames"]["ok"] >= 1
    assert fused.reproduced and fused.first_op is None and "inside the compiled graph" in fused.cannot_tell


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


# ---------------------------------------------------------------------------- sharp edges (issue 14)
def small_bundle(path, **kw):
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return nanscan.capture_bundle(str(path), model=model, batch=torch.randn(2, 3), optimizer=opt,
                                  scaler=torch.amp.GradScaler("cpu"), **kw)


def test_manifest_is_covered_by_its_digest(tmp_path):
    incident = {"name": "drop", "kind": "activation", "phase": "forward"}
    path = small_bundle(tmp_path / "b", step=14, incident=incident)
    manifest_file = os.path.join(path, "manifest.json")
    manifest = nanscan.load_bundle(path).manifest
    assert manifest["version"] == 2 and manifest["digest"] == B.manifest_digest(manifest)
    original = open(manifest_file, "rb").read()
    # a flipped byte anywhere in a value: the step, the incident's name, the version
    for old, new in [(b'"step": 14', b'"step": 15'), (b'"drop"', b'"drof"'), (b'"version": 2', b'"version": 1')]:
        assert original.count(old) == 1
        open(manifest_file, "wb").write(original.replace(old, new))
        with pytest.raises(nanscan.BundleError, match="manifest.json (was edited or corrupted|says format 1)"):
            nanscan.load_bundle(path)
    # the layout is not covered: the same content re-indented still loads
    open(manifest_file, "w").write(json.dumps(json.loads(original), indent=4, sort_keys=True))
    assert nanscan.load_bundle(path).manifest_verified
    # a format-2 manifest without its digest is refused
    edit_manifest(path, lambda m: m.pop("digest"), forge_digest=False)
    with pytest.raises(nanscan.BundleError, match="has no digest"):
        nanscan.load_bundle(path)
    # a format-1 bundle (written before the digest existed) loads, its manifest flagged unverified
    edit_manifest(path, lambda m: m.update(version=1), forge_digest=False)
    with pytest.warns(UserWarning, match="format-1 bundle"):
        old_bundle = nanscan.load_bundle(path)
    assert not old_bundle.manifest_verified and old_bundle.manifest["step"] == 14


def test_symlinked_bundle_files_are_refused(tmp_path):
    path = small_bundle(tmp_path / "b")
    outside = tmp_path / "outside.pt"
    os.rename(os.path.join(path, "model.pt"), outside)
    os.symlink(outside, os.path.join(path, "model.pt"))  # same bytes, same hash: only the link is wrong
    with pytest.raises(nanscan.BundleError, match="model.pt is a symbolic link"):
        nanscan.load_bundle(path)
    os.unlink(os.path.join(path, "model.pt"))
    os.rename(outside, os.path.join(path, "model.pt"))
    assert nanscan.load_bundle(path)
    inside = os.path.join(path, "manifest.real")
    os.rename(os.path.join(path, "manifest.json"), inside)
    os.symlink("manifest.real", os.path.join(path, "manifest.json"))  # even a link pointing inside
    with pytest.raises(nanscan.BundleError, match="manifest.json is a symbolic link"):
        nanscan.load_bundle(path)
    os.unlink(os.path.join(path, "manifest.json"))
    os.rename(inside, os.path.join(path, "manifest.json"))
    os.symlink(path, tmp_path / "latest")  # the bundle directory itself may be reached by a link
    assert nanscan.load_bundle(str(tmp_path / "latest")).manifest_verified
    os.mkfifo(os.path.join(path, "optimizer.fifo"))
    os.rename(os.path.join(path, "optimizer.fifo"), os.path.join(path, "optimizer.pt"))
    with pytest.raises(nanscan.BundleError, match="optimizer.pt is not a regular file"):
        nanscan.load_bundle(path)


def _raw(text):
    return lambda raw: text


ODD_MANIFESTS = {
    # raw bytes (no digest can match them) ...
    "non-utf8": lambda raw: raw.replace(b'"format"', b'"form\xffat"'),
    "nested-100000": lambda raw: raw.replace(b'"extra": {}', b'"extra": ' + b"[" * 100000 + b"]" * 100000),
    "nan": lambda raw: raw.replace(b'"step": null', b'"step": NaN'),
    "huge-float": lambda raw: raw.replace(b'"step": null', b'"step": 1e999'),
    "huge-int": lambda raw: raw.replace(b'"step": null', b'"step": ' + b"9" * 5000),
    "top-level-list": _raw(b"[1, 2]"),
    "empty": _raw(b""),
    # ... and edits with a forged digest, so that only the field checks can catch them
    "nested-40": lambda m: m.update(extra={"a": json.loads("[" * 40 + "]" * 40)}),
    "lone-surrogate": lambda m: m.update(incident={"name": "\ud800"}),
    "version-list": lambda m: m.update(version=[2]),
    "version-true": lambda m: m.update(version=True),
    "files-list": lambda m: m.update(files=["batch.pt"]),
    "digest-int": lambda m: m["files"].update({"model.pt": 5}),
    "digest-dict": lambda m: m["files"].update({"model.pt": {"sha256": "x"}}),
    "files-path": lambda m: m["files"].update({"../x.pt": "0" * 64}),
    "files-missing": lambda m: m["files"].pop("rng.pt"),
    "step-string": lambda m: m.update(step="14"),
    "step-bool": lambda m: m.update(step=True),
    "incident-list": lambda m: m.update(incident=["drop"]),
    "training-string": lambda m: m.update(training="yes"),
    "autocast-list": lambda m: m.update(autocast=[1]),
    "autocast-dtype": lambda m: m.update(autocast={"cpu": {"enabled": True, "dtype": "os"}}),
    "inputs-dict": lambda m: m.update(inputs={"path": "args[0]"}),
    "environment-string": lambda m: m.update(environment="torch"),
}
RAW_CASES = {"non-utf8", "nested-100000", "nan", "huge-float", "huge-int", "top-level-list", "empty"}


@pytest.mark.parametrize("case", sorted(ODD_MANIFESTS))
def test_odd_manifest_is_a_bundle_error_and_one_cli_line(tmp_path, case, capsys):
    from nanscan import cli

    path = small_bundle(tmp_path / "b")
    edit = ODD_MANIFESTS[case]
    manifest_file = os.path.join(path, "manifest.json")
    if case in RAW_CASES:
        raw = open(manifest_file, "rb").read()
        open(manifest_file, "wb").write(edit(raw))
    else:
        edit_manifest(path, edit)
    with pytest.raises(nanscan.BundleError, match="manifest.json"):
        nanscan.load_bundle(path)
    capsys.readouterr()
    assert cli.main(["show", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanscan: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_show_of_an_odd_manifest_prints_one_line(tmp_path):
    # the same as a user runs it: no traceback, exit 2
    path = small_bundle(tmp_path / "b")
    edit_manifest(path, lambda m: m.update(incident=["drop"], version=[2]))
    out = subprocess.run([sys.executable, "-m", "nanscan", "show", path], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=600)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "version [2] is not supported" in out.stderr


FORGED_PAYLOADS = {
    "model-list": ("model.pt", [torch.zeros(2)], "model.pt is not what nanscan writes there: it holds a list; "
                                                 "expected a dict of str -> Tensor"),
    "model-int-value": ("model.pt", {"weight": 3}, r"holds 'weight': an int"),
    "batch-tensor": ("batch.pt", torch.zeros(2), "batch.pt is not what nanscan writes there: it holds a Tensor"),
    "batch-args-tensor": ("batch.pt", {"args": torch.zeros(2), "kwargs": {}, "single": True}, "args: a Tensor"),
    "batch-single-empty": ("batch.pt", {"args": [], "kwargs": {}, "single": True}, "single=True with 0 positional"),
    "batch-int-key": ("batch.pt", {"args": [], "kwargs": {1: torch.zeros(1)}, "single": False}, "not a string"),
    "rng-short": ("rng.pt", {"python": [3, [1, 2], None], "torch_cpu": torch.get_rng_state()},
                  r"rng.pt .* python: not a random.getstate\(\)"),
    "rng-float-state": ("rng.pt", {"python": list(capture_rng()["python"]), "torch_cpu": torch.zeros(3)},
                        "torch_cpu: a Tensor of torch.float32"),
    "rng-bad-bytes": ("rng.pt",
                      {"python": list(capture_rng()["python"]), "torch_cpu": torch.zeros(3, dtype=torch.uint8)},
                      "torch_cpu: not a torch RNG state"),
    "optimizer-swapped": ("optimizer.pt", {"state": [], "param_groups": {}}, "optimizer.pt .* state: a list"),
    "optimizer-no-params": ("optimizer.pt", {"state": {}, "param_groups": [{"lr": 0.1}]},
                            r"param_groups\[0\]: a dict without a params list"),
    "scaler-string": ("scaler.pt", {"scale": "big"}, r"scaler.pt .* 'scale': a str; expected a dict of str -> number"),
}


@pytest.mark.parametrize("case", sorted(FORGED_PAYLOADS))
def test_payload_of_the_wrong_type_with_a_forged_hash_is_refused(tmp_path, case):
    name, payload, message = FORGED_PAYLOADS[case]
    path = small_bundle(tmp_path / "b")
    target = os.path.join(path, name)
    os.unlink(target)
    torch.save(payload, target)
    edit_manifest(path, lambda m: m["files"].update({name: _sha256(target)}))  # hash and digest forged
    with pytest.raises(nanscan.BundleError, match=message):
        nanscan.load_bundle(path)


def test_every_payload_nanscan_writes_passes_its_check(tmp_path):
    # the checks accept what the monitor and capture_bundle write: HF-style keyword batches, a
    # batch that is None (no batch kept), nested inputs, optimizer and scaler state
    path = small_bundle(tmp_path / "b")
    bundle = nanscan.load_bundle(path)
    assert bundle.optimizer_state["param_groups"][0]["params"] == [0, 1] and bundle.scaler_state["scale"] > 0
    nested = nanscan.capture_bundle(str(tmp_path / "n"), model=nn.Linear(3, 2),
                                    batch=(torch.zeros(1), [torch.ones(2), {"k": 1.5, "s": "x", "n": None}]),
                                    kwargs={"mask": torch.ones(2, dtype=torch.bool)})
    assert nanscan.load_bundle(nested).args[1][1]["s"] == "x"
    mapping = nanscan.capture_bundle(str(tmp_path / "m"), model=nn.Linear(3, 2), batch={"input_ids": torch.zeros(2)})
    assert set(nanscan.load_bundle(mapping).inputs) == {"input_ids"}


def test_bisect_exits_non_zero_when_every_backend_failed(tmp_path, capsys):
    from nanscan import cli

    path = nanscan.capture_bundle(str(tmp_path / "b"), model=log_net(), batch=torch.randn(4, 8))
    # drop_net's state dict does not fit log_net's bundle: every backend fails to load it
    results = nanscan.bisect_backends(path, drop_net()[0], backends=("eager", "aot_eager"))
    assert all(r.finite is None and r.error for r in results.values())
    assert cli.main(["bisect", path, "--model", "tests.capture_models:drop_net"]) == 3
    out = capsys.readouterr()
    assert out.out.count("failed: RuntimeError") == 4 and "every backend failed (4)" in out.err
    assert "3 ``bisect``: every backend failed" in " ".join(cli.__doc__.split())  # the documented status


def test_bad_model_spec_is_one_line_exit_2(tmp_path, capsys):
    from nanscan import cli

    path = nanscan.capture_bundle(str(tmp_path / "b"), model=log_net(), batch=torch.randn(4, 8))
    for spec, expected in [("tests.no_such_module:f", "no module named 'tests.no_such_module'"),
                           ("no_such_package.mod:f", "cannot find module"),
                           ("tests.capture_models:no_such_factory", "has no callable 'no_such_factory'"),
                           ("tests.capture_models", "must look like pkg.module:factory")]:
        assert cli.main(["replay", path, "--model", spec]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err


TORCH_DISK_FULL = ("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                   "data/0: file write failed")


@pytest.mark.parametrize("free", [4096, 10 << 30])
def test_full_disk_says_so_and_leaves_no_partial_bundle(tmp_path, monkeypatch, free):
    real_save, real_usage = torch.save, shutil.disk_usage

    def save(obj, f, **kw):
        if str(getattr(f, "name", f)).endswith("model.pt"):  # (a path, or the file the writer opened)
            real_save(obj, f, **kw)  # a partial file, as a full disk leaves one
            raise RuntimeError(TORCH_DISK_FULL)
        return real_save(obj, f, **kw)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=free))
    model = nn.Linear(1000, 100)
    with pytest.raises(OSError) as err:
        nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=torch.randn(2, 1000))
    assert isinstance(err.value, B.BundleWriteError) and isinstance(err.value.__cause__, RuntimeError)
    message = str(err.value)
    assert f"{free} bytes free in {tmp_path}" in message and "model.pt needs about 400400 bytes" in message
    assert "the partial bundle was removed" in message
    if free == 4096:
        assert err.value.errno == errno.ENOSPC and "the disk is full" in message
    else:
        assert err.value.errno is None and "probably not full" in message and "file write failed" in message
    assert os.listdir(tmp_path) == []  # neither the bundle nor its temporary directory


def test_full_disk_while_writing_the_manifest(tmp_path, monkeypatch):
    real_dump = json.dump

    def dump(obj, f, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", dump)
    with pytest.raises(B.BundleWriteError, match="the disk is full: writing manifest.json") as err:
        small_bundle(tmp_path / "b")
    monkeypatch.setattr(json, "dump", real_dump)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value.__cause__, OSError)
    assert os.listdir(tmp_path) == []


def test_rerun_into_the_same_capture_dir_keeps_both_bundles(tmp_path, recwarn):
    first, _, mon1 = run_dropout_training(tmp_path)
    second, _, mon2 = run_dropout_training(tmp_path)
    third, _, mon3 = run_dropout_training(tmp_path)
    assert first.bundle_path == mon1.bundle_path == str(tmp_path / "step000001-rank0")
    assert second.bundle_path == mon2.bundle_path == str(tmp_path / "step000001-rank0-1")
    assert third.bundle_path == mon3.bundle_path == str(tmp_path / "step000001-rank0-2")
    assert not [w for w in recwarn if "could not write the bundle" in str(w.message)]
    assert sorted(os.listdir(tmp_path)) == ["step000001-rank0", "step000001-rank0-1", "step000001-rank0-2"]
    for path in (mon1.bundle_path, mon2.bundle_path, mon3.bundle_path):
        assert nanscan.load_bundle(path).manifest["incident"]["name"] == "drop"
    # an explicit path is still never overwritten
    with pytest.raises(FileExistsError):
        nanscan.capture_bundle(mon1.bundle_path, model=log_net(), batch=torch.randn(2, 8))
    assert B.free_bundle_path(str(tmp_path / "step000001-rank0")) == str(tmp_path / "step000001-rank0-3")


def test_report_of_an_edited_manifest_says_so(tmp_path):
    """`nanscan report BUNDLE` checks the manifest's digest as load_bundle does (torch-free): an
    edited step is refused, one line and exit 2 from the CLI, never reported as the incident."""
    from nanscan import cli, report

    path = small_bundle(tmp_path / "b", step=14, incident={"name": "drop", "kind": "activation",
                                                            "phase": "forward"})
    assert report.summarize_run(path)["step"] == 14
    manifest_file = os.path.join(path, "manifest.json")
    original = open(manifest_file, "rb").read()
    open(manifest_file, "wb").write(original.replace(b'"step": 14', b'"step": 15'))
    with pytest.raises(ValueError, match="was edited or corrupted"):
        report.summarize_run(path)
    assert cli.main(["report", path]) == 2
    edit_manifest(path, lambda m: m.pop("digest"), forge_digest=False)  # format 2 without a digest
    with pytest.raises(ValueError, match="was edited or corrupted"):
        report.summarize_run(path)
    edit_manifest(path, lambda m: m.update(version=1), forge_digest=False)  # format 1: nothing to check
    assert report.summarize_run(path)["step"] == 15


def test_a_bundle_with_an_incident_of_the_earlier_summary_format_still_loads(tmp_path):
    """Bundles keep the incident's summary as TensorSummary.to_dict() wrote it: one written before
    the record had sum / sum4 (no sum, sum4, mean, kurtosis keys) loads and reports as before."""
    from nanscan import report
    from tests.test_log import EARLIER_SUMMARY

    incident = {"step": 3, "phase": "backward", "name": "fc.weight", "kind": "grad", "produced": True, "rank": 0,
                "summary": EARLIER_SUMMARY}
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=log_net(), batch=torch.randn(4, 8), incident=incident,
                                  step=3)
    manifest = nanscan.load_bundle(path).manifest
    assert manifest["incident"]["summary"] == EARLIER_SUMMARY
    text = report.text_report(path)
    assert "fc.weight" in text and "3 NaN" in text

"""Replay names the first op on the path to the failure -- never an intended -inf mask -- says
"reproduced" only when the step's result went non-finite, honours ``allow=``, and says "cannot
tell" where it cannot know; bisect says its conclusion in words. (docs/replay.md)"""
import pytest
import torch
from torch import nn

import nanscan
from nanscan import cli
from tests import capture_models as M


def ids(step):
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))


def big_input_column(model, name, value):
    """Scale input feature 0 of a projection: every output reads it (``nn.Linear`` keeps
    ``[out, in]``, GPT-2's ``Conv1D`` ``[in, out]``). 1e6 overflows fp16 in the weight's cast;
    6e4 is finite in fp16 and overflows in the matmul."""
    module = model.get_submodule(name)
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            module.weight[:, 0] = value
        else:
            module.weight[0, :] = value


def train_to_incident(model, tmp_path, plant, hf=False, allow=()):
    """A plain loop, fp16 autocast from step 1 on, the fault planted at step 1; the monitor's
    incident and bundle."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = nanscan.watch(model, opt, capture_dir=str(tmp_path), allow=allow)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for step in range(3):
            if step == 1:
                plant(model)
            with torch.autocast("cpu", dtype=torch.float16, enabled=step >= 1):
                x = ids(step)
                loss = model(input_ids=x, labels=x).loss if hf else model(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
    return err.value


FAULTS = [(0, 6e4), (1, 1e6)]  # block 0: the matmul overflows (a NaN then meets every later mask); block 1: the cast


@pytest.mark.parametrize("block,value", FAULTS, ids=["matmul-block0", "cast-block1"])
@pytest.mark.parametrize("mask", ["fill", "inplace", "additive", "sdpa"])
def test_replay_names_the_monitors_module_not_the_mask_nanogpt(tmp_path, mask, block, value):
    fc1 = f"blocks.{block}.mlp.fc1"
    allow = ("causal_mask",) if mask in ("additive", "sdpa") else ()  # the monitor sees that one as a module output
    error = train_to_incident(M.nanogpt(mask), tmp_path, lambda m: big_input_column(m, fc1, value), allow=allow)
    assert (error.incident.name, error.incident.phase, error.incident.produced) == (fc1, "forward", True)
    for replay_allow in [()] + ([allow] if allow else []):
        result = nanscan.replay(error.bundle_path, M.nanogpt(mask), **({"allow": replay_allow} if replay_allow else {}))
        assert (result.module, result.phase, result.reproduced) == (fc1, "forward", True), str(result)
        assert result.cannot_tell is None and result.inputs_finite, str(result)
        assert result.first_op == ("aten.addmm.default" if value < 65504 else "aten._to_copy.default")
        assert result.outputs[0].posinf_count + result.outputs[0].neginf_count > 0
    if mask in ("fill", "inplace"):  # the -inf fills of the blocks before the fault were made first: off the path
        assert any(p.startswith("aten.masked_fill") and " in blocks.0.attn" in p for p in result.off_path)


@pytest.mark.parametrize("block,value", FAULTS, ids=["matmul-block0", "cast-block1"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_replay_names_the_monitors_module_hf(tmp_path, arch, impl, block, value):
    pytest.importorskip("transformers")
    make = (lambda: M.hf_gpt2(impl)) if arch == "gpt2" else (lambda: M.hf_llama(impl))
    name = f"transformer.h.{block}.mlp.c_fc" if arch == "gpt2" else f"model.layers.{block}.mlp.gate_proj"
    error = train_to_incident(make(), tmp_path, lambda m: big_input_column(m, name, value), hf=True)
    assert (error.incident.name, error.incident.produced) == (name, True)
    result = nanscan.replay(error.bundle_path, make())
    assert (result.module, result.phase, result.reproduced) == (name, "forward", True), str(result)
    assert result.cannot_tell is None and result.inputs_finite, str(result)


def test_fp32_replay_of_an_fp16_overflow_did_not_reproduce(tmp_path, capsys):
    error = train_to_incident(M.nanogpt(), tmp_path, lambda m: big_input_column(m, "blocks.1.mlp.fc1", 1e6))
    fp32 = nanscan.replay(error.bundle_path, M.nanogpt(), precision="fp32")
    # the masks' -inf is there in fp32 too; the loss and every gradient stay finite
    assert fp32.result.is_finite and not fp32.reproduced and fp32.failure is None
    assert "did not reproduce" in str(fp32) and "aten.masked_fill.Scalar in blocks.0.attn" in str(fp32)
    capsys.readouterr()
    assert cli.main(["replay", error.bundle_path, "--model", "tests.capture_models:nanogpt", "--fp32"]) == 0
    assert "did not reproduce" in capsys.readouterr().out
    assert cli.main(["replay", error.bundle_path, "--model", "tests.capture_models:nanogpt"]) == 1
    out = capsys.readouterr().out
    assert "reproduced: result[0] and result[1] went non-finite" in out and "module blocks.1.mlp.fc1" in out, out


class SqrtGate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.sqrt(self.w)


def test_backward_fault_behind_a_forward_mask(tmp_path):
    # The forward's only non-finite values are the mask's -inf (made first, finite after softmax);
    # the failure is sqrt's infinite gradient at w == 0 in the backward.
    torch.manual_seed(0)
    model = nn.Sequential(M.CausalSelfAttention(8, 2, 4), SqrtGate(8))
    with torch.no_grad():
        model[1].w[2] = 0.0
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=torch.randn(2, 4, 8))
    result = nanscan.replay(path, model, forward=lambda m, x: m(x).sum())
    assert (result.phase, result.module) == ("backward", "1"), str(result)
    assert result.reproduced and result.result.is_finite and result.failure.startswith("the gradient of")
    assert result.off_path == ["aten.masked_fill.Scalar in 0"]


def test_a_nan_gradient_from_a_where_branch_is_traced_to_its_forward_op(tmp_path):
    # sqrt of a negative in the branch torch.where drops: the loss is finite, the gradient NaN;
    # the path crosses autograd through the tensor sqrt saved for its backward.
    class Guarded(nn.Module):
        def forward(self, x):
            return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Guarded())
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=torch.randn(3, 4))
    result = nanscan.replay(path, model, forward=lambda m, x: m(x).sum())
    assert (result.first_op, result.phase, result.module) == ("aten.sqrt.default", "forward", "1"), str(result)
    assert result.reproduced and result.result.is_finite and "gradient" in result.failure


class LogProb(nn.Module):
    def forward(self, p):
        return torch.log(p)  # log(0) = -inf: intended (an impossible class)


class ProbNet(nn.Module):
    """Probabilities with exact zeros -> log (-inf, intended) -> a linear head (-inf - -inf = NaN)."""

    def __init__(self):
        super().__init__()
        self.probs = nn.Linear(4, 4)
        self.logp = LogProb()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.logp(torch.relu(self.probs(x)))).sum()


def prob_net():
    torch.manual_seed(0)
    model = ProbNet()
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, -1.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0]]))
    return model


def test_allow_patterns_are_those_of_watch(tmp_path):
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]]).repeat(3, 1)
    model = prob_net()
    with torch.no_grad():
        model.probs.weight.copy_(torch.eye(4))
    outcomes = {}
    for allow in [(), ("logp",)]:
        mon = nanscan.watch(model, allow=allow, capture_dir=str(tmp_path / f"m{len(allow)}"))
        with pytest.raises(nanscan.NonFiniteError) as err, mon:
            model(x)
        outcomes[allow] = err.value
    assert outcomes[()].incident.name == "logp" and outcomes[("logp",)].incident.name == "head"
    for allow, error in outcomes.items():
        result = nanscan.replay(error.bundle_path, model, backward=False, allow=allow)
        assert result.reproduced and result.module == error.incident.name, str(result)
    # the allowed -inf is not the answer: the op that took it out of its module and made NaN is
    allowed = nanscan.replay(outcomes[("logp",)].bundle_path, model, backward=False, allow="logp")
    assert allowed.first_op == "aten.addmm.default" and allowed.inputs_finite is False
    assert "allowed by ('logp',)" in str(allowed)
    with pytest.raises(TypeError, match=r"allow must be an fnmatch pattern \(str\) or an iterable of them"):
        nanscan.replay(outcomes[()].bundle_path, model, allow=3)


class OutsideNaN(nn.Module):
    """Adds a tensor kept as a plain attribute (not a buffer: not in the bundle, made before the step)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.offset = torch.tensor([0.0, float("nan"), 0.0, 0.0])

    def forward(self, x):
        return self.lin(x) + self.offset


def test_cannot_tell_a_value_made_before_the_step(tmp_path):
    model = OutsideNaN()
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=model, batch=torch.randn(2, 4))
    result = nanscan.replay(path, model, backward=False)
    assert result.reproduced and result.first_op is None and result.nonfinite_before == []
    assert "cannot tell which op made it" in str(result), str(result)
    assert "made before the step" in result.cannot_tell and "aten.add.Tensor in (model)" in result.cannot_tell


class Overflow(nn.Module):
    def forward(self, x):
        return torch.exp(x * 100.0)  # +inf wherever x > 0.9


class MedianOfThree(nn.Module):
    """Three modules overflow at the same places; the median is +inf only where two of them are."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = Overflow(), Overflow(), Overflow()

    def forward(self, x):
        return torch.stack([self.a(x), self.b(x), self.c(x)]).median(dim=0).values.sum()


class MinOfTwo(nn.Module):
    """``minimum(a, b)`` is +inf only where both are: each is needed, neither is enough alone."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Overflow(), Overflow()

    def forward(self, x):
        return torch.minimum(self.a(x), self.b(x)).sum()


def test_cannot_tell_apart_origins_that_only_fail_together(tmp_path):
    x = torch.tensor([1.0, 0.0, 2.0])
    path = nanscan.capture_bundle(str(tmp_path / "median"), model=MedianOfThree(), batch=x)
    result = nanscan.replay(path, MedianOfThree())
    assert result.reproduced and result.first_op is None, str(result)
    assert "none of them alone makes it non-finite" in result.cannot_tell and len(result.candidates) == 3
    # two origins that are each needed: the earlier one is on the path, and first
    path = nanscan.capture_bundle(str(tmp_path / "min"), model=MinOfTwo(), batch=x)
    both = nanscan.replay(path, MinOfTwo())
    assert (both.first_op, both.module, both.inputs_finite) == ("aten.exp.default", "a", True), str(both)


class TwoLayers(nn.Module):
    """A bundle's model, and (``--model tests.test_replay:<factory>``) the ways a factory drifts from it."""

    def __init__(self, hidden: int = 8, added: int = 0):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 2)
        self.added = nn.Sequential(*(nn.Linear(2, 2) for _ in range(added)))

    def forward(self, x):
        return self.added(self.fc2(torch.relu(self.fc1(x)))).sum()


def two_layers():
    return TwoLayers()


def a_layer_added():
    return TwoLayers(added=1)


def three_layers_added():
    return TwoLayers(added=3)


def widened():
    return TwoLayers(hidden=16)


def test_a_model_that_does_not_fit_the_bundle_names_the_keys(tmp_path):
    # load_state_dict's RuntimeError came out as it was: a traceback, which the CLI exited 1 on ("reproduced")
    path = nanscan.capture_bundle(str(tmp_path / "b"), model=two_layers(), batch=torch.randn(3, 4))
    start = "nanscan.replay: the model does not fit the bundle's saved state (is it built the way the captured " \
            "model was?): "
    with pytest.raises(ValueError) as added:
        nanscan.replay(path, a_layer_added())
    assert str(added.value) == start + "missing keys (in the model, not in the bundle): added.0.weight, added.0.bias"
    with pytest.raises(ValueError) as wide:
        nanscan.replay(path, widened())
    assert str(wide.value) == start + ("shape mismatches: fc1.weight (bundle [8, 4], model [16, 4]), fc1.bias "
                                       "(bundle [8], model [16]), fc2.weight (bundle [2, 8], model [2, 16])")
    with pytest.raises(ValueError) as removed:  # a bundle holding more than the model: unexpected keys
        nanscan.replay(nanscan.capture_bundle(str(tmp_path / "big"), model=three_layers_added(),
                                              batch=torch.randn(3, 4)), two_layers())
    assert str(removed.value) == start + ("unexpected keys (in the bundle, not in the model): added.0.weight, "
                                          "added.0.bias, added.1.weight, added.1.bias and 2 more")
    assert not nanscan.replay(path, two_layers()).reproduced  # the model it was captured from still fits


def test_bisect_says_its_conclusion(tmp_path):
    everywhere = nanscan.capture_bundle(str(tmp_path / "log"), model=M.log_net(), batch=torch.randn(4, 8))
    results = nanscan.bisect_backends(everywhere, M.log_net(), backends=("eager", "aot_eager"))
    assert results.conclusion.startswith("non-finite on every backend: not a compiler bug")
    assert str(results).splitlines()[-1] == f"conclusion: {results.conclusion}"
    assert list(results) == ["eager", "aot_eager"] and results["eager"].finite is False  # still a dict

    torch.manual_seed(0)
    clean = nn.Linear(8, 1)
    path = nanscan.capture_bundle(str(tmp_path / "clean"), model=clean, batch=torch.randn(4, 8))
    results = nanscan.bisect_backends(path, clean, backends=("eager", "aot_eager"))
    assert results.conclusion.startswith("finite on every backend that ran")

    def compiled_only(model, x):  # NaN only in the traced graph: what a compiler bug looks like
        return model(x) * (float("nan") if torch.compiler.is_compiling() else 1.0)

    results = nanscan.bisect_backends(path, clean, forward=compiled_only, backends=("eager", "aot_eager"))
    assert results.conclusion.startswith("finite in eager, non-finite under aot_eager: a compiler bug candidate")
    results = nanscan.bisect_backends(path, M.drop_net()[0], backends=("eager", "aot_eager"))
    assert results.conclusion.startswith("every backend failed (2): nothing was checked")

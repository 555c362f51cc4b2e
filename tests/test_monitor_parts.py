"""Unit tests of the monitor's parts, beside the end-to-end tests: the options (WatchConfig), the step
state machine (StepState), a read's assembly (Read) and what is judged of it (Findings)."""
import dataclasses
import inspect

import pytest
import torch

import nanscan
from nanscan.monitor.config import FIELDS, WatchConfig
from nanscan.monitor.findings import Findings
from nanscan.monitor.read import Read
from nanscan.monitor.readback import Copy
from nanscan.monitor.slots import Slot
from nanscan.monitor.state import Delimiter, RootCall, StepState
from nanscan.record import RECORD_SIZE, Field


# ----------------------------------------------------------------------------------- WatchConfig
def test_config_defaults_are_the_documented_ones_and_it_is_frozen():
    cfg = WatchConfig()
    assert (cfg.every, cfg.mode, cfg.on_nonfinite, cfg.eval_forwards, cfg.compiled_grads) == (
        1, "sync", "raise", "check", "hooks")
    assert cfg.activations and cfg.grads and cfg.params and cfg.buffers and not cfg.optimizer_state
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.every = 2


def test_config_normalizes_shorthands_once():
    cfg = WatchConfig(compiled_grads=True, headroom_bits=True, allow=["*.mask"])
    assert cfg.compiled_grads == "taps" and cfg.compiled_grad_taps and not cfg.compiled_grad_hooks
    assert cfg.headroom_bits == nanscan.headroom.SUGGESTED_BITS
    assert cfg.allow == ("*.mask",)
    assert WatchConfig(compiled_grads=False).compiled_grads == "off"
    # gradients of module outputs need the activations
    assert not WatchConfig(activations=False).records_activation_grads
    assert not WatchConfig(activations=False, compiled_grads="taps").compiled_grad_taps


@pytest.mark.parametrize("options, error, text", [
    (dict(every=0), ValueError, "every must be an int >= 1"),
    (dict(every=True), ValueError, "every must be an int >= 1"),
    (dict(mode="later"), ValueError, "mode must be one of"),
    (dict(grads="yes"), TypeError, "grads must be True or False"),
    (dict(keep_pre_update_state=True), ValueError, "needs capture_dir"),
    (dict(headroom_cast={"*": torch.float16}), ValueError, "needs headroom_bits"),
    (dict(headroom_bits=0), ValueError, "headroom_bits must be a number of bits"),
    (dict(log=3), TypeError, "log must be a path"),
    (dict(allow=[3]), TypeError, "allow must be an fnmatch pattern"),
])
def test_config_refuses_bad_values_naming_what_is_accepted(options, error, text):
    with pytest.raises(error, match=text):
        WatchConfig(**options)


def test_config_of_replaces_fields_and_refuses_unknown_options():
    base = WatchConfig(every=4, mode="async")
    assert WatchConfig.of(base, {}) is base
    assert WatchConfig.of(base, {"every": 2}) == WatchConfig(every=2, mode="async")
    with pytest.raises(TypeError, match="unknown option.*'evry'.*every"):
        WatchConfig.of(None, {"evry": 2})
    with pytest.raises(TypeError, match="config must be a nanscan.WatchConfig"):
        WatchConfig.of({"every": 2}, {})


def test_watch_takes_a_config_and_lists_its_fields_in_its_signature():
    params = inspect.signature(nanscan.watch).parameters
    assert list(params)[:3] == ["model", "optimizer", "scaler"]
    assert set(FIELDS) | {"config"} == set(list(params)[3:])
    assert params["every"].default == 1 and params["every"].kind is inspect.Parameter.KEYWORD_ONLY
    model = torch.nn.Linear(2, 2)
    with nanscan.watch(model, config=WatchConfig(every=3, on_nonfinite="record"), mode="async") as mon:
        assert mon.config == WatchConfig(every=3, on_nonfinite="record", mode="async")
    with pytest.raises(TypeError, match="unknown option"):
        nanscan.watch(model, evry=3)


# ------------------------------------------------------------------------------------- StepState
def _state(every=1):
    calls = []
    return StepState(every, on_recording=lambda: calls.append(1)), calls


def test_an_implicit_step_keeps_its_first_forward_and_resets_at_its_end():
    state, calls = _state()
    assert state.forward_began(train_mode=True) is True  # the step's batch
    assert state.forward_began(train_mode=True) is False  # a second outermost call: not the batch
    state.update_attempted()
    state.update_applied(True)
    state.was_read()
    assert (state.forward_seen, state.attempted, state.applied, state.read) == (True, True, True, True)
    state.next_step()
    assert state.index == 1 and calls == [1]
    assert (state.forward_seen, state.root, state.attempted, state.applied, state.read) == (
        False, RootCall.NONE, False, False, False)


def test_a_train_mode_forward_after_eval_mode_ones_is_the_steps_batch():
    state, _ = _state()
    assert state.forward_began(train_mode=False) is True and state.root is RootCall.EVAL
    assert state.forward_began(train_mode=False) is False
    assert state.forward_began(train_mode=True) is True and state.root is RootCall.TRAIN
    assert state.forward_began(train_mode=False) is False


def test_an_aborted_forward_gives_the_batch_to_the_next_one_except_in_a_block():
    state, _ = _state()
    state.forward_began(True)
    state.forward_aborted()
    assert state.forward_began(True) is True
    state.block_entered()
    state.forward_aborted()
    assert state.root is RootCall.TRAIN  # the block owns its batch


def test_every_samples_steps_and_close_turns_recording_off():
    state, calls = _state(every=3)
    checked = []
    for _ in range(7):
        checked.append(state.checking)
        state.next_step()
    assert checked == [True, False, False, True, False, False, True]
    assert state.recording is False  # step 7: not sampled
    state.next_step(); state.next_step()  # noqa: E702
    assert state.recording is True
    state.close()
    assert state.recording is False and calls == [1] * 10


def test_an_explicit_block_that_ends_before_its_update_awaits_it():
    state, _ = _state()
    state.block_entered()
    assert state.in_block and state.forward_seen
    state.block_awaits_update()
    state.block_left()  # (the block's finally: leaves a step awaiting its update as it is)
    assert state.delimiter is Delimiter.AWAITING_UPDATE and not state.in_block
    state.update_attempted()  # opt.step() after the block: the block's update
    assert state.delimiter is Delimiter.IMPLICIT
    state.block_entered()
    state.block_awaits_update()
    state.block_left()
    state.next_step()  # the update never came: the next step begins
    assert state.delimiter is Delimiter.IMPLICIT
    state.block_entered()
    state.next_step()  # a step that ends inside its block stays in it until the block is left
    assert state.in_block
    state.block_left()
    assert state.delimiter is Delimiter.IMPLICIT


# ------------------------------------------------------------------------------ Read and Findings
def _record(nan=0, posinf=0, fmin=0.0, fmax=1.0):
    r = [0.0] * RECORD_SIZE
    r[Field.NAN_COUNT] = nan
    r[Field.POSINF_COUNT] = posinf
    r[Field.FINITE_MIN], r[Field.FINITE_MAX] = fmin, fmax
    r[Field.FIRST_NONFINITE] = 0 if nan or posinf else -1
    return r


def _landed(records, slots):
    copy = Copy.start([torch.tensor(records, dtype=torch.float64)], slots, [], None, handled=False, step=slots[0].step,
                      non_blocking=False)
    return Read.land(copy, None, link_compiled_weights=False)


def _slots(step=0):
    x = Slot(step, "forward", "activation", "embed", torch.float32, (2, 2))
    h = Slot(step, "forward", "activation", "mlp", torch.float32, (2, 2), inputs=(0,))
    out = Slot(step, "forward", "activation", "head", torch.float32, (2, 2), inputs=(1,))
    return [x, h, out]


def test_a_landed_read_holds_the_rows_in_order_and_decodes_only_what_is_asked():
    read = _landed([_record(), _record(nan=2), _record(nan=4)], _slots(step=5))
    assert len(read) == 3 and read.step == 5 and read.training and not read.final and not read.compiled
    assert read.bad == {1, 2} and read.position is None and read.eager_count == 3
    assert read.values(1)[Field.NAN_COUNT] == 2 and read.slot(2).name == "head"
    assert read.steps_mixing_eager_and_compiled() == set()


def test_findings_name_the_first_produced_value_once_per_step_and_phase():
    findings = Findings(allow=(), rank=0)
    read = _landed([_record(), _record(nan=2), _record(nan=4)], _slots(step=5))
    found = findings.judge(read)
    assert [(i.name, i.step, i.phase, i.produced) for i in found] == [("mlp", 5, "forward", True)]
    assert findings.offenders == {5: ["mlp", "head"]}
    found, report = findings.agree(read, found)
    assert report is found[0]
    findings.add(found)
    assert findings.first is report
    assert findings.judge(read) == []  # the same step and phase, read again: nothing new
    assert "Also non-finite" not in findings.also(read, report)  # head was computed from mlp: propagated
    assert "1 value(s) in this step were computed from non-finite ones" in findings.also(read, report)
    assert findings.allow_patterns() == ("mlp", "head")


def test_allowed_names_are_not_incidents_and_incidents_stay_in_training_order():
    findings = Findings(allow=("mlp",), rank=0)
    read = _landed([_record(), _record(nan=2), _record()], _slots(step=1))
    assert findings.judge(read) == [] and findings.offenders == {}
    later = _landed([_record(posinf=1), _record(), _record()], _slots(step=3))
    earlier = _landed([_record(posinf=1), _record(), _record()], _slots(step=2))
    findings.add(findings.judge(later))
    findings.add(findings.judge(earlier))
    assert [i.step for i in findings.incidents] == [2, 3]
    first = findings.incidents[0]
    assert (first.name, first.summary.posinf_count, first.summary.first_nonfinite_index) == ("embed", 1, 0)


class _NoBundle:
    """Stands in for StepCapture where no bundle is kept (capture_dir None)."""
    bundle_path = None
    bundle_step = None


def _outcomes(**options):
    from nanscan.monitor.ledger import Ledger
    from nanscan.monitor.outcomes import Outcomes

    written = []
    outcomes = Outcomes(WatchConfig(**options), Ledger(), Findings(allow=(), rank=0), steplog=None,
                        consumers=[], capturer=_NoBundle(), write_bundle=written.append)
    return outcomes, written


def test_outcomes_raise_warn_or_record_a_reported_incident_as_configured():
    outcomes, written = _outcomes()
    with pytest.raises(nanscan.NonFiniteError, match="mlp"):
        outcomes.decide(_landed([_record(), _record(nan=2), _record(nan=4)], _slots(step=5)), raise_incident=True)
    assert outcomes.raised and written == []  # no capture_dir: no bundle
    outcomes, _ = _outcomes(on_nonfinite="warn")
    with pytest.warns(RuntimeWarning, match="mlp"):
        outcomes.decide(_landed([_record(), _record(nan=2), _record()], _slots(step=5)), raise_incident=True)
    assert not outcomes.raised and [i.name for i in outcomes.findings.incidents] == ["mlp"]
    outcomes, _ = _outcomes()
    outcomes.decide(_landed([_record(), _record(nan=2), _record()], _slots(step=5)), raise_incident=None)
    assert not outcomes.raised and len(outcomes.findings.incidents) == 1  # None: recorded, silently


def test_outcomes_take_the_scalars_read_with_the_records():
    outcomes, _ = _outcomes()
    read = _landed([_record(), _record(), _record()], _slots(step=4))
    read.extras.update(scale=1024.0, found_inf=1.0)
    outcomes.decide(read, raise_incident=True)
    assert outcomes.ledger.scale_history == [(4, 1024.0)]
    assert read.handled  # a fused-AMP kernel found an Inf: it skipped the update
    assert outcomes.fused_applied == {4: False}  # the step has not ended: its post-hook takes the answer


def _payload(raw, counts=None, loss=1.0, grad_norm=2.0, clipped=False, contrib=4.0, nonfinite=0):
    return {"raw": raw, "counts": counts or {}, "clipped": clipped, "grad_contrib": contrib,
            "step": {"loss": loss, "grad_norm": grad_norm, "loss_scale": 8.0, "updates_skipped": 1,
                     "nonfinite": nonfinite}}


def test_global_telemetry_adds_outputs_and_shards_and_checks_replicas():
    from nanscan.monitor.health_ranks import combine

    out, w_plain, w_shard = ("rms/a",), ("norm/w",), ("norm/s",)
    r0 = _payload({out: (10, 9, 4.0, 2, 3.0, 65504.0), w_plain: (6, 5.0, 1.5, "plain"),
                   w_shard: (3, 1.0, 0.5, "counted")}, {"nonfinite/a": (1, "activation")}, loss=1.0, nonfinite=1)
    r1 = _payload({out: (10, 10, 6.0, 0, 5.0, 65504.0), w_plain: (6, 5.0, 1.5, "plain"),
                   w_shard: (3, 2.0, 0.75, "counted")}, {"nonfinite/a": (2, "activation")}, loss=3.0, nonfinite=2)
    warned = set()
    raw, counts, values = combine([r0, r1], publisher=0, sharded=False, names=warned)
    assert raw[out] == (20, 19, 10.0, 2, 5.0, 65504.0)  # counts and sums add, the max is the max
    assert raw[w_plain] == (6, 5.0, 1.5, "plain")  # replicated: one copy
    assert raw[w_shard] == (6, 3.0, 0.75, "counted")  # shards: added
    assert counts == {"nonfinite/a": 3}
    assert values == {"loss": 2.0, "grad_norm": 2.0, "loss_scale": 8.0, "updates_skipped": 1, "nonfinite": 3}
    assert warned == set()


def test_global_telemetry_leaves_out_what_it_cannot_know():
    from nanscan.monitor.health_ranks import combine

    w, p, s = ("norm/w",), ("norm/p",), ("norm/s",)
    r0 = _payload({w: (6, 5.0, 1.5, "plain"), p: (6, 5.0, 1.5, "unknown"), s: (3, 1.0, 0.5, "counted")},
                  {"grad_nonfinite/w": (1, "plain")}, grad_norm=2.0)
    r1 = _payload({w: (6, 7.0, 1.5, "plain"), p: (6, 5.0, 1.5, "unknown"), s: (3, 9.0, 0.5, "replica")},
                  grad_norm=3.0)
    warned = set()
    with pytest.warns(RuntimeWarning, match="cannot be known"):
        raw, counts, values = combine([r0, r1], publisher=0, sharded=False, names=warned)
    assert list(raw) == [s] and raw[s] == (3, 1.0, 0.5, "counted")  # the replica's copy is not counted again
    assert counts == {} and values["grad_norm"] is None  # replicated gradients that differ: no global norm
    assert warned == {"norm/w", "norm/p", "grad_nonfinite/w", "nanscan/grad_norm"}
    raw, _, values = combine([r0, _payload(r1["raw"], grad_norm=float("nan"))], publisher=0, sharded=False,
                             names=warned)  # (warned once: no second warning)
    assert values["grad_norm"] != values["grad_norm"]  # a non-finite norm on any rank is non-finite
    _, _, values = combine([_payload({}, contrib=9.0), _payload({}, contrib=16.0, grad_norm=9.9)], publisher=1,
                           sharded=True)
    assert values["grad_norm"] == 5.0  # a sharded model's norm: its ranks' shares
    _, _, values = combine([_payload({}, loss=float("inf")), _payload({}, loss=None)], publisher=0, sharded=True,
                           names=None)
    assert values["loss"] != values["loss"]

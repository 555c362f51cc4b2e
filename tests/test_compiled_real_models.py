"""Compiled = eager on real models: transformers' GPT-2 and Llama and a timm ViT, at 4, 12 and 24
layers, watched then compiled. Their forwards break dynamo's graphs (transformers' cache and output
capturing) and recompile a block per layer until dynamo's recompile limit, after which blocks run
eagerly beside compiled graphs: every module's hooks are then frames of their own, and eager
records interleave with compiled rows in one forward. A weight made infinite after clean steps must
be named as eager names it (step, phase, module, kind, produced); nanscan's own functions are never
compiled as frames of their own (so never recompiled per module); and where the order of eager and
compiled records cannot be known, the incident says "cannot tell" -- never a module named with
certainty that did not produce the value.

aot_eager (dynamo and AOT autograd: the frames, graph breaks and recompiles that matter here) at
every size; inductor, ``torch.compile``'s default backend, at 12 layers (its C++ code generation
is most of a CPU test's time)."""
import warnings

import pytest
import torch

import nanscan

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

STEPS, FAULT_STEP = 4, 2


def gpt2(layers):
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=layers, n_head=2,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config), f"transformer.h.{layers // 2}.mlp.c_fc"


def llama(layers):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config), f"model.layers.{layers // 2 + 1}.mlp.down_proj"


def vit(layers):
    model = timm.create_model("vit_tiny_patch16_224", depth=layers, img_size=32, patch_size=8, num_classes=10)
    return model, f"blocks.{layers // 2}.mlp.fc2"


MODELS = {"gpt2": gpt2, "llama": llama, "vit": vit}


def loss_of(kind, forward, step):
    g = torch.Generator().manual_seed(step)
    if kind == "vit":
        x = torch.randn(2, 3, 32, 32, generator=g)
        return torch.nn.functional.cross_entropy(forward(x), torch.tensor([1, 3]))
    ids = torch.randint(0, 256, (2, 32), generator=g)
    return forward(input_ids=ids, labels=ids).loss  # (the loss computed inside the model: HF ModelOutput)


def train(kind, layers, compile_kw=None, watch_options=None):
    """A plain loop, watched (then compiled with ``compile_kw``); an Inf written into one block's
    weight before step FAULT_STEP. Returns (incident key or None, the planted module's name, monitor)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, target = MODELS[kind](layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nanscan.watch(model, opt, **(watch_options or {}))
    forward = model if compile_kw is None else torch.compile(model, **compile_kw)
    incident = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dynamo's recompile-limit and transformers' config warnings)
        try:
            with mon:
                for step in range(STEPS):
                    if step == FAULT_STEP:
                        with torch.no_grad():
                            model.get_submodule(target).weight[0, 0] = float("inf")
                    loss_of(kind, forward, step).backward()
                    opt.step()
                    opt.zero_grad()
        except nanscan.NonFiniteError as e:
            incident = e.incident
    if incident is None:
        return None, target, mon
    return (incident.step, incident.phase, incident.name, incident.kind, incident.produced), target, mon


def nanscan_frames_compiled() -> list:
    """Code objects of nanscan's own that dynamo compiled as frames of their own since its last reset."""
    import os

    from torch._dynamo import convert_frame

    root = os.path.dirname(nanscan.__file__)
    codes = [ref() for ref in convert_frame.input_codes.seen]
    return [f"{c.co_name} ({c.co_filename}:{c.co_firstlineno})" for c in codes
            if c is not None and c.co_filename.startswith(root)]


_EAGER = {}


def eager_answer(kind, layers):
    if (kind, layers) not in _EAGER:
        _EAGER[kind, layers] = train(kind, layers)[:2]
    return _EAGER[kind, layers]


def check_compiled_equals_eager(kind, layers, compile_kw):
    eager, target = eager_answer(kind, layers)
    assert eager == (FAULT_STEP, "forward", target, "activation", True)  # (the test plants what it means to)
    compiled, _, mon = train(kind, layers, compile_kw)
    assert compiled == eager
    assert nanscan_frames_compiled() == []  # the hooks ran eagerly where they were frames of their own
    return mon


@pytest.mark.parametrize("layers", [4, 12, 24])
@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_aot_eager_names_the_planted_module_as_eager_does(kind, layers):
    check_compiled_equals_eager(kind, layers, dict(backend="aot_eager", fullgraph=False))


@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_with_the_default_backend_names_the_planted_module_as_eager_does(kind):
    check_compiled_equals_eager(kind, 12, {})  # torch.compile(model): inductor, fullgraph=False


def test_clean_compiled_steps_have_no_incident():
    found, _, mon = train("gpt2", 12, dict(backend="aot_eager"), watch_options=dict(on_nonfinite="record"))
    # (the planted Inf is found; nothing before it)
    assert found is None and [inc.step for inc in mon.incidents][:1] == [FAULT_STEP]
    assert nanscan_frames_compiled() == []


def test_when_the_host_count_disagrees_the_incident_says_cannot_tell(monkeypatch):
    """The order of eager records among compiled rows rests on the host's count of stamped rows
    matching the device's (Note [stamps counted on the host]): a stamp whose device write ran
    without its host code (a CUDA graph's replay) breaks it. Made to disagree here, the step's
    incident must say "cannot tell" -- produced None, order unknown -- never a place as certain."""
    from nanscan.monitor.traced import TracedRows

    counted = TracedRows.stamped
    monkeypatch.setattr(TracedRows, "stamped", lambda self: counted(self) + 1)
    found, target, mon = train("gpt2", 12, dict(backend="aot_eager"))
    assert found is not None and found[:2] == (FAULT_STEP, "forward") and found[4] is None
    assert mon.incidents[0].order_known is False

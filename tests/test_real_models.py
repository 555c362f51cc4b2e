"""nanscan.watch on third-party models (random weights, tiny configs, CPU): clean steps give no
false positive, planted faults are named with step, phase, module and produced -- plain loops,
no mon.step. transformers (GPT-2, Llama, BERT) and timm (resnet18, vit_tiny)."""
import pytest
import torch

import nanscan

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")


def gpt2(**overrides):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, **overrides)
    return transformers.GPT2LMHeadModel(config)


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def lm_batch(step, pad=False):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, 10:] = 0  # padding: masked positions (-inf or finfo.min in the attention)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def train_hf(model, steps, batch_fn, *, lr=1e-3, autocast=None, optimizer=torch.optim.AdamW, **watch_options):
    """The plain HF loop: loss = model(**batch).loss; no mon.step. Returns (monitor, error)."""
    opt = optimizer(model.parameters(), lr=lr)
    mon = nanscan.watch(model, opt, **watch_options)
    error = None
    try:
        with mon:
            for step in range(steps):
                batch = batch_fn(step)
                with torch.autocast("cpu", dtype=torch.float16, enabled=autocast is not None and step >= autocast):
                    loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
    except nanscan.NonFiniteError as e:
        error = e
    return mon, error


def key(inc):
    return (inc.step, inc.phase, inc.name, inc.kind, inc.produced)


@pytest.mark.parametrize("make,pad", [(gpt2, False), (gpt2, True), (llama, True), (bert, True)],
                         ids=["gpt2", "gpt2-padded", "llama-padded", "bert-padded"])
def test_clean_transformers_steps_have_no_false_positive(make, pad):
    model = make()

    def batch(step):
        b = lm_batch(step, pad)
        if make is bert:
            b["labels"] = torch.tensor([0, 2])
        return b

    mon, error = train_hf(model, 3, batch)
    assert error is None and mon.incidents == [] and mon.ledger.applied == 3


def test_gpt2_fp16_overflow_in_a_named_mlp_module():
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1e6)  # finite in fp32; its fp16 output overflows
    mon, error = train_hf(model, 3, lm_batch, autocast=1)  # fp16 autocast from step 1 on
    assert error is not None
    assert key(error.incident) == (1, "forward", "transformer.h.1.mlp.c_fc", "activation", True)


def test_gpt2_loss_only_nan_is_the_loss():
    def batch(step):
        b = lm_batch(step)
        if step == 2:
            b["labels"][:] = -100  # every position ignored: the mean over no token is NaN
        return b

    mon, error = train_hf(gpt2(), 4, batch)
    assert key(error.incident) == (2, "loss", "loss", "loss", True)


def test_gpt2_lr_overflow_is_named_where_the_first_nan_is_made():
    # lr=1e30: step 0's update leaves the weights finite but huge (no update incident: nothing was
    # non-finite yet); step 1's first LayerNorm squares them past FP32 and makes the NaN.
    mon, error = train_hf(gpt2(), 3, lm_batch, lr=1e30, optimizer=torch.optim.SGD)
    assert key(error.incident) == (1, "forward", "transformer.h.0.ln_1", "activation", True)
    assert mon.ledger.applied == 1 and not [i for i in mon.incidents if i.step == 0]


def test_gpt2_nan_in_inputs_embeds_is_propagated_from_the_batch():
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nanscan.watch(model, opt)
    with pytest.raises(nanscan.NonFiniteError) as err, mon:
        for step in range(3):
            b = lm_batch(step)
            embeds = model.transformer.wte(b["input_ids"]).detach()
            if step == 1:
                embeds[0, 3, 5] = float("nan")
            model(inputs_embeds=embeds, labels=b["labels"]).loss.backward()
            opt.step()
            opt.zero_grad()
    inc = err.value.incident
    assert (inc.step, inc.phase, inc.produced) == (1, "forward", False)
    assert "(model).input.inputs_embeds" in inc.inputs


def test_gpt2_gradient_checkpointing_clean_and_faulty():
    model = gpt2()
    model.gradient_checkpointing_enable()
    model.train()
    mon, error = train_hf(model, 2, lm_batch)
    assert error is None and mon.incidents == []
    model = gpt2()
    model.gradient_checkpointing_enable()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1e6)
    mon, error = train_hf(model, 3, lm_batch, autocast=1)
    assert key(error.incident) == (1, "forward", "transformer.h.1.mlp.c_fc", "activation", True)


def test_gpt2_compiled_equals_eager_on_the_fp16_overflow():
    def run(compiled):
        torch._dynamo.reset()
        model = gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = nanscan.watch(model, opt)
        fwd = torch.compile(model, backend="aot_eager") if compiled else model
        with pytest.raises(nanscan.NonFiniteError) as err, mon:
            for step in range(3):
                if step == 1:  # the weights change, the graph does not: one compile
                    with torch.no_grad():
                        model.transformer.h[1].mlp.c_fc.weight.mul_(1e6)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = fwd(**lm_batch(step)).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
        return err.value.incident

    assert key(run(True)) == key(run(False)) == (1, "forward", "transformer.h.1.mlp.c_fc", "activation", True)


def train_timm(model, steps, plant=None, **watch_options):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nanscan.watch(model, opt, **watch_options)
    error = None
    try:
        with mon:
            for step in range(steps):
                if plant is not None:
                    plant(model, step)
                x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(step))
                torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 3])).backward()
                opt.step()
                opt.zero_grad()
    except nanscan.NonFiniteError as e:
        error = e
    return mon, error


@pytest.mark.parametrize("name,kwargs", [("resnet18", {}), ("vit_tiny_patch16_224", {"img_size": 64})])
def test_clean_timm_steps_have_no_false_positive(name, kwargs):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    mon, error = train_timm(model, 2)
    assert error is None and mon.incidents == []
    model.eval()
    with torch.no_grad():  # an eval pass after training: checked, nothing to report
        model(torch.randn(2, 3, 64, 64))
    assert mon.incidents == []


def test_resnet_conv_weight_overflow_reaches_batchnorm_running_var():
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)

    def plant(model, step):
        if step == 1:
            with torch.no_grad():
                model.conv1.weight.mul_(1e30)  # finite activations after BN; their variance is not

    mon, error = train_timm(model, 3, plant)
    inc = error.incident
    assert (inc.step, inc.phase, inc.name, inc.kind) == (1, "update", "bn1.running_var", "buffer")

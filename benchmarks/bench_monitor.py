"""A training step with and without nanscan.watch (activations + grads + params, every step),
eager and compiled; ratio = overhead."""
import pytest
import torch
from torch.nn import functional as F

import nanscan
from benchmarks.models import GPT

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU: the small GPT (4 layers, d=256, seq 128, batch 8). GPU: GPT-2 small (12 layers,
# d=768, vocab 50257, seq 512, batch 8) in bf16 autocast, the size the always-on targets are about.
CONFIG = (dict(vocab=50257, d=768, layers=12, heads=12, seq=512) if DEVICE == "cuda"
          else dict(vocab=1024, d=256, layers=4, heads=4, seq=128))
NAME = "gpt2-small bf16" if DEVICE == "cuda" else "gpt 4x256"
GROUP = f"train step {NAME} (eager)"


def make():
    torch.manual_seed(0)
    model = GPT(**CONFIG).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, CONFIG["vocab"], (8, CONFIG["seq"]), device=DEVICE)
    return model, opt, idx


def step(model, opt, idx, mon=None):
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
    if mon is not None:
        mon.check_loss(loss)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def test_step_without_watch(run_bench):
    model, opt, idx = make()
    run_bench(lambda: step(model, opt, idx), GROUP, "train step", baseline=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_with_watch(run_bench, mode):
    model, opt, idx = make()
    mon = nanscan.watch(model, opt, mode=mode)

    def watched():
        with mon.step():
            return step(model, opt, idx, mon)

    with mon:
        run_bench(watched, GROUP, f"train step + watch({mode})")


GROUP_COMPILED = f"train step {NAME} (compiled)"


@pytest.fixture(scope="module")
def compiled_pair():
    """Two identical models: one compiled bare, one watched and then compiled (same inductor)."""
    torch._dynamo.reset()
    bare, bare_opt, idx = make()
    watched, watched_opt, _ = make()
    mon = nanscan.watch(watched, watched_opt)
    yield (torch.compile(bare), bare_opt, idx), (torch.compile(watched), watched_opt, mon)
    mon.close()


def test_compiled_step_without_watch(run_bench, compiled_pair):
    (model, opt, idx), _ = compiled_pair
    step(model, opt, idx)  # compile outside the timing
    run_bench(lambda: step(model, opt, idx), GROUP_COMPILED, "compiled train step", baseline=True)


def test_compiled_step_with_watch(run_bench, compiled_pair):
    (_, _, idx), (model, opt, mon) = compiled_pair

    def watched():
        with mon.step():
            return step(model, opt, idx, mon)

    watched()  # compile outside the timing
    run_bench(watched, GROUP_COMPILED, "compiled train step + watch(sync)")

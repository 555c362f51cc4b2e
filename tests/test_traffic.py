"""benchmarks/traffic.py: the traffic account of a watched step, pinned against a hand count on a
tiny model (every kind's records and bytes, the op calls and their tensors, the syncs)."""
import json

import pytest
import torch
from torch import nn

import nanscan
from benchmarks import traffic
from nanscan.monitor.tensors import ModelTensors

kernels_for = ModelTensors.kernels_for

BATCH = 5


def tiny(dtype=torch.float32):
    """Linear(4, 3) -> BatchNorm1d(3) -> Linear(3, 2), Adam, a (5, 4) batch: shapes small enough to
    count by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, 4, dtype=dtype)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def hand_count(itemsize):
    """kind -> (records, bytes) of one steady-state step of ``tiny``, counted from the shapes."""
    params = [3 * 4, 3, 3, 3, 2 * 3, 2]  # 0.weight, 0.bias, 1.weight, 1.bias, 2.weight, 2.bias
    return {
        # the outputs of the Linear, the BatchNorm and the last Linear (the Sequential's output is that
        # same tensor: one record)
        "activations": (3, (BATCH * 3 + BATCH * 3 + BATCH * 2) * itemsize),
        # the gradients flowing into those three outputs
        "activation grads": (3, (BATCH * 2 + BATCH * 3 + BATCH * 3) * itemsize),
        "parameters": (6, sum(params) * itemsize),
        "parameter grads": (6, sum(params) * itemsize),
        # running_mean and running_var (num_batches_tracked is an integer: not checked)
        "buffers": (2, (3 + 3) * itemsize),
        # Adam's exp_avg and exp_avg_sq of each parameter (its one-element `step` is not checked)
        "optimizer state": (12, 2 * sum(params) * itemsize),
        "loss": (1, itemsize),
        "batch input": (1, BATCH * 4 * itemsize),  # recorded for attribution
    }


def steady_account(step, model, opt, warmup=3, **options):
    with nanscan.watch(model, opt, **options), traffic.every_read_gathered():
        for _ in range(warmup):
            step()
        return traffic.account_step(step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kind_is_what_the_step_reads_by_hand(dtype):
    model, opt, step = tiny(dtype)
    account = steady_account(step, model, opt, optimizer_state=True)
    expected = hand_count(dtype.itemsize)
    got = {kind: (e["records"], e["bytes"]) for kind, e in account["kinds"].items()}
    assert got == expected
    assert account["records"] == sum(r for r, _ in expected.values()) == 34
    assert account["bytes"] == sum(b for _, b in expected.values())
    assert account["reads"] == 1
    name = str(dtype).replace("torch.", "")
    assert account["kinds"]["parameters"]["dtypes"] == {name: 6}


def test_the_op_calls_are_the_parameter_set_and_the_buffers_on_cpu():
    """On the CPU (default kernels) the hooks' and the gradient sink's tensors are summarized on
    arrival, with no op call; the parameters, their gradients and the buffers are one
    summarize_many call each, made from C++ for the first two (seen through the dispatcher)."""
    model, opt, step = tiny()
    account = steady_account(step, model, opt, optimizer_state=True)
    calls = account["calls"]
    assert sorted(c["tensors"] for c in calls) == [2, 6, 6]
    assert {c["op"] for c in calls} == {"summarize_many"}
    assert all(c["groups"] == 1 and c["non_contiguous"] == 0 and c["dtypes"] == {"float32": c["tensors"]}
               for c in calls)
    assert account["op_calls"] == 3 and account["launches_implied"] == 6
    kinds = account["kinds"]
    assert account["op_bytes"] == sum(kinds[k]["bytes"] for k in traffic.OP_KINDS_ON_CPU) == (29 + 29 + 6) * 4
    assert account["op_tensors"] == 14
    assert account["rows_without_op_call"] == 34 - 14 == sum(
        kinds[k]["records"] for k in traffic.KINDS if k not in traffic.OP_KINDS_ON_CPU)


def test_with_the_reference_backend_every_row_is_in_a_batch_and_a_forward_is_one():
    """The reference backend on the CPU batches every record as a device does (nothing is summarized
    on arrival): its calls are noted where the monitor looks its kernels up. The forward's outputs,
    held by autograd, are one batch (Note [a batch bounded by what only it keeps alive])."""
    model, opt, step = tiny()
    account = steady_account(step, model, opt, optimizer_state=True, backend="reference")
    assert account["rows_without_op_call"] == 0 and account["op_tensors"] == account["records"] == 34
    # the forward first (the batch input and the 3 outputs: one batch), then the loss (recorded at
    # its backward), the gradients of the outputs, the parameter gradients, the parameters, the
    # optimizer state and the buffers
    tensors = [c["tensors"] for c in account["calls"]]
    assert tensors[0] == 4 and sorted(tensors) == [1, 2, 3, 4, 6, 6, 12]
    assert ModelTensors.kernels_for is kernels_for  # (the wrapper is removed after the step)


def test_one_sync_per_checked_step_in_sync_mode_and_none_when_unchecked():
    model, opt, step = tiny()
    assert steady_account(step, model, opt)["syncs"] == 1
    with nanscan.watch(model, opt, every=2):
        for _ in range(3):
            step()
        a, b = traffic.account_step(step), traffic.account_step(step)
    assert sorted((a["syncs"], b["syncs"])) == [0, 1]
    unchecked = a if a["syncs"] == 0 else b
    assert unchecked["records"] == 0 and unchecked["op_calls"] == 0 and unchecked["reads"] == 0


def test_async_mode_lands_one_read_per_step_a_step_late():
    model, opt, step = tiny()
    account = steady_account(step, model, opt, mode="async")
    assert account["syncs"] == 1 and account["reads"] == 1
    assert account["kinds"]["parameters"]["records"] == 6


def test_the_wrappers_are_removed_after_the_step():
    land, wait = traffic.Read.__dict__["land"], traffic.Copy.__dict__["wait"]
    model, opt, step = tiny()
    steady_account(step, model, opt)
    assert traffic.Read.__dict__["land"] is land and traffic.Copy.__dict__["wait"] is wait


def test_launches_implied_follow_the_cuda_kernels_grouping():
    fp32, bf16 = torch.zeros(4, 3), torch.zeros(7, dtype=torch.bfloat16)
    strided = torch.zeros(3, 4).t()
    assert traffic.launches_implied("summarize_many", [fp32, bf16, fp32, strided]) == (2, 1, 5)
    assert traffic.launches_implied("summarize_many", [fp32, fp32]) == (1, 0, 2)
    assert traffic.launches_implied("summarize", [fp32]) == (1, 0, 1)


def test_the_gpt_account_matches_its_parameters_and_the_table_prints(tmp_path, capsys):
    kwargs = dict(layers=1, d=16, heads=2, vocab=32, seq=8, batch=2)
    result = traffic.measure(**kwargs, rounds=1, steps=1)
    model, _, _ = traffic.make_gpt(**kwargs, device="cpu")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kinds = result["account"]["kinds"]
    assert kinds["parameters"]["bytes"] == kinds["parameter grads"]["bytes"] == param_bytes
    assert kinds["parameters"]["records"] == len(list(model.parameters()))
    assert result["account"]["op_bytes"] == 2 * param_bytes  # (no buffers in the GPT)
    # the logits (batch x seq x vocab, fp32) are one of the activations, and their gradient one of the grads
    assert kinds["activations"]["bytes"] >= 2 * 8 * 32 * 4 and kinds["activation grads"]["records"] > 0
    assert result["time"]["ratio"] > 0
    out = tmp_path / "t.json"
    threads = torch.get_num_threads()
    assert traffic.main(["--layers", "1", "--d", "16", "--heads", "2", "--vocab", "32", "--seq", "8", "--batch", "2",
                         "--rounds", "1", "--steps", "1", "--bandwidth", "1e9", "--device", "cpu",
                         "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads  # (main's 1 thread on the CPU is restored)
    assert "| activation grads |" in printed and "fp32: records" in printed and "bf16 autocast: MiB" in printed
    saved = json.loads(out.read_text())
    assert saved["bandwidth"] == 1e9 and len(saved["results"]) == 2
    # µs at 1 GB/s of the parameters: their bytes / 1e9 * 1e6
    fp32 = saved["results"][0]["account"]["kinds"]["parameters"]["bytes"]
    n = len(list(model.parameters()))
    assert f"| parameters | {n} | {fp32 / 2**20:,.2f} | {fp32 / 1e9 * 1e6:,.1f} |" in printed


def test_the_table_prints_a_cuda_result():
    """The GPU run's extra rows (profiler, sync debug mode), from a result shaped as measure() makes
    it on CUDA: printed without a device."""
    model, opt, step = tiny()
    result = {"config": {"layers": 1, "d": 4, "heads": 1, "vocab": 8, "seq": 2, "batch": 5, "device": "cuda",
                         "autocast": "bf16", "mode": "sync", "parameters": 29, "torch": torch.__version__},
              "account": steady_account(step, model, opt)}
    result["account"].update(measured={"kernels": 40, "nanscan_kernels": 6, "nanscan_device_us": 12.5,
                                       "memcpy_dtoh": 1, "memcpy_htod": 0},
                             unwatched_measured={"kernels": 34, "nanscan_kernels": 0, "nanscan_device_us": 0,
                                                 "memcpy_dtoh": 0, "memcpy_htod": 0},
                             cuda_syncs={"watched": 1, "unwatched": 0})
    printed = traffic.table([result])
    assert "| nanscan kernels measured (CUDA profiler) | 6 |" in printed
    assert "| all kernels, watched / unwatched step (CUDA profiler) | 40 / 34 |" in printed
    assert "| their device time (µs, CUDA profiler) | 12.5 |" in printed
    assert "(sync debug mode) | 1 / 0 |" in printed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("autocast", [False, True])
def test_on_cuda_every_row_goes_through_an_op_call_in_the_launches_implied(autocast):
    """On a device nothing is summarized on arrival: the op calls of a steady-state step are the
    account (rows and bytes), and the profiler sees as many nanscan kernels as the calls imply."""
    result = traffic.measure(layers=1, d=16, heads=2, vocab=32, seq=8, batch=2, device="cuda", autocast=autocast,
                             rounds=0)
    account = result["account"]
    assert account["rows_without_op_call"] == 0
    assert account["op_tensors"] == account["records"] and account["op_bytes"] == account["bytes"]
    assert account["syncs"] == 1
    assert account["measured"]["nanscan_kernels"] == account["launches_implied"], account["measured"]
    assert isinstance(account["cuda_syncs"]["watched"], int)
    print(traffic.table([result]))

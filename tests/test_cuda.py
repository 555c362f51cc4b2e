"""GPU-only checks the CPU suite cannot make: CUDA-graph capture, no host sync, mixed devices,
determinism, and more than 2**31 elements; the monitor on CUDA (eager sync / async, and compiled
under CUDA graphs) naming the incidents the CPU run names; for the C++/CUDA single-tensor kernel (one launch, the
last block combines, a ticket it resets): 1, 2 and many blocks, back-to-back calls and graph
replays, concurrent streams, chunks of several 65536-element runs (sums of squares in runs of 256,
packed zero counts folded per run); summarize_many's borrowed and converted inputs; for its table
cache: hits, values changed in place, lists changed or swapped, eviction, no copy on a hit. (Every
backend vs reference on CUDA tensors runs in test_summarize.py, parametrized over the backends
available here.)"""
import pytest
import torch

import nanscan
from nanscan.kernels import reference
from tests.helpers import FLOAT8, assert_record_matches, cast, layouts, special_values, stable_seed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_BACKENDS = [b for b in ("cuda", "triton") if b in nanscan.available_backends()]
CUDA_KERNEL = pytest.mark.skipif("cuda" not in nanscan.available_backends(), reason="built without the CUDA kernels")
# Element counts for the single-tensor kernel (csrc/cuda/summarize.cu: chunks of 4096 elements while
# there are at most 2048 of them, larger beyond, up to 2**20): 1 chunk (one block, no ticket), 1 full
# chunk, 2 and 4 chunks (a ticket), and 1025 chunks of 8192 -- more than an H200 holds at once (132
# SMs x 4 blocks), so blocks loop over chunks before the last one combines.
BLOCK_SIZES = [1000, 4096, 4097, 3 * 4096 + 5, (1 << 23) + 3]
# Chunks longer than one run of 65536 elements (a thread's squares are summed in runs of 256, packed
# lanes folded per run): 1025 chunks of 2**17 (2 runs) and of 2**18 (4 runs).
RUN = 1 << 16
MULTI_RUN_SIZES = [(1 << 27) + 4097, (1 << 28) + 24]


def planted(n, dtype=torch.float32):
    x = torch.randn(n, device="cuda").to(dtype)
    x[n // 3] = float("nan")
    x[n - 1] = float("-inf")
    return x


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_capture_single_and_many(backend):
    x, ys = planted(1 << 20), [planted(1000), planted(70001, torch.bfloat16), torch.zeros(5, device="cuda")]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture -- every path
        nanscan.record(x, backend=backend), nanscan.records(ys, backend=backend)  # the capture takes:
        for y in ys:  # under capture the multi-tensor call runs per tensor (no host-built table)
            nanscan.record(y, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        single = nanscan.record(x, backend=backend)
        many = nanscan.records(ys, backend=backend)
    x.copy_(planted(1 << 20))  # new values, same buffer: the replay must read them
    graph.replay()
    torch.cuda.synchronize()
    assert_record_matches(single, reference.summarize(x), x, f"{backend} graph single")
    for row, y in zip(many, ys):
        assert_record_matches(row, reference.summarize(y), y, f"{backend} graph many")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_host_sync(backend):
    xs = [planted(n) for n in (10, 5000, 1 << 20)]
    nanscan.record(xs[0], backend=backend), nanscan.records(xs, backend=backend)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        nanscan.record(xs[2], backend=backend)
        nanscan.records(xs, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_deterministic_bitwise(backend):
    x = torch.randn(1 << 24, device="cuda")
    first = nanscan.record(x, backend=backend)
    for _ in range(3):
        assert torch.equal(nanscan.record(x, backend=backend), first)


def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="one device"):
        nanscan.records([torch.ones(2), torch.ones(2, device="cuda")])


@pytest.mark.slow
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_more_than_2_pow_31_elements(backend):
    n = 2**31 + 1000
    x = torch.zeros(n, dtype=torch.float16, device="cuda")
    x[2**31 + 7] = float("nan")
    x[2**31 + 9] = float("inf")
    x[11] = -3.0
    s = nanscan.summarize(x, backend=backend)
    assert (s.nan_count, s.posinf_count, s.zero_count, s.first_nonfinite_index) == (1, 1, n - 3, 2**31 + 7)
    assert (s.finite_min, s.finite_max, s.sumsq, s.sum, s.sum4) == (-3.0, 0.0, 9.0, -3.0, 81.0)
    del x
    torch.cuda.empty_cache()


def test_watched_training_step_async_has_no_host_sync():
    from benchmarks.models import GPT
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = GPT(layers=2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 1024, (2, 128), device="cuda")
    with nanscan.watch(model, opt, mode="async") as mon:
        try:
            for i in range(5):  # the plain loop: the monitor delimits steps itself
                if i == 2:  # warm-up steps (allocations, first copies) are done; from here on, every
                    torch.cuda.set_sync_debug_mode("error")  # step and the late decode of the one before
                loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")  # (close() reads the last step: one sync, allowed)
    assert mon.incidents == [] and mon.ledger.applied == 5


@pytest.mark.parametrize("optimizer", [False, True], ids=["no optimizer", "AdamW"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_eager_watch_on_cuda_names_every_incident_as_on_cpu(mode, optimizer):
    # The device paths (records into device buffers, the async read one step late through pinned
    # memory) must not move an incident to another step, phase or module: the same loop's incidents
    # on the CPU (sync) are the oracle. A NaN batch at step 1, a backward-only fault at step 3; with
    # AdamW the NaN spreads through the updates, so every later step has incidents of its own.
    from tests.test_monitor_loops import SqNet, key

    def incidents(device, mode):
        torch.manual_seed(0)
        model = SqNet().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
        with nanscan.watch(model, opt, on_nonfinite="record", mode=mode) as mon:
            for i in range(6):
                model.fault = i == 3
                x = torch.randn(4, 8).to(device)  # (drawn on the CPU: the same batches on both)
                if i == 1:
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                if opt is not None:
                    opt.step()
                model.zero_grad(set_to_none=True)
        return [key(inc) for inc in mon.incidents]

    on_cpu = incidents("cpu", "sync")
    assert on_cpu[0] == (1, "forward", "inp", "activation", False)
    if not optimizer:
        assert (3, "backward", "sq", "grad", True) in on_cpu
    assert incidents("cuda", mode) == on_cpu


@CUDA_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, *FLOAT8, torch.float64, torch.int32],
                         ids=str)
@pytest.mark.parametrize("kind", ["random", "mixed", "nan_last", "zeros_subnormals", "overflow_sumsq"])
def test_single_tensor_one_to_many_blocks(dtype, kind):
    """Clean chunks (assume-finite pass) and chunks with NaN / Inf or an overflowing sum of squares
    (classifying pass), from one block to blocks that loop over chunks; bitwise equal run to run."""
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), kind))
    for n in BLOCK_SIZES:
        base = cast(special_values(kind, n + 1, gen), dtype).to("cuda")
        for x in (base[:n], base[1:]):  # 16-byte aligned, and one element off (scalar head and tail)
            got = nanscan.record(x, backend="cuda")
            what = f"cuda n={n} offset={x.storage_offset()}"
            assert_record_matches(got, reference.summarize(x), x, what)
            assert torch.equal(nanscan.record(x, backend="cuda"), got), what


def big_values(n, dtype, kind, seed):
    """n values drawn on the GPU (special_values' CPU draws would take seconds at 2**27), cast like
    special_values: randn, or randn with zeros, NaN, +inf and -inf planted at strides that hit
    many chunks and runs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    v = torch.randn(n, device="cuda", generator=gen)
    if kind == "mixed":
        v[5::7] = 0.0
        v[70_001::1_000_003] = float("nan")
        v[123_457::2_000_003] = float("inf")
        v[999_983::3_000_017] = float("-inf")
    return cast(v, dtype)


@CUDA_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, *FLOAT8, torch.float64,
                                   torch.int16, torch.int32], ids=str)
@pytest.mark.parametrize("kind", ["random", "mixed"])
def test_chunks_of_several_runs(dtype, kind):
    """Tensors past 2048 x 65536 elements take chunks of several runs: every field against the
    reference (aligned, and one element off: a scalar head and tail per run), bitwise run to run."""
    for n in MULTI_RUN_SIZES:
        base = big_values(n + 1, dtype, kind, stable_seed(str(dtype), kind, n))
        for x in (base[:n], base[1:]):
            got = nanscan.record(x, backend="cuda")
            what = f"cuda n={n} offset={x.storage_offset()}"
            assert_record_matches(got, reference.summarize(x), x, what)
            assert torch.equal(nanscan.record(x, backend="cuda"), got), what
        del base
        torch.cuda.empty_cache()


def runs_witness(n, dtype, nan):
    """Zeros, one square of 2**24 at element 0, and 1.0 at each element that thread 0 of chunk 0's
    block takes in runs 1, 2 and 3 (one per 16-byte vector it reads: vectors 0, 256, 512, ... of
    the run). Summed in runs of 256 squares the ones survive (2**24 + 2k is exact in FP32); summed
    in one sequence, 2**24 + 1 rounds back to 2**24 each time. With `nan`, a NaN in run 3 makes the
    chunk take the classifying pass, which must sum the same runs."""
    x = torch.zeros(n, dtype=dtype, device="cuda")
    x[0] = 4096.0
    per_vector = 16 // x.element_size()
    ones = 0
    for run in (1, 2, 3):
        idx = torch.arange(run * RUN, (run + 1) * RUN, per_vector * 256, device="cuda")
        x[idx] = 1.0
        ones += idx.numel()
    if nan:
        x[3 * RUN + 5] = float("nan")
    return x, 2.0**24 + ones


@CUDA_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nan", [False, True], ids=["clean", "nan"])
def test_runs_of_256_squares_and_packed_zero_counts(dtype, nan):
    """Chunks of 2**18 (4 runs): the sum of squares is formed in runs of 256 squares per thread on
    both passes (exact here, where one sequential sum would drop every 1.0), and the zero count --
    about 2**28 zeros, 512 per packed bf16 / fp16 lane and chunk without the per-run fold, which bf16
    cannot count past 256 -- is exact."""
    n = (1 << 28) + 24
    x, sumsq = runs_witness(n, dtype, nan)
    got = nanscan.record(x, backend="cuda")
    want = reference.summarize(x)
    assert_record_matches(got, want, x, f"cuda runs {dtype}")
    assert got[6].item() == sumsq  # (the reference's own FP32 sum is pairwise: not exact here)
    assert got[3].item() == n - 1 - (sumsq - 2.0**24) - nan
    assert got[7].item() == (3 * RUN + 5 if nan else -1)
    assert got[8].item() == 4096.0 + (sumsq - 2.0**24)  # the sum goes through the same runs (exact here)
    assert got[9].item() == 2.0**48  # (each 1.0 is below half an FP32 ulp of 4096**4, in any order)


@pytest.mark.slow
@CUDA_KERNEL
def test_largest_chunks():
    """Chunks of 2**20 elements (16 runs; 2**30 + 5 bf16 elements: 1025 chunks), clean and with a
    NaN in the last run of a chunk far from the start."""
    n = (1 << 30) + 5
    x, sumsq = runs_witness(n, torch.bfloat16, nan=False)
    for nan in (False, True):
        if nan:
            x[700 * (1 << 20) + 15 * RUN + 3] = float("nan")
        got = nanscan.record(x, backend="cuda")
        assert_record_matches(got, reference.summarize(x), x, f"cuda largest chunks nan={nan}")
        assert got[6].item() == sumsq and got[3].item() == n - 1 - (sumsq - 2.0**24) - nan
    del x
    torch.cuda.empty_cache()


@CUDA_KERNEL
def test_many_group_of_several_run_chunks():
    """summarize_many chunks a dtype group from its total: fp32 tensors of 2**27 + 2**17 + 1004
    elements in all take chunks of 2**17 (2 runs), each tensor cut from its own start; the runs
    witness in the first tensor, a NaN in the second run of a chunk of the second tensor."""
    witness = torch.zeros((1 << 26) + 3, device="cuda")  # 2 runs per chunk: thread 0's ones in run 1
    witness[0] = 4096.0
    witness[RUN:2 * RUN:1024] = 1.0  # 64 of them, one per float32 vector thread 0 reads
    y = big_values((1 << 26) + (1 << 17) + 1, torch.float32, "random", 7)
    y[5 * (1 << 17) + RUN + 11] = float("nan")
    xs = [witness, y, planted(1000), planted(5000, torch.bfloat16), torch.zeros(0, device="cuda")]
    rows = nanscan.records(xs, backend="cuda")
    assert_rows_match(rows, xs, "many, several runs")
    assert rows[0, 6].item() == 2.0**24 + 64
    assert rows[1, 7].item() == 5 * (1 << 17) + RUN + 11
    assert torch.equal(nanscan.records(xs, backend="cuda"), rows)


@CUDA_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["random", "mixed", "nan_last"])
def test_layouts_with_many_blocks(dtype, kind):
    """Transposed / channels_last (linear reads, logical indices) and strided walks over ~1000 chunks."""
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), kind, "layouts"))
    base = cast(special_values(kind, 24 * 350_000, gen), dtype).to("cuda")
    for name, view in layouts(base):
        got = nanscan.record(view, backend="cuda")
        assert_record_matches(got, reference.summarize(view), view, f"cuda {name}")
        assert torch.equal(nanscan.record(view, backend="cuda"), got), name


@CUDA_KERNEL
def test_ticket_resets_back_to_back_and_in_graph_replays():
    """Each launch's last block puts its ticket back to 0: calls queued back to back without a sync
    all finish their rows (a ticket left non-zero would leave rows unwritten), and so do several
    replays of a captured graph, bitwise equal to eager calls on the same contents."""
    xs = [planted(n) for n in (4097, 1 << 20, (1 << 23) + 3)]
    eager = [nanscan.record(x, backend="cuda") for x in xs]
    queued = [nanscan.record(x, backend="cuda") for _ in range(5) for x in xs]
    torch.cuda.synchronize()
    for x, row in zip(xs, eager):
        assert_record_matches(row, reference.summarize(x), x, f"eager n={x.numel()}")
    for i, row in enumerate(queued):
        assert torch.equal(row, eager[i % len(xs)]), f"queued call {i}"

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture (kernel loading, occupancy query)
        for x in xs:
            nanscan.record(x, backend="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = [nanscan.record(x, backend="cuda") for x in xs]
    for replay in range(4):
        if replay == 2:  # new contents in the same buffers: the replays must read them
            for x in xs:
                x.copy_(planted(x.numel()))
            eager = [nanscan.record(x, backend="cuda") for x in xs]
        graph.replay()
        torch.cuda.synchronize()
        for x, row, want in zip(xs, rows, eager):
            assert torch.equal(row, want), f"replay {replay} n={x.numel()}"
    for x, row in zip(xs, rows):
        assert_record_matches(row, reference.summarize(x), x, f"replayed n={x.numel()}")


@CUDA_KERNEL
def test_two_streams_in_parallel():
    """Calls on two streams at once (and a graph replayed on one of them) never share a ticket or a
    workspace: every row is right and equal to the others of its tensor."""
    a, b = planted(1 << 22), planted((1 << 22) + 5, torch.bfloat16)
    want_a, want_b = reference.summarize(a), reference.summarize(b)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (s1, s2):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up (the stream's ticket is made and zeroed once)
            nanscan.record(a, backend="cuda"), nanscan.record(b, backend="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = nanscan.record(b, backend="cuda")
    rows_a, rows_b = [], []
    for i in range(20):
        with torch.cuda.stream(s1):
            rows_a.append(nanscan.record(a, backend="cuda"))
            if i % 4 == 0:
                graph.replay()
        with torch.cuda.stream(s2):
            rows_b.append(nanscan.record(b, backend="cuda"))
    torch.cuda.synchronize()
    assert_record_matches(rows_a[0], want_a, a, "stream 1")
    assert_record_matches(rows_b[0], want_b, b, "stream 2")
    assert all(torch.equal(row, rows_a[0]) for row in rows_a)
    assert all(torch.equal(row, rows_b[0]) for row in rows_b) and torch.equal(replayed, rows_b[0])


def second_call_on_gpu(call) -> list:
    """Names of what ran on the GPU during the second of two calls (the first warms caches up);
    skips where the profiler sees no GPU activity (CUPTI unavailable)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    on_gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not on_gpu:
        pytest.skip("the profiler recorded no GPU activity here (CUPTI unavailable)")
    return on_gpu


@CUDA_KERNEL
def test_single_tensor_is_one_launch():
    """No combine launch: the last block of the one kernel writes the record (the stream's ticket
    exists after the first call, so no memset either)."""
    x = planted(1 << 22)
    on_gpu = second_call_on_gpu(lambda: nanscan.record(x, backend="cuda"))
    assert len(on_gpu) == 1 and "summarize_kernel" in on_gpu[0], on_gpu


def many_tensors():
    """Two dtype groups (interleaved rows), an empty tensor, one and many chunks per tensor."""
    return [planted(1000), planted(4097), planted(70001, torch.bfloat16), torch.zeros(0, device="cuda"),
            planted(1 << 20), planted(5000, torch.bfloat16)]


def assert_rows_match(rows, xs, what):
    assert rows.shape == (len(xs), nanscan.RECORD_SIZE), what
    for i, (row, x) in enumerate(zip(rows, xs)):
        assert_record_matches(row, reference.summarize(x), x, f"{what} xs[{i}]")


@CUDA_KERNEL
def test_many_table_cache_hit_and_new_values():
    """summarize_many caches each dtype group's device table (csrc/cuda/summarize.cu, many_table):
    the same list again (a hit, no copy) gives the same rows bitwise, and new values written in
    place into the same buffers are read (the table holds addresses, never values)."""
    xs = many_tensors()
    first = nanscan.records(xs, backend="cuda")
    again = nanscan.records(xs, backend="cuda")
    torch.cuda.synchronize()
    assert_rows_match(first, xs, "first")
    assert torch.equal(again, first)
    for x in xs:
        if x.numel():
            x.copy_(torch.randn(x.numel(), device="cuda").to(x.dtype))
    xs[1][7] = float("inf")  # another first non-finite index: the row must change
    xs[4][123] = float("nan")
    changed = nanscan.records(xs, backend="cuda")
    torch.cuda.synchronize()
    assert_rows_match(changed, xs, "changed in place")
    assert not torch.equal(changed, first)


@CUDA_KERNEL
def test_many_table_cache_is_not_misread():
    """A list with one tensor replaced by another of the same shape and dtype (another data pointer,
    here also a storage offset), the same tensors in another order, and a shorter list are each
    summarized from their own table -- a cached table is used only when every key word matches."""
    xs = many_tensors()
    want = nanscan.records(xs, backend="cuda")
    base = planted(70002, torch.bfloat16)
    ys = list(xs)
    ys[2] = base[1:]  # same shape and dtype as xs[2], other address; xs[2] stays alive
    swapped = nanscan.records(ys, backend="cuda")
    order = [4, 0, 5, 3, 2, 1]
    permuted = nanscan.records([xs[i] for i in order], backend="cuda")
    shorter = nanscan.records(xs[:2], backend="cuda")
    again = nanscan.records(xs, backend="cuda")
    torch.cuda.synchronize()
    assert_rows_match(swapped, ys, "one tensor replaced")
    assert_rows_match(permuted, [xs[i] for i in order], "permuted")
    assert_rows_match(shorter, xs[:2], "shorter")
    assert torch.equal(again, want)
    for k in (0, 1, 3, 4, 5):
        assert torch.equal(swapped[k], want[k]), k


@CUDA_KERNEL
def test_many_lists_alternating_and_evicted():
    """Lists of different lengths called alternately, queued without a sync, and more distinct lists
    than the cache keeps (so tables are evicted and rebuilt while earlier kernels may still read
    theirs): every row is right and bitwise equal to the first call on the same list."""
    xs = many_tensors()
    lists = [xs[:k] for k in range(1, len(xs) + 1)] + [xs[k:] + xs[:k] for k in range(1, len(xs))]
    lists += [list(reversed(lst)) for lst in lists[1:]]  # 21 distinct lists, > 16 cached tables
    first = [nanscan.records(lst, backend="cuda") for lst in lists]
    torch.cuda.synchronize()
    for lst, rows in zip(lists, first):
        assert_rows_match(rows, lst, f"{len(lst)} tensors")
    queued = [(i, nanscan.records(lists[i], backend="cuda")) for _ in range(3) for i in range(len(lists))]
    queued += [(i, nanscan.records(lists[i], backend="cuda")) for _ in range(3) for i in (0, len(xs) - 1)]
    torch.cuda.synchronize()
    for i, rows in queued:
        assert torch.equal(rows, first[i]), f"list {i}"


@CUDA_KERNEL
def test_many_borrowed_and_converted_inputs():
    """summarize_many borrows the tensors it reads as they are and owns only the ones it converts
    (a complex tensor's real view, a lazily conjugated or negated view, a copy of a walk of > 25
    dims): every row right, in one list with borrowed contiguous and strided tensors, twice (the
    second call hits the cached table of the contiguous groups), the inputs left as they were."""
    gen = torch.Generator().manual_seed(stable_seed("borrowed"))
    z = torch.randn(3000, dtype=torch.complex64, generator=gen).cuda()
    z[17] = complex(float("nan"), 1.0)
    w = planted(4097)
    deep = torch.randn([2] * 26, device="cuda").permute(*range(25, -1, -1))  # 26 dims that never merge
    xs = [w, z, z.conj(), torch._neg_view(w), planted(70001, torch.bfloat16), w[::3], deep, z.conj().imag]
    assert z.conj().is_conj() and torch._neg_view(w).is_neg() and not deep.is_contiguous()
    before = [x.clone() for x in xs]
    for call in range(2):
        rows = nanscan.records(xs, backend="cuda")
        torch.cuda.synchronize()
        assert_rows_match(rows, xs, f"call {call}")
    for x, b in zip(xs, before):
        assert torch.equal(x.resolve_conj().resolve_neg().nan_to_num(), b.resolve_conj().resolve_neg().nan_to_num())


@CUDA_KERNEL
def test_many_cache_hit_copies_nothing():
    """The second call on the same list (a cached table) issues no host-to-device copy: only the scan
    and combine kernels of each dtype group run on the GPU."""
    xs = many_tensors()
    on_gpu = second_call_on_gpu(lambda: nanscan.records(xs, backend="cuda"))
    assert not any("memcpy" in name.lower() for name in on_gpu), on_gpu
    assert sum("scan_many_kernel" in name for name in on_gpu) == 2, on_gpu


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_watched_model_names_faults_like_eager_on_cuda(mode):
    # inductor on CUDA, and with CUDA graphs (mode="reduce-overhead"): the traced stamps
    # (nanscan::stamp: effectful, its buffer named by owner, not an argument) must still write the
    # monitor's buffer on every replay -- forward, and backward where this torch traces tensor hooks
    # into graphs -- and must not cost the model its CUDA graphs (inductor would fall back without
    # them, and say so only in a log). One run per side (two graphs compiled): a NaN batch at
    # step 1, a backward-only fault at step 3; no optimizer, so no update spreads the NaN.
    from torch._dynamo.utils import counters

    from nanscan.monitor.traced import GRAD_HOOKS
    from tests.test_monitor_loops import SqNet, key

    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = SqNet().cuda()
        skips = counters["inductor"]["cudagraph_skips"]
        with nanscan.watch(model, on_nonfinite="record") as mon:
            fwd = torch.compile(model, mode=mode) if compiled else model
            for i in range(5):
                model.fault = i == 3
                x = torch.randn(4, 8, device="cuda")
                if i == 1:
                    x[0, 0] = float("nan")
                fwd(x).pow(2).mean().backward()
                model.zero_grad(set_to_none=True)
        assert counters["inductor"]["cudagraph_skips"] == skips, "inductor skipped CUDA graphs (see its log)"
        first = {}
        for inc in mon.incidents:
            first.setdefault(inc.step, key(inc))
        return first

    eager, compiled = run(False), run(True)
    assert set(eager) == {1, 3} and compiled[1] == eager[1]
    if GRAD_HOOKS:
        assert compiled[3] == eager[3] == (3, "backward", "sq", "grad", True)
    else:  # (a parameter gradient, "cannot tell")
        step, phase, _, kind, produced = compiled[3]
        assert (step, phase, kind, produced) == (3, "backward", "grad", None)


@CUDA_KERNEL
def test_stamp_summarizes_a_value_on_another_device_where_it_lives():
    # Model parallelism: a module output on the CPU while the compiled path's buffer is on the GPU.
    from nanscan import _C

    buffer = torch.zeros(3, nanscan.RECORD_SIZE + 4, dtype=torch.float64, device="cuda")
    counter = torch.zeros(1, dtype=torch.float64, device="cuda")
    on_cpu, on_gpu = torch.tensor([1.0, float("nan"), -2.0]), torch.tensor([float("inf"), 0.0], device="cuda")
    _C.set_stamp_target(4343, buffer, counter)
    try:
        torch.ops.nanscan.stamp([on_cpu, on_gpu], None, 4343, 1, "")
    finally:
        _C.set_stamp_target(4343, None, None)
    r = nanscan.RECORD_SIZE
    assert_record_matches(buffer[1, :r].cpu(), reference.summarize(on_cpu), on_cpu)
    assert_record_matches(buffer[2, :r].cpu(), reference.summarize(on_gpu.cpu()), on_gpu.cpu())
    assert buffer[1:, r].tolist() == [1.0, 2.0] and buffer[0].abs().sum().item() == 0.0


class _SideStreamModel(torch.nn.Module):
    """`a` runs on side stream s1 behind a long sleep (its output is written late); then, inside side
    stream s2, 70 ReLUs -- more than a read batch (64 tensors) -- fill and flush a batch while s1 has
    not written `a`'s output yet; the program joins both streams only before `head`, as it must."""

    def __init__(self):
        super().__init__()
        self.a, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
        self.b = torch.nn.Sequential(*[torch.nn.ReLU() for _ in range(70)])
        self.s1, self.s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def forward(self, x):
        main = torch.cuda.current_stream()
        self.s1.wait_stream(main)
        self.s2.wait_stream(main)
        with torch.cuda.stream(self.s1):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: `a` is computed long after its hook ran
            a = self.a(x)
        with torch.cuda.stream(self.s2):
            b = self.b(x)
        main.wait_stream(self.s1)
        main.wait_stream(self.s2)
        a.record_stream(main)
        b.record_stream(main)
        return self.head(a + b)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_modules_on_unjoined_side_streams_are_read_after_they_are_written(mode):
    # Without one stream per read batch (Note [streams of queued tensors], csrc/monitor/streams.h),
    # `a`'s output is summarized on s2 when the ReLUs fill the batch -- before s1 wrote it: a record
    # of stale memory, and the NaN is then named at `head` (or missed) instead of at `a`.
    torch.manual_seed(0)
    model = _SideStreamModel().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanscan.watch(model, opt, on_nonfinite="record", mode=mode) as mon:
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model.a.weight[0, 0] = float("nan")
            model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first = mon.incidents[0]
    assert (first.step, first.phase, first.name, first.kind, first.produced) == (1, "forward", "a", "activation", True)


@CUDA_KERNEL
def test_stamp_rows_cuda_kernel_writes_what_the_aten_ops_write_in_one_launch():
    """csrc/cuda/stamp_rows.cu: a stamp's rows in one launch (the ATen ops were six), the same cells
    bit for bit on every layout (a float32 buffer takes the ops); and captured in a CUDA graph, each
    replay stamps the rows again with the counter moved on."""
    from torch.profiler import ProfilerActivity, profile

    from tests.test_ops import assert_stamp_rows_write_what_the_ops_write, stamp_rows_layouts

    r = nanscan.RECORD_SIZE
    assert_stamp_rows_write_what_the_ops_write("cuda")
    buffer, counter, records, first = stamp_rows_layouts("cuda")[0]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.ops.nanscan.stamp_rows_(buffer, counter, [], records, first, 0, "")
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert [n for n in names if n.startswith("aten::")] == [] and sum("stamp_rows_kernel" in n for n in names) == 1
    buffer, counter = torch.zeros(4, r + 4, dtype=torch.float64, device="cuda"), torch.zeros(1, dtype=torch.float64,
                                                                                             device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            torch.ops.nanscan.stamp_rows_(buffer, counter, [], records, 1, 0, "")
    torch.cuda.synchronize()
    buffer.zero_(), counter.zero_()
    graph.replay(), graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(buffer[1:4, :r], records, rtol=0, atol=0, equal_nan=True)
    assert buffer[1:4, r].tolist() == [4.0, 5.0, 6.0] and buffer[1:4, r + 1].tolist() == [2.0, 2.0, 2.0]
    assert counter.item() == 6.0 and buffer[0].abs().sum().item() == 0.0

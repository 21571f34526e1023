"""Context parallelism (flash_cutlass.distributed): ring attention over a sequence sharded across
ranks, against single-process attention over the full sequence.

CPU: the layouts round-trip; the calls planned for every (rank, step) give exactly the full
sequence's mask, built element by element, without overlap, with equal work per rank for the
load-balanced causal ring; the fp32 merge of partial results; the ring emulated in one process and
run by 2 and 4 spawned processes of a gloo group (outputs, LSE and the three gradients by
FlashAttention-2's rule against the fp32 oracle: causal and not, windows, GQA, soft cap, packed
batches, attention sinks (their gradient summed over the ranks), both layouts, a subgroup); argument errors before any communication.
GPU (skipped without): the emulated ring on one GPU against the oracle, the overlap of its
transfers with the attention kernels in a profile, and the ring over NCCL with 2 or more GPUs.
"""

import json
import math
import os
import tempfile
import time

import pytest
import torch

import flash_cutlass
import flash_cutlass.distributed as cp
import ring_cases
from flash_cutlass.reference import attention_forward
from helpers import fa2_check, load_script, options_left_out, requires_cuda, window_keep

BANDS = [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (True, (11, -1)), (False, (4, 2)), (False, (0, 0)),
         (False, (-1, 5)), (False, (2, 30))]


# ---------------------------------------------------------------------------------------------
# Layouts


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layout_round_trips_and_matches_positions(gen, layout, world_size):
    chunks = world_size * (2 if layout == "load_balanced" else 1)
    x = torch.randn(2, 3 * chunks, 3, 4, generator=gen)
    shards = [cp.shard_sequence(x, rank, world_size, layout=layout) for rank in range(world_size)]
    assert torch.equal(cp.unshard_sequence(shards, layout=layout), x)
    for rank, shard in enumerate(shards):
        positions = cp.sequence_positions(x.shape[1], rank, world_size, layout=layout)
        assert torch.equal(shard, x[:, positions])
    if layout == "load_balanced" and world_size == 2:  # chunks 0 and 3, then 1 and 2
        assert cp.sequence_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
        assert cp.sequence_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    lse = torch.randn(2, 3, 3 * chunks, generator=gen)
    lse_shards = [cp.shard_sequence(lse, rank, world_size, layout=layout, dim=2) for rank in range(world_size)]
    assert torch.equal(cp.unshard_sequence(lse_shards, layout=layout, dim=2), lse)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_varlen_layout_round_trips(gen, layout, world_size):
    chunks = world_size * (2 if layout == "load_balanced" else 1)
    lengths = [2 * chunks, 0, chunks, 3 * chunks]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(lengths), 2, 4, generator=gen)
    shards = [cp.shard_sequence_varlen(x, cu_seqlens, rank, world_size, layout=layout) for rank in range(world_size)]
    assert torch.equal(cp.unshard_sequence_varlen(shards, cu_seqlens, layout=layout), x)
    for rank, shard in enumerate(shards):
        start, pieces = 0, []
        for n in lengths:
            pieces.append(x[start + cp.sequence_positions(n, rank, world_size, layout=layout)])
            start += n
        assert torch.equal(shard, torch.cat(pieces))


def test_layout_errors_name_the_argument():
    x = torch.zeros(1, 6, 2, 4)
    with pytest.raises(ValueError, match=r"x.shape\[1\] is 6, not a multiple of 8"):
        cp.shard_sequence(x, 0, 4)
    with pytest.raises(ValueError, match="layout must be one of 'load_balanced', 'contiguous', got 'zigzag'"):
        cp.shard_sequence(x, 0, 2, layout="zigzag")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\)"):
        cp.shard_sequence(x, 3, 3)
    with pytest.raises(TypeError, match="world_size must be an int"):
        cp.shard_sequence(x, 0, 2.0)
    cu_seqlens = torch.tensor([0, 4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="the length of sequence 1 in cu_seqlens is 2, not a multiple of 4"):
        cp.shard_sequence_varlen(torch.zeros(6, 2, 4), cu_seqlens, 0, 2)
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        cp.shard_sequence_varlen(torch.zeros(6, 2, 4), cu_seqlens.long(), 0, 2)
    with pytest.raises(ValueError, match="shards must all have one length"):
        cp.unshard_sequence([torch.zeros(1, 4), torch.zeros(1, 2)])


# ---------------------------------------------------------------------------------------------
# Plans


def planned_mask(boxes, local_q: int, local_k: int):
    """How many of the calls `boxes` cover each (local query, local key) pair with a visible
    score, each call's mask built element by element from flash_cutlass's documented rule."""
    covered = torch.zeros(local_q, local_k, dtype=torch.int64)
    for box in boxes:
        keep = window_keep(box.q_end - box.q_start, box.k_end - box.k_start, box.causal, box.window_size)
        covered[box.q_start:box.q_end, box.k_start:box.k_end] += keep.long()
    return covered


def full_sequence_mask(positions_q, positions_k, causal, window):
    """The full sequence's mask on these positions: i sees j iff i - left <= j <= i + right."""
    left, right = window
    distance = positions_k[None, :] - positions_q[:, None]
    keep = torch.ones(distance.shape, dtype=torch.bool)
    if left >= 0:
        keep &= distance >= -left
    if causal:
        keep &= distance <= 0
    elif right >= 0:
        keep &= distance <= right
    return keep


@pytest.mark.parametrize("causal,window", BANDS)
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_plan_gives_exactly_the_full_sequence_mask(causal, window, layout, world_size):
    for chunk in (1, 2, 5):
        seqlen = world_size * (2 if layout == "load_balanced" else 1) * chunk
        plan = cp._sequence_plan(seqlen, layout, world_size, cp._Band.of(causal, window))
        for rank in range(world_size):
            positions_q = cp.sequence_positions(seqlen, rank, world_size, layout=layout)
            for step in range(world_size):
                positions_k = cp.sequence_positions(seqlen, (rank - step) % world_size, world_size, layout=layout)
                expected = full_sequence_mask(positions_q, positions_k, causal, window)
                boxes = plan[rank][step] if step < len(plan[rank]) else ()
                covered = planned_mask(boxes, len(positions_q), len(positions_k))
                where = f"chunk {chunk}, rank {rank}, step {step}: {boxes}"
                assert covered.max() <= 1, f"calls overlap at {where}"
                assert torch.equal(covered.bool(), expected), f"wrong mask at {where}"


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_load_balanced_causal_ring_does_equal_work_in_one_call_per_step(world_size):
    chunk = 16
    plan = cp._sequence_plan(2 * world_size * chunk, "load_balanced", world_size, cp._Band.of(True, (-1, -1)))
    assert all(len(rank_plan) == world_size for rank_plan in plan)
    for step in range(world_size):
        assert all(len(plan[rank][step]) == 1 for rank in range(world_size))
        work = {int(planned_mask(plan[rank][step], 2 * chunk, 2 * chunk).sum()) for rank in range(world_size)}
        assert work == ({chunk * (2 * chunk + 1)} if step == 0 else {2 * chunk * chunk}), f"step {step}: {work}"
    # The diagonal shard runs causal, every other step without a mask.
    assert all(plan[rank][0][0].causal for rank in range(world_size))
    assert not any(box.causal or box.window_size != (-1, -1)
                   for rank_plan in plan for boxes in rank_plan[1:] for box in boxes)


def test_ring_stops_after_the_last_step_that_sees_a_key():
    band = cp._Band.of(True, (5, -1))
    assert len(cp._sequence_plan(4 * 16, "contiguous", 4, band)[0]) == 2  # the window reaches one shard back
    assert len(cp._sequence_plan(4 * 16, "contiguous", 4, cp._Band.of(True, (-1, -1)))[0]) == 4
    assert len(cp._sequence_plan(4 * 16, "contiguous", 4, cp._Band.of(False, (0, 0)))[0]) == 1


def test_packed_calls_group_sequences_with_one_mask():
    band = cp._Band.of(True, (-1, -1))
    plan = cp._packed_plan((16, 0, 8, 24), "load_balanced", 2, 1, band)
    assert [len(calls) for calls in plan] == [1, 1]
    call = plan[1][0]  # rank 1 holds the shard of rank 0: its queries against the first halves of its keys
    assert (call.q_start, call.q_end, call.k_start, call.k_end) == (0, 24, 0, 18)
    assert call.cu_seqlens_q == (0, 8, 8, 12, 12, 24)
    assert call.cu_seqlens_k == (0, 4, 8, 10, 12, 18)


# ---------------------------------------------------------------------------------------------
# The merge


def test_merge_of_partials_is_attention_over_all_keys(gen):
    q = torch.randn(2, 9, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 20, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 20, 2, 16, generator=gen, dtype=torch.float64)
    expected_out, expected_lse = attention_forward(q, k, v, 0.25, False)
    out_acc = torch.zeros(q.shape, dtype=torch.float32)
    lse_acc = torch.full((2, 4, 9), -math.inf)
    for start, end in ((0, 7), (7, 8), (8, 20)):
        out, lse = attention_forward(q, k[:, start:end], v[:, start:end], 0.25, False)
        cp._merge_into(out_acc, lse_acc, out, lse.float())
    torch.testing.assert_close(out_acc, expected_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_acc, expected_lse.float(), atol=1e-5, rtol=1e-5)


def test_merge_of_rows_without_keys_gives_no_nan(gen):
    q = torch.randn(1, 6, 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 3, 2, 8, generator=gen, dtype=torch.float64)
    # Causal with 6 queries and 3 keys: the first 3 rows see no key (out 0, lse -inf).
    out, lse = attention_forward(q, k, k, 0.5, True)
    assert torch.isneginf(lse[..., :3]).all()
    out_acc = torch.zeros(q.shape, dtype=torch.float32)
    lse_acc = torch.full((1, 2, 6), -math.inf)
    cp._merge_into(out_acc, lse_acc, out, lse.float())  # -inf with -inf on the first rows
    assert not out_acc.isnan().any() and torch.isneginf(lse_acc[..., :3]).all()
    assert torch.equal(out_acc[:, :3], torch.zeros(1, 3, 2, 8))
    torch.testing.assert_close(out_acc[:, 3:], out[:, 3:].float())
    other_out, other_lse = attention_forward(q, k, k, 0.5, False)
    cp._merge_into(out_acc, lse_acc, other_out, other_lse.float())  # finite with -inf and with finite
    # Attention over both key sets: the causal one's mask beside the unmasked one's.
    keys = torch.cat([k, k], 1)
    keep = torch.cat([torch.ones(6, 3, dtype=torch.bool).tril(-3), torch.ones(6, 3, dtype=torch.bool)], 1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys).mul(0.5).masked_fill(~keep, -math.inf)
    expected_lse = torch.logsumexp(scores, -1)
    expected_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), keys)
    torch.testing.assert_close(lse_acc, expected_lse.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_acc, expected_out.float(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The ring, emulated in this process


@pytest.mark.parametrize("case", ring_cases.CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_emulated_ring_matches_full_sequence(case, world_size):
    inputs = ring_cases.full_inputs(case, world_size, seed=world_size)
    ring_cases.check(case, inputs, ring_cases.emulated_results(case, inputs, world_size), fa2_check)


def test_emulated_ring_check_can_fail(monkeypatch):
    """The check above fails when one step's partial result is left out of the merge."""
    case = ring_cases.CASES[1]
    inputs = ring_cases.full_inputs(case, 2, seed=2)
    merge = cp._merge_into
    merged = []

    def merge_all_but_the_second(*args):
        merged.append(None)
        if len(merged) != 2:
            merge(*args)

    monkeypatch.setattr(cp, "_merge_into", merge_all_but_the_second)
    with pytest.raises(AssertionError, match="out"):
        ring_cases.check(case, inputs, ring_cases.emulated_results(case, inputs, 2), fa2_check)


def test_emulated_ring_returns_what_flash_attention_returns_on_one_rank(gen):
    q, k, v = (torch.randn(2, 12, heads, 16, generator=gen).to(torch.bfloat16) for heads in (4, 2, 2))
    (out,), (lse,) = cp.emulated_ring_flash_attention([q], [k], [v], causal=True, return_lse=True)
    expected_out, expected_lse = flash_cutlass.flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


def test_ring_deterministic_gradients_repeat_bitwise(gen):
    case = ring_cases.CASES[2]
    inputs = ring_cases.full_inputs(case, 3, seed=5)
    first, second = (ring_cases.emulated_results(case, inputs, 3) for _ in range(2))
    assert all(torch.equal(a, b) for rank_a, rank_b in zip(first, second) for a, b in zip(rank_a, rank_b))


# ---------------------------------------------------------------------------------------------
# Errors, before any communication


def shards(world_size=2, seqlen=4, heads_k=2):
    return [[torch.zeros(1, seqlen, heads, 16, dtype=torch.bfloat16) for _ in range(world_size)]
            for heads in (2, heads_k, heads_k)]


@pytest.mark.parametrize("arguments,error,match", [
    ({"dropout_p": 0.1}, ValueError, "dropout_p must be 0 in ring attention"),
    ({"alibi_slopes": torch.ones(2)}, ValueError, "alibi_slopes is not supported by ring attention"),
    ({"layout": "zigzag"}, ValueError, "layout must be one of"),
    ({"window_size": (-2, 0)}, ValueError, "window_size entries must be >= -1"),
    ({"softmax_scale": -1.0}, ValueError, "softmax_scale must be finite and > 0"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"check_across_ranks": "yes"}, TypeError, "check_across_ranks must be a bool"),
    ({"sinks": torch.ones(3)}, ValueError, r"sinks must have shape \(heads,\) = \(2,\)"),
])
def test_ring_rejects_arguments_before_communicating(arguments, error, match):
    q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16)
    # torch.distributed is not initialized in this process: any communication would raise otherwise.
    with pytest.raises(error, match=match):
        cp.ring_flash_attention(q, q, q, **arguments)
    if "check_across_ranks" not in arguments:
        emulated_arguments = {name: value for name, value in arguments.items()
                              if name not in ("dropout_p", "alibi_slopes")}
        if emulated_arguments:
            with pytest.raises(error, match=match):
                cp.emulated_ring_flash_attention(*shards(), **emulated_arguments)


def test_ring_shapes_are_checked_before_communicating():
    q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q has 3 tokens, not a multiple of 2"):
        cp.ring_flash_attention(q[:, :3], q[:, :3], q[:, :3])
    with pytest.raises(ValueError, match=r"k must have as many tokens \(dimension 1\) as q \(4\), got 2"):
        cp.ring_flash_attention(q, q[:, :2], q[:, :2])
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        cp.ring_flash_attention(q.float(), q, q)
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        cp.ring_flash_attention(q, q, q)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        cp.ring_flash_attention_varlen(q, q, q, torch.tensor([0, 4], dtype=torch.int32))
    q_shards, k_shards, v_shards = shards()
    with pytest.raises(ValueError, match=r"k_shards\[1\] must have the shape"):
        cp.emulated_ring_flash_attention(q_shards, [k_shards[0], k_shards[1][:, :2]], v_shards)
    with pytest.raises(ValueError, match="one tensor per rank"):
        cp.emulated_ring_flash_attention(q_shards, k_shards[:1], v_shards)
    packed = [torch.zeros(6, 2, 16, dtype=torch.bfloat16)] * 2
    with pytest.raises(ValueError, match="the length of sequence 0 in cu_seqlens is 6, not a multiple of 4"):
        cp.emulated_ring_flash_attention(packed, packed, packed, cu_seqlens=torch.tensor([0, 6, 12],
                                                                                      dtype=torch.int32))
    with pytest.raises(ValueError, match=r"q has 6 tokens, but cu_seqlens \(the full batch's\) gives 16 / "
                                         r"world_size = 8 tokens per rank"):
        cp.emulated_ring_flash_attention(packed, packed, packed, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# The ring over processes of a torch.distributed group


def spawn_ring(world_size: int, backend: str, cases, seed: int, timeout_s: float = 300.0):
    """Runs ring_cases.worker in world_size spawned processes; returns each rank's results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        context = mp.start_processes(ring_cases.worker, args=(world_size, backend, init_file, cases, seed, folder),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {world_size} ranks did not finish within {timeout_s:.0f} s (a hang in the ring?)")
        return [torch.load(os.path.join(folder, f"rank{rank}.pt")) for rank in range(world_size)]


_GLOO_RUNS = {}


def gloo_results(world_size: int):
    """The results of one spawned gloo run of every case over world_size processes (run once)."""
    if world_size not in _GLOO_RUNS:
        _GLOO_RUNS[world_size] = spawn_ring(world_size, "gloo", ring_cases.CASES, seed=100 * world_size)
    return _GLOO_RUNS[world_size]


@pytest.mark.parametrize("case_index", range(len(ring_cases.CASES)), ids=[c.name for c in ring_cases.CASES])
@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ring_matches_full_sequence(world_size, case_index):
    case = ring_cases.CASES[case_index]
    results = gloo_results(world_size)
    inputs = ring_cases.full_inputs(case, world_size, 100 * world_size + case_index)
    ring_cases.check(case, inputs, [rank["cases"][case_index] for rank in results], fa2_check)


def test_gloo_ring_in_a_subgroup_matches_full_sequence():
    case = ring_cases.SUBGROUP_CASE
    results = gloo_results(4)
    inputs = ring_cases.full_inputs(case, 2, 400 + ring_cases.SUBGROUP_SEED)
    for members in ((1, 3), (0, 2)):
        assert [results[rank]["subgroup_rank"] for rank in members] == [0, 1]
        ring_cases.check(case, inputs, [results[rank]["subgroup"] for rank in members], fa2_check)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ring_raises_on_every_rank(world_size):
    expected = {
        "odd_load_balanced_shard": f"ValueError: q has {2 * world_size + 1} tokens, not a multiple of 2",
        "dropout": "ValueError: dropout_p must be 0",
        "alibi": "ValueError: alibi_slopes is not supported",
        "layout": "ValueError: layout must be one of",
        "kv_length": "ValueError: k must have as many tokens",
        "sinks": "ValueError: sinks must have shape (heads,) = (2,)",
        "varlen_cu_seqlens": "ValueError: the length of sequence 0 in cu_seqlens is 3, not a multiple of",
        "varlen_total": f"ValueError: q has 6 tokens, but cu_seqlens (the full batch's) gives {8 * world_size}",
    }
    for rank, results in enumerate(gloo_results(world_size)):
        for name, start in expected.items():
            message = results["errors"][name]
            assert message is not None and message.startswith(start), f"rank {rank}, {name}: {message}"
        assert "the ranks of group passed different shapes or options" in (results["mismatch"] or ""), rank


# ---------------------------------------------------------------------------------------------
# GPU


def gpu_case(case):
    """A case at sizes for the GPU: chunks of 128 tokens (96 in packed batches), head dim 128."""
    import dataclasses

    return dataclasses.replace(case, chunk=96 if case.varlen else 128, head_dim=128)


@requires_cuda
@pytest.mark.parametrize("case", ring_cases.CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("world_size", [2, 4])
def test_emulated_ring_on_one_gpu_matches_full_sequence(case, world_size):
    reason = options_left_out(window_size=case.window_size, softcap=case.softcap)
    if reason:
        pytest.skip(reason)
    case = gpu_case(case)
    inputs = ring_cases.full_inputs(case, world_size, seed=world_size)
    ring_cases.check(case, inputs, ring_cases.emulated_results(case, inputs, world_size, "cuda"), fa2_check)


def overlapping_copies(trace_path: str) -> int:
    """How many copies of a chrome trace (torch.profiler) run on another stream at the same time
    as a kernel."""
    with open(trace_path) as file:
        events = json.load(file)["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream")) for e in events if e.get("cat") == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream")) for e in events if e.get("cat") == "gpu_memcpy"]
    return sum(any(start < k_end and k_start < end and stream != k_stream for k_start, k_end, k_stream in kernels)
               for start, end, stream in copies)


@requires_cuda
def test_emulated_ring_overlaps_transfers_with_attention(tmp_path):
    """In a profile of the emulated ring (4 ranks, 32k tokens), key/value copies on the side stream
    run while attention kernels run on the compute stream. The shards are large enough that the
    GPU's attention outlasts the host's launches: with small ones the compute stream drains between
    launches and the copies run alone."""
    world_size, chunk = 4, 4096
    shards = [[torch.randn(1, 2 * chunk, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(world_size)]
              for heads in (16, 4, 4)]
    for _ in range(2):  # warm-up
        cp.emulated_ring_flash_attention(*shards, causal=True)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        cp.emulated_ring_flash_attention(*shards, causal=True)
        torch.cuda.synchronize()
    trace = str(tmp_path / "ring_trace.json")
    profiler.export_chrome_trace(trace)
    assert overlapping_copies(trace) > 0, f"no copy overlapped a kernel in {trace}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
def test_nccl_ring_matches_full_sequence():
    world_size = 4 if torch.cuda.device_count() >= 4 else 2
    cases = [gpu_case(case) for case in ring_cases.CASES
             if not options_left_out(window_size=case.window_size, softcap=case.softcap)]
    results = spawn_ring(world_size, "nccl", cases, seed=7)
    for index, case in enumerate(cases):
        inputs = ring_cases.full_inputs(case, world_size, 7 + index)
        ring_cases.check(case, inputs, [rank["cases"][index] for rank in results], fa2_check)


# ---------------------------------------------------------------------------------------------
# The benchmark (benchmarks/benchmark_ring.py)


def test_benchmark_counts_the_same_work_per_gpu():
    benchmark = load_script("benchmarks", "benchmark_ring")
    assert benchmark.attention_flops(1, 64, 8192, 128, False, "forward") == 4.0 * 64 * 8192**2 * 128
    assert benchmark.attention_flops(2, 8, 1024, 64, True, "forward+backward") == 3.5 * 4.0 * 2 * 8 * 1024**2 * 64 / 2
    # A rank's share of a ring over 8 GPUs: 1/8 of the FLOPs, as a sequence 1/sqrt(8) as long.
    assert benchmark.same_work_seqlen(131072, 8) == 46336 and benchmark.same_work_seqlen(16384, 1) == 16384
    assert abs(benchmark.same_work_seqlen(131072, 8) ** 2 / 131072**2 - 1 / 8) < 1e-2


def test_benchmark_runs_the_emulated_ring_on_the_cpu(tmp_path, capsys):
    benchmark = load_script("benchmarks", "benchmark_ring")
    assert benchmark.main(["--device", "cpu", "--emulate", "2", "--seqlens", "32", "--heads", "2", "--heads-k", "1",
                           "--head-dim", "16", "--causal", "true", "--direction", "forward+backward", "--warmup",
                           "0", "--reps", "1", "--rounds", "1", "--json", str(tmp_path / "rows.json")]) == 0
    assert "2 ranks emulated on 1 GPU" in capsys.readouterr().out
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(row["seqlen"], row["causal"], row["world_size"], row["single_seqlen"]) for row in rows] == [
        (32, True, 2, 32)]
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args(["--help"])
    assert exit_info.value.code == 0

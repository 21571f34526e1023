"""CPU tests of benchmarks/benchmark_forward.py's pure helpers and its --check logic."""

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flash_cutlass.reference import attention_forward
from helpers import load_script

REPO = Path(__file__).resolve().parents[1]
# flash_cutlass and the SDPA backends side by side on the H200 (docs/PERFORMANCE.md).
SIDE_BY_SIDE = REPO / "docs" / "results" / "side_by_side_h200_bf16.json"


bench = load_script("benchmarks", "benchmark_forward")


def test_forward_flops_counts_two_matmuls_and_halves_for_causal():
    full = bench.attention_forward_flops(2, 16, 8192, 8192, 128, causal=False)
    assert full == 4 * 2 * 16 * 8192 * 8192 * 128
    assert bench.attention_forward_flops(2, 16, 8192, 8192, 128, causal=True) == full / 2
    assert bench.attention_forward_flops(1, 1, 3, 5, 7, causal=False) == 4 * 3 * 5 * 7


def test_tflops_of_a_known_time():
    assert bench.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert bench.tflops(1e12, 1.0) == pytest.approx(1000.0)


def test_peer_columns_give_the_peer_time_and_its_ratio_or_na():
    assert bench.peer_columns(3.0, 1.5) == "3.000 | 2.00"
    assert bench.peer_columns(None, 1.5) == "n/a | n/a"


def test_default_cases_keep_tokens_and_hidden_fixed():
    cases = bench.benchmark_cases(bench.DEFAULT_HEAD_DIMS, bench.DEFAULT_SEQLENS, [False, True])
    assert len(cases) == 3 * 2 * 6
    for case in cases:
        assert case.batch * case.seqlen == 16384
        assert case.heads * case.head_dim == 2048
    assert [(c.head_dim, c.causal, c.seqlen) for c in cases[:7]] == [
        (64, False, 512), (64, False, 1024), (64, False, 2048), (64, False, 4096),
        (64, False, 8192), (64, False, 16384), (64, True, 512)]
    by_key = {(c.head_dim, c.seqlen): c for c in cases}
    assert (by_key[(128, 8192)].batch, by_key[(128, 8192)].heads) == (2, 16)
    assert (by_key[(256, 512)].batch, by_key[(256, 512)].heads) == (32, 8)


def test_fixed_batch_heads_and_kv_heads_override_the_convention():
    args = bench.parse_args(["--batch", "1", "--heads", "64", "--heads-k", "8", "--head-dims", "128",
                             "--seqlens", "4096,16384"])
    cases = bench.benchmark_cases(args.head_dims, args.seqlens, args.causals, batch=args.batch,
                                  heads=args.heads, heads_k=args.heads_k)
    assert {(c.batch, c.heads, c.kv_heads, c.seqlen) for c in cases} == {(1, 64, 8, 4096), (1, 64, 8, 16384)}
    (mha,) = bench.benchmark_cases([128], [4096], [False])
    assert mha.kv_heads == mha.heads == 16
    assert bench.heads_text(64, 8) == "64/8" and bench.heads_text(16, 16) == "16" and bench.heads_text(16, None) == "16"


@pytest.mark.parametrize("argv", [["--heads-k", "8"], ["--heads", "12", "--heads-k", "8"], ["--batch", "0"]])
def test_parse_args_rejects_kv_heads_that_do_not_divide_the_heads(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        bench.parse_args(argv)
    assert excinfo.value.code == 2
    assert "--" in capsys.readouterr().err


def test_cases_never_have_zero_batch_or_heads():
    (case,) = bench.benchmark_cases([4096], [32768], [False])
    assert (case.batch, case.heads) == (1, 1)


def test_flop_convention_reproduces_the_published_tflops():
    records = [r for r in json.loads(SIDE_BY_SIDE.read_text()) if r["grid"] == "proj"]
    assert records
    cases = {(c.head_dim, c.seqlen): c for c in bench.benchmark_cases(
        bench.DEFAULT_HEAD_DIMS, bench.DEFAULT_SEQLENS, [False])}
    for entry in records:
        case = cases[(entry["d"], entry["s"])]
        assert (case.batch, case.heads) == (entry["b"], entry["h"])
        flops = bench.attention_forward_flops(entry["b"], entry["h"], entry["s"], entry["s"],
                                              entry["d"], entry["causal"])
        assert bench.tflops(flops, entry["fwd_ms"]) == pytest.approx(entry["fwd_tflops"], rel=1e-6)
        backward_ms = entry["fwdbwd_ms"] - entry["fwd_ms"]
        assert bench.tflops(bench.DIRECTIONS["backward"] * flops, backward_ms) == pytest.approx(
            entry["bwd_tflops"], rel=1e-6)


def _row(impl, tflops, seqlen=1024, causal=False):
    return {"head_dim": 128, "seqlen": seqlen, "batch": 16384 // seqlen, "heads": 16,
            "causal": causal, "dtype": "bf16", "impl": impl,
            "ms": None if tflops is None else 1.0, "tflops": tflops,
            "error": None if tflops else "unsupported"}


def test_markdown_table_has_one_line_per_shape_and_ratios_subject_over_peer():
    impls = ["flash_cutlass", "sdpa_flash", "sdpa_cudnn"]
    rows = [_row("flash_cutlass", 300.0), _row("sdpa_flash", 150.0), _row("sdpa_cudnn", None),
            _row("flash_cutlass", 100.0, causal=True), _row("sdpa_flash", 400.0, causal=True),
            _row("sdpa_cudnn", 200.0, causal=True)]
    lines = bench.markdown_table(rows, impls).splitlines()
    assert lines[0] == ("| hdim | causal | seqlen | batch | heads | flash_cutlass | sdpa_flash | "
                        "sdpa_cudnn | flash_cutlass/sdpa_flash | flash_cutlass/sdpa_cudnn |")
    assert len(lines) == 4
    assert lines[2] == "| 128 | no | 1024 | 16 | 16 | 300.0 | 150.0 | n/a | 2.00 | n/a |"
    assert lines[3] == "| 128 | yes | 1024 | 16 | 16 | 100.0 | 400.0 | 200.0 | 0.25 | 0.50 |"


def test_markdown_table_without_subject_has_no_ratio_columns():
    lines = bench.markdown_table([_row("sdpa_flash", 10.0)], ["sdpa_flash"]).splitlines()
    assert lines[0] == "| hdim | causal | seqlen | batch | heads | sdpa_flash |"


def test_parse_args_defaults_and_lists():
    args = bench.parse_args([])
    assert args.head_dims == [64, 128, 256]
    assert args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.impls == list(bench.DEFAULT_IMPLS)
    assert "flash_cutlass_deterministic" in bench.IMPLS and "flash_cutlass_deterministic" not in args.impls
    assert args.causals == [False, True]
    args = bench.parse_args(["--head-dims", "128", "--causal", "true",
                             "--impls", "sdpa_cudnn,flash_cutlass"])
    assert (args.head_dims, args.causals, args.impls) == ([128], [True],
                                                          ["flash_cutlass", "sdpa_cudnn"])


def test_interleaved_rounds_alternate_the_implementations():
    calls = []

    def measure(name, time):
        def run(round_index):
            calls.append((name, round_index))
            return time + round_index
        return run

    times = bench.interleaved_rounds({"a": measure("a", 1.0), "b": measure("b", 10.0)}, rounds=3)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert times == {"a": [1.0, 2.0, 3.0], "b": [10.0, 11.0, 12.0]}
    assert bench.interleaved_rounds({}, rounds=2) == {}
    assert bench.parse_args([]).rounds == 1
    assert bench.parse_args(["--rounds", "3"]).rounds == 3
    assert bench.parse_args([]).warmup_ms == 100.0
    assert bench.parse_args(["--warmup-ms", "0"]).warmup_ms == 0.0


@pytest.mark.parametrize("argv", [["--impls", "triton"], ["--seqlens", "1,x"],
                                  ["--head-dims", "0"], ["--check", "--impls", "sdpa_flash"],
                                  ["--rounds", "0"], ["--warmup-ms", "-1"]])
def test_parse_args_rejects_bad_input(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        bench.parse_args(argv)
    assert excinfo.value.code == 2
    assert argv[0] in capsys.readouterr().err


def _reference_subject(causal_override=None, out_factor=1.0):
    """A stand-in for flash_cutlass on CPU: the project's reference forward, optionally broken."""

    def flash_forward(q, k, v, causal=False):
        mask = causal if causal_override is None else causal_override
        out, lse = attention_forward(q, k, v, q.shape[-1] ** -0.5, mask)
        return (out.float() * out_factor).to(q.dtype), lse

    return SimpleNamespace(flash_forward=flash_forward)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_check_accepts_a_correct_forward(causal, dtype_name):
    torch.manual_seed(0)
    (case,) = bench.benchmark_cases([32], [96], [causal], tokens=192, hidden=64)
    inputs = bench.make_inputs(case, bench.DTYPES[dtype_name], device="cpu")
    result = bench.check_case(_reference_subject(), inputs, case, dtype_name)
    assert result["passed"], result["detail"]
    assert result["max_abs_diff"] < 0.05


@pytest.mark.parametrize("causal", [False, True])
def test_check_accepts_a_correct_gqa_forward(causal):
    torch.manual_seed(0)
    (case,) = bench.benchmark_cases([32], [96], [causal], batch=2, heads=4, heads_k=2)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")
    assert inputs.k.shape == (2, 96, 2, 32) and inputs.k_bhsd.shape == (2, 2, 96, 32)
    result = bench.check_case(_reference_subject(), inputs, case, "bf16")
    assert result["passed"], result["detail"]


@pytest.mark.parametrize("broken", [dict(causal_override=False), dict(out_factor=1.05)])
def test_check_rejects_a_wrong_forward(broken):
    torch.manual_seed(0)
    (case,) = bench.benchmark_cases([32], [96], [True], tokens=192, hidden=64)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")
    result = bench.check_case(_reference_subject(**broken), inputs, case, "bf16")
    assert not result["passed"]


def test_check_rejects_a_wrong_lse_shape():
    (case,) = bench.benchmark_cases([32], [64], [False], tokens=64, hidden=64)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")

    def transposed_lse(q, k, v, causal):
        out, lse = _reference_subject().flash_forward(q, k, v, causal)
        return out, lse.transpose(1, 2)

    result = bench.check_case(SimpleNamespace(flash_forward=transposed_lse), inputs, case, "bf16")
    assert not result["passed"] and "expected" in result["detail"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(impl, tflops, seqlen=s, causal=c)
            for s in (512, 1024, 2048) for c in (False, True)
            for impl, tflops in (("flash_cutlass", 200.0 + s / 100), ("sdpa_cudnn", None))]
    path = tmp_path / "forward.png"
    bench.plot_tflops(rows, ["flash_cutlass", "sdpa_cudnn"], path, "test")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_backward_flops_follow_the_flashattention_convention():
    case = bench.Case(head_dim=128, causal=True, seqlen=4096, batch=4, heads=16)
    forward = bench.case_flops(case)
    assert bench.case_flops(case, "backward") == 2.5 * forward
    assert bench.case_flops(case, "forward+backward") == 3.5 * forward


@pytest.mark.parametrize("direction", ["backward", "forward+backward"])
def test_gradient_runners_of_flash_cutlass_return_three_gradients(direction):
    import flash_cutlass

    case = bench.Case(head_dim=32, causal=True, seqlen=40, batch=2, heads=4)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")
    grads = bench.make_runner(bench.SUBJECT, inputs, True, flash_cutlass, direction)()
    assert [g.shape for g in grads] == [inputs.q.shape] * 3


@pytest.mark.parametrize("impl", [bench.SUBJECT, bench.MATH_IMPL])
def test_training_forward_runners_record_the_graph(impl):
    """training-forward: the autograd call on leaves that require grad, its output attached to the
    graph (flash_cutlass's equal to its bare forward's)."""
    import flash_cutlass

    case = bench.Case(head_dim=32, causal=True, seqlen=40, batch=2, heads=4)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")
    out = bench.make_runner(impl, inputs, True, flash_cutlass, "training-forward")()
    assert out.requires_grad and out.grad_fn is not None
    if impl == bench.SUBJECT:
        bare = bench.make_runner(impl, inputs, True, flash_cutlass, "forward")()[0]
        assert torch.equal(out.detach(), bare)
    assert bench.case_flops(case, "training-forward") == bench.case_flops(case)


@pytest.mark.parametrize("direction", ["forward", "backward", "forward+backward"])
def test_the_sinks_runner_runs_with_sinks_and_their_gradient(direction):
    """flash_cutlass_sinks: the forward with sinks (its out differs from the plain one's), and in
    the gradient directions dsinks after the three gradients."""
    import flash_cutlass

    case = bench.Case(head_dim=32, causal=True, seqlen=40, batch=2, heads=4)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")
    result = bench.make_runner(bench.SUBJECT_SINKS, inputs, True, flash_cutlass, direction)()
    if direction == "forward":
        plain = bench.make_runner(bench.SUBJECT, inputs, True, flash_cutlass, direction)()
        assert not torch.equal(result[0], plain[0])
    else:
        assert [g.shape for g in result] == [inputs.q.shape] * 3 + [(case.heads,)]
    assert bench.SUBJECT_SINKS not in bench.DEFAULT_IMPLS


@pytest.mark.parametrize("direction", ["backward", "forward+backward"])
@pytest.mark.parametrize("impl", [bench.SUBJECT, bench.MATH_IMPL])
def test_gradient_runners_take_fewer_kv_heads(direction, impl):
    import flash_cutlass

    case = bench.Case(head_dim=32, causal=True, seqlen=40, batch=2, heads=4, heads_k=1)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")
    grads = bench.make_runner(impl, inputs, True, flash_cutlass, direction)()
    kv_shape = inputs.k.shape if impl == bench.SUBJECT else inputs.k_bhsd.shape
    assert [g.shape[-3:] for g in grads[1:]] == [kv_shape[-3:]] * 2


def test_report_names_the_direction():
    meta = {"dtype": "bf16", "gpu": "gpu", "torch": "t", "cuda": "c", "cudnn": 1, "date": "d", "command": "x",
            "direction": "backward"}
    report = bench.render_report(meta, [], [bench.SUBJECT], [], [])
    assert report.startswith("## Backward attention, bf16") and "times 2.5 for the backward pass" in report


def test_parse_clock_power_reads_samples_and_skips_unreadable_lines():
    text = "1680, 690.52\n1695, 689.10\n[N/A], [N/A]\n\n1650\n1830, 691."
    assert bench.parse_clock_power(text) == [(1680.0, 690.52), (1695.0, 689.1), (1830.0, 691.0)]
    assert bench.parse_clock_power("") == []


def test_clock_power_sampler_runs_nvidia_smi_for_its_block(tmp_path):
    """The sampler starts nvidia-smi (here a stand-in script that records its arguments, prints
    three samples and keeps running as nvidia-smi --loop-ms does) when its block starts and stops
    it when the block ends, keeping what it printed."""
    argv_file = tmp_path / "argv.txt"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f'#!/bin/bash\necho "$@" > {argv_file}\nprintf "1680, 690.5\\n1695, 689.0\\n[N/A], [N/A]\\n"\n'
                    "exec sleep 30\n")
    fake.chmod(0o755)
    sampler = bench.ClockPowerSampler("GPU-1234", interval_ms=50, command=str(fake))
    with sampler:
        for _ in range(200):
            if argv_file.exists() and argv_file.read_text():
                break
            time.sleep(0.01)
        time.sleep(0.2)
    assert sampler.samples == [(1680.0, 690.5), (1695.0, 689.0)]
    assert argv_file.read_text().split() == ["--id=GPU-1234", "--query-gpu=clocks.sm,power.draw",
                                             "--format=csv,noheader,nounits", "--loop-ms=50"]


def test_median_clock_power_pools_every_sampler():
    first, second, empty = (bench.ClockPowerSampler("GPU-0") for _ in range(3))
    first.samples = [(1600.0, 680.0), (1700.0, 700.0)]
    second.samples = [(1800.0, 690.0)]
    assert bench.median_clock_power([first, second, empty]) == (1700.0, 690.0, 3)
    assert bench.median_clock_power([empty]) == (None, None, 0)
    assert bench.median_clock_power([]) == (None, None, 0)


def test_report_has_the_power_table_only_for_rows_with_clocks():
    meta = {"dtype": "bf16", "gpu": "gpu", "torch": "t", "cuda": "c", "cudnn": 1, "date": "d", "command": "x"}
    plain = _row("flash_cutlass", 600.0)
    assert "SM clock" not in bench.render_report(meta, [plain], ["flash_cutlass"], [], [])
    sampled = {**plain, "sm_clock_mhz": 1680.0, "power_w": 690.0, "power_samples": 25}
    not_run = {**_row("sdpa_cudnn", None), "sm_clock_mhz": None, "power_w": None, "power_samples": 0}
    report = bench.render_report(meta, [sampled, not_run], ["flash_cutlass", "sdpa_cudnn"], [], [])
    lines = [line for line in report.splitlines() if line.startswith("| 128 | no | 1024 | ")]
    assert lines[-1] == "| 128 | no | 1024 | flash_cutlass | 600.0 | 1680 | 690 | 357.1 | 25 |"
    assert not any("sdpa_cudnn" in line for line in lines[1:])


def test_parse_args_power_needs_nvidia_smi(monkeypatch, capsys):
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as excinfo:
        bench.parse_args(["--power"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--power" in err and "nvidia-smi" in err
    monkeypatch.setattr(bench.shutil, "which", lambda name: "/usr/bin/" + name)
    assert bench.parse_args(["--power"]).power and not bench.parse_args([]).power


@pytest.mark.parametrize("direction", ["forward", "forward+backward"])
def test_every_door_of_the_doors_benchmark_computes_the_same_attention(direction):
    doors = load_script("benchmarks", "benchmark_doors")
    calls = doors.door_calls(64, 32, direction, device="cpu", tokens=128, hidden=256)
    results = {name: call() for name, call in calls.items()}

    def as_bshd(name, result):
        """The door's output, or its gradients, in (batch, seqlen, heads, head_dim): the SDPA door
        returns SDPA's layout, and both it and the transformers door take their inputs in it."""
        if direction == "forward":
            return result.transpose(1, 2) if name == "scaled_dot_product_attention" else result
        takes_bhsd = name in ("scaled_dot_product_attention", "transformers attention_forward")
        return [g.transpose(1, 2) if takes_bhsd else g for g in result]

    direct = as_bshd("flash_attention", results["flash_attention"])
    for name in ("flash_attn_func", "scaled_dot_product_attention", "transformers attention_forward"):
        if name in results:
            got = as_bshd(name, results[name])
            for a, b in zip(got if isinstance(got, list) else [got], direct if isinstance(direct, list) else [direct]):
                torch.testing.assert_close(a, b, msg=name)
    packed = as_bshd("flash_attn_qkvpacked_func", results["flash_attn_qkvpacked_func"])
    views = as_bshd("flash_attention (qkv views)", results["flash_attention (qkv views)"])
    for a, b in zip(packed if isinstance(packed, list) else [packed], views if isinstance(views, list) else [views]):
        torch.testing.assert_close(a, b)


def test_the_doors_benchmark_alternates_the_doors_and_takes_each_doors_median():
    doors = load_script("benchmarks", "benchmark_doors")
    order = []
    drift = iter([5.0, 1.0, 9.0, 4.0, 2.0, 8.0, 6.0, 3.0, 7.0])

    def time_ms(call):
        order.append(call())
        return next(drift)

    times = doors.door_times({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, 3, time_ms)
    assert order == ["a", "b", "c"] * 3
    assert times == {"a": 5.0, "b": 2.0, "c": 8.0}


def test_every_door_of_the_doors_benchmark_has_a_baseline_among_the_doors():
    doors = load_script("benchmarks", "benchmark_doors")
    names = set(doors.door_calls(64, 32, "forward", device="cpu", tokens=128, hidden=256))
    for name in names:
        assert doors.BASELINES.get(name, "flash_attention") in names, name


decode = load_script("benchmarks", "benchmark_decode")


def test_decode_benchmark_counts_the_keys_each_query_of_a_chunk_sees():
    assert decode.attention_flops(1, 1, 1, 10, 1) == 4 * 10  # decoding: the whole context
    assert decode.attention_flops(1, 1, 4, 4, 1) == 4 * (1 + 2 + 3 + 4)  # a chunk that is the whole context
    assert decode.attention_flops(2, 3, 2, 5, 8) == 4 * 2 * 3 * 8 * (4 + 5)


@pytest.mark.parametrize("argv", [["--seqlen-q", "0"], ["--seqlen-q", "9", "--context", "8"]])
def test_decode_benchmark_rejects_a_chunk_longer_than_the_context(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        decode.main(argv)
    assert excinfo.value.code == 2
    assert "--seqlen-q" in capsys.readouterr().err


def test_decode_benchmark_rejects_a_negative_split_count(capsys):
    with pytest.raises(SystemExit) as excinfo:
        decode.main(["--num-splits", "-1"])
    assert excinfo.value.code == 2
    assert "--num-splits" in capsys.readouterr().err


def test_decode_benchmark_appends_the_query_tokens_behind_the_lengths_it_passes():
    # The cache holds `context` tokens once the call has appended its seqlen_q new ones.
    plain = decode.new_tokens(2, 100, 3, 2, 16, torch.float32, append=False, device="cpu")
    assert set(plain) == {"cache_seqlens"} and plain["cache_seqlens"].tolist() == [100, 100]
    appended = decode.new_tokens(2, 100, 3, 2, 16, torch.float32, append=True, device="cpu")
    assert appended["cache_seqlens"].tolist() == [97, 97] and appended["cache_seqlens"].dtype == torch.int32
    assert appended["k"].shape == appended["v"].shape == (2, 3, 2, 16)


@pytest.mark.parametrize("impl", ["flash_cutlass_gqa_walk", "flash_cutlass_v_after_q", "flash_cutlass_dq_zeroed"])
def test_opt_in_runners_set_their_variable_for_each_call_only(monkeypatch, impl):
    """The opt-in subjects: their base subject's call with the opt-in's variable set during each call
    (the extension reads it per call), the variable as it was around the calls."""
    import flash_cutlass

    base, variable, value = bench.SUBJECT_ENVIRONMENT[impl]
    monkeypatch.setenv(variable, "2")
    seen = bench.with_environment(lambda: os.environ[variable], variable, value)()
    assert seen == value and os.environ[variable] == "2"
    monkeypatch.delenv(variable)
    case = bench.Case(head_dim=32, causal=True, seqlen=40, batch=2, heads=4, heads_k=2)
    inputs = bench.make_inputs(case, torch.bfloat16, device="cpu")
    torch.manual_seed(0)
    walked = bench.make_runner(impl, inputs, True, flash_cutlass, "backward")()
    assert variable not in os.environ
    torch.manual_seed(0)
    plain = bench.make_runner(base, inputs, True, flash_cutlass, "backward")()
    assert all(torch.equal(a, b) for a, b in zip(walked, plain))
    assert impl in bench.IMPLS and impl not in bench.DEFAULT_IMPLS


@pytest.mark.parametrize("impl,variable,value",
                         [("flash_cutlass_append_kernel", "FLASH_CUTLASS_KVCACHE_TILE_APPEND", "0")])
def test_decode_benchmark_runs_its_switch_subjects_with_the_switch_set(monkeypatch, impl, variable, value):
    # flash_cutlass_append_kernel: the paged call with FLASH_CUTLASS_KVCACHE_TILE_APPEND=0 around
    # each call only, and it appends with --append as the other flash_cutlass subjects do.
    assert impl in decode.IMPLS and decode.SWITCHED_PAGED_IMPLS[impl] == (variable, value)
    assert "flash_cutlass_append_kernel" in decode.APPENDING_IMPLS
    other = "1" if value == "0" else "0"
    monkeypatch.setenv(variable, other)
    seen = decode.with_environment(lambda: os.environ[variable], *decode.SWITCHED_PAGED_IMPLS[impl])()
    assert seen == value and os.environ[variable] == other

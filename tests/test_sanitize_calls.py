"""tools/sanitize_calls.py (the calls compute-sanitizer watches): its whole walk on CPU tensors,
where each call meets the reference, and its arguments."""

import pytest

import flash_cutlass
from helpers import load_script

sanitize_calls = load_script("tools", "sanitize_calls")


def compiled_head_dims():
    try:
        return flash_cutlass.compiled_head_dims()
    except RuntimeError as error:  # no extension: the script reads what the build holds
        pytest.skip(str(error))


def test_cpu_walk_covers_every_case(capsys):
    head_dim = min(compiled_head_dims())
    assert sanitize_calls.main(["--device", "cpu", "--head-dims", str(head_dim)]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("0 mismatches")
    assert f"d{head_dim} 1x1 heads 4/4 causal False forward" in printed
    assert f"d{head_dim} varlen causal True forward" in printed
    assert f"d{head_dim} 130x200 heads 4/2 causal sinks forward" in printed
    if flash_cutlass.compiled_backward():
        assert f"d{head_dim} 130x200 heads 4/2 causal deterministic backward dq" in printed
        assert f"d{head_dim} 200x200 heads 72/72 deterministic True backward dk" in printed
    if flash_cutlass.compiled_kvcache() and head_dim in flash_cutlass.compiled_kvcache_head_dims():
        assert f"kvcache d{head_dim} paged seqlen_q 1 num_splits 3 sinks" in printed
        assert f"kvcache d{head_dim} paged seqlen_q 128 num_splits 0" in printed


def test_rejects_head_dims_outside_the_build(capsys):
    compiled = compiled_head_dims()
    missing = next(d for d in (8, 16, 24, 40, 48) if d not in compiled)
    with pytest.raises(SystemExit):
        sanitize_calls.main(["--device", "cpu", "--head-dims", str(missing)])
    assert "are not in this build" in capsys.readouterr().err


def test_cpu_walk_with_the_sm80_kernel_named(capsys):
    """--kernel sm80 (for the sm80 tiles under the sanitizer): the dense calls name the kernel on the
    GPU and drop it for the CPU reference they are checked against."""
    head_dim = min(compiled_head_dims())
    assert sanitize_calls.main(["--device", "cpu", "--head-dims", str(head_dim), "--kernel", "sm80",
                                "--skip-kvcache"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("0 mismatches")
    assert f"d{head_dim} 77x77 heads 4/4 causal True forward" in printed

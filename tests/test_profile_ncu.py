"""CPU tests of benchmarks/profile_ncu.py: the profiled call takes the kernel choice asked for."""


import pytest
import torch

from helpers import load_script

profile_ncu = load_script("benchmarks", "profile_ncu")


class RecordingLibrary:
    """Stands in for flash_cutlass: records each call's name and keyword arguments."""

    def __init__(self):
        self.calls = []

    def flash_forward(self, q, k, v, **kwargs):
        self.calls.append(("flash_forward", kwargs))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def flash_backward(self, dout, q, k, v, out, lse, **kwargs):
        self.calls.append(("flash_backward", kwargs))
        return q, k, v


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("kernel", ["sm80", "sm90", "auto"])
def test_profiled_call_passes_the_kernel_choice(direction, kernel):
    args = profile_ncu.parse_args(["--direction", direction, "--kernel", kernel, "--causal"])
    library = RecordingLibrary()
    q = k = v = torch.zeros(1, 8, 2, 64)
    call = profile_ncu.profiled_call(args, library, q, k, v)
    library.calls.clear()
    call()
    name = "flash_forward" if direction == "forward" else "flash_backward"
    assert library.calls == [(name, {"causal": True, "kernel": kernel})]


def test_profiled_backward_runs_its_forward_once_first():
    args = profile_ncu.parse_args(["--direction", "backward", "--kernel", "sm80"])
    library = RecordingLibrary()
    q = k = v = torch.zeros(1, 8, 2, 64)
    profile_ncu.profiled_call(args, library, q, k, v)
    assert library.calls == [("flash_forward", {"causal": False, "kernel": "sm80"})]

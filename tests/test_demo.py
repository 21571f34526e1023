"""The one-command demo, `python -m flash_cutlass`, run as a user runs it."""

import os
import re
import subprocess
import sys

import torch

from helpers import requires_cuda


def run_demo(*args, env=None):
    result = subprocess.run([sys.executable, "-m", "flash_cutlass", *args], capture_output=True, text=True,
                            timeout=600, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_demo_without_a_gpu_runs_the_cpu_reference():
    out = run_demo("--causal", env={"CUDA_VISIBLE_DEVICES": ""})
    assert "No CUDA GPU is visible" in out
    error = float(re.search(r"max \|error\| vs fp64 = (\S+)", out).group(1))
    assert error < 2e-2


@requires_cuda
def test_demo_on_the_gpu_checks_and_times_both():
    out = run_demo("--batch", "1", "--seqlen", "1024", "--heads", "4", "--head-dim", "64", "--causal", "--reps", "5")
    assert torch.cuda.get_device_name() in out
    error = float(re.search(r"max \|out - fp32 reference\| over the last 256 rows: (\S+)", out).group(1))
    assert error < 2e-2
    for name in ("flash_cutlass", "torch SDPA"):
        tflops = float(re.search(rf"{name}\s*: +\S+ ms +(\S+) TFLOPS", out).group(1))
        assert tflops > 0

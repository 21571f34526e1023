"""setup.py rejects bad build options with a message naming the variable, before compiling."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "variable,value,message",
    [
        ("FLASH_CUTLASS_HEAD_DIMS", "abc", "FLASH_CUTLASS_HEAD_DIMS='abc': accepted values are 32, 64, 96, 128, 192, 256"),
        ("FLASH_CUTLASS_HEAD_DIMS", "64,80", "FLASH_CUTLASS_HEAD_DIMS='64,80': accepted values are"),
        ("FLASH_CUTLASS_DTYPES", "fp32", "FLASH_CUTLASS_DTYPES='fp32': accepted values are fp16, bf16"),
        ("FLASH_CUTLASS_CUDA_ARCHS", "75", "FLASH_CUTLASS_CUDA_ARCHS='75': each entry must be a compute capability >= 80"),
        ("CUTLASS_PATH", "/nonexistent/cutlass", "CUTLASS_PATH=/nonexistent/cutlass: no include/cute/tensor.hpp there"),
        ("FLASH_CUTLASS_SM90", "yes", "FLASH_CUTLASS_SM90='yes': accepted values are 0 and 1"),
        ("FLASH_CUTLASS_BACKWARD", "no", "FLASH_CUTLASS_BACKWARD='no': accepted values are 0 and 1"),
        ("FLASH_CUTLASS_TIMELINE", "yes", "FLASH_CUTLASS_TIMELINE='yes': accepted values are 0 and 1"),
    ],
)
def test_setup_rejects_bad_build_option(variable, value, message):
    env = {**os.environ, variable: value}
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert message in result.stderr


def test_setup_accepts_upper_case_dtypes():
    env = {**os.environ, "FLASH_CUTLASS_DTYPES": "BF16", "FLASH_CUTLASS_CUDA_ARCHS": "80"}
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "flash_cutlass"


def test_setup_rejects_the_hopper_path_without_arch_90():
    env = {**os.environ, "FLASH_CUTLASS_SM90": "1", "FLASH_CUTLASS_CUDA_ARCHS": "80;86"}
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert "FLASH_CUTLASS_SM90=1 builds the Hopper path, which needs 90 in FLASH_CUTLASS_CUDA_ARCHS (got 80;86)" in result.stderr

"""setup.py rejects bad build options with a message naming the variable, before compiling."""

import os
import runpy
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
        ("FLASH_CUTLASS_PTX", "on", "FLASH_CUTLASS_PTX='on': accepted values are 0 and 1"),
        ("FLASH_CUTLASS_SM90_SMALL_TILES", "2", "FLASH_CUTLASS_SM90_SMALL_TILES='2': accepted values are 0 and 1"),
        ("FLASH_CUTLASS_SM80_ON_HOPPER", "yes", "FLASH_CUTLASS_SM80_ON_HOPPER='yes': accepted values are 0 and 1"),
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


@pytest.mark.parametrize("local,archs,ptx_variable,expected", [
    ("90", None, None, ((90,), False)),  # built where it runs: the visible GPU's machine code only
    ("90", None, "1", ((90,), True)),
    ("", None, None, ((80, 90), True)),  # no GPU: the default targets and the PTX for newer GPUs
    ("90", "90", None, ((90,), True)),  # targets named: PTX unless FLASH_CUTLASS_PTX=0
    ("", "80;90", "0", ((80, 90), False)),
])
def test_ptx_is_left_out_where_the_targets_are_the_visible_gpus(monkeypatch, local, archs, ptx_variable, expected):
    setup_globals = runpy.run_path(str(ROOT / "setup.py"), run_name="flash_cutlass_setup")
    build_selection = setup_globals["build_selection"]
    monkeypatch.setitem(build_selection.__globals__, "local_gpu_arch", lambda: local)
    for variable, value in (("FLASH_CUTLASS_CUDA_ARCHS", archs), ("FLASH_CUTLASS_PTX", ptx_variable)):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    selection = build_selection(setup_globals["load_catalogue"]())
    assert (selection.archs, selection.ptx) == expected

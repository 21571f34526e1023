"""tools/check_dq_offsets.cu, compiled for the host with nvcc and run (no GPU needed): the Hopper
backward's closed-form offsets of its 128-byte-swizzled fp32 staging tiles (dQ, a GQA call's dK and
dV) against CuTe's layouts, and store_fp32_tile's dQ stores: every element where the layout puts it,
and no shared-memory bank conflicts."""
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cutlass_include():
    """The CUTLASS include directory the build would use (setup.py's order), or None."""
    candidates = []
    if os.environ.get("CUTLASS_PATH"):
        candidates.append(Path(os.environ["CUTLASS_PATH"]))
    candidates.append(ROOT / "third_party" / "cutlass")
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "source")
    for root in candidates:
        if (root / "include" / "cute" / "tensor.hpp").exists():
            return root / "include"
    return None


def test_staging_tile_offsets_and_conflict_free_stores(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    include = cutlass_include()
    if include is None:
        pytest.skip("CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0)")
    binary = tmp_path / "check_dq_offsets"
    build = subprocess.run([nvcc, "-std=c++17", f"-I{include}", f"-I{ROOT / 'include'}",
                            str(ROOT / "tools" / "check_dq_offsets.cu"), "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "store_fp32_tile misplaced / excess wavefronts" in result.stdout

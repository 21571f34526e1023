"""tools/check_dq_offsets.cu, compiled for the host with nvcc and run (no GPU needed): the Hopper
backward's closed-form offsets of its 128-byte-swizzled fp32 staging tiles (dQ, a GQA call's dK and
dV) against CuTe's layouts, and store_fp32_tile's dQ stores: every element where the layout puts it,
and no shared-memory bank conflicts."""
import subprocess

from helpers import host_tool


def test_staging_tile_offsets_and_conflict_free_stores(tmp_path):
    result = subprocess.run([str(host_tool("check_dq_offsets", tmp_path))], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "store_fp32_tile misplaced / excess wavefronts" in result.stdout

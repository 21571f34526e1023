"""tools/check_turn_places.cu, compiled for the host with nvcc and run (no GPU needed): the
deterministic Hopper backward's turn places in closed form (in-order walks without a mask and
causal, rotated walks) against a count of the walks, each query block's places 0 .. count - 1."""
import subprocess

from helpers import host_tool


def test_closed_form_places_match_the_walks(tmp_path):
    result = subprocess.run([str(host_tool("check_turn_places", tmp_path))], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "in-order walks (no mask, causal): 0 mismatches over 1944 shapes" in result.stdout
    assert "rotated walks: 0 mismatches over 2784 shapes" in result.stdout

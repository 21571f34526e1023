"""tools/copy_sectors.cu (the L2-sector probe of global -> shared copy patterns), compiled for sm_90
with nvcc (no GPU needed): each pattern's kernel carries the copy instructions it is named for."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
sass_report = load_script("tools", "sass_report")


def test_patterns_compile_to_their_copy_instructions(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    binary = tmp_path / "copy_sectors"
    build = subprocess.run([nvcc, "-O3", "-arch=sm_90", str(ROOT / "tools" / "copy_sectors.cu"), "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    try:
        tool = sass_report.cuobjdump()
    except SystemExit:
        pytest.skip("cuobjdump not found")
    sass = subprocess.run([tool, "--dump-sass", str(binary)], capture_output=True, text=True, check=True).stdout
    # The kernel bodies by template argument (CopyPattern), from each "Function : " header.
    bodies = {}
    for header, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S):
        match = re.search(r"copy_chunksILi(\d+)E", header)
        if match:
            bodies[int(match.group(1))] = body
    assert sorted(bodies) == list(range(11))
    bypass = {0, 1, 2, 5, 6, 7, 8, 9, 10}  # cp.async.cg: LDGSTS.E.BYPASS.128
    for pattern, body in bodies.items():
        assert ("LDGSTS.E.BYPASS.128" in body) == (pattern in bypass), pattern
        assert ("LDSM" in body) == (pattern in (9, 10)), pattern
    assert re.search(r"LDGSTS\.E\.128", bodies[3])                     # cp.async.ca
    assert "LDGSTS" not in bodies[4] and "STS.128" in bodies[4]        # through registers

"""tests/conftest.py's report hook: a test refused for forcing the sm80 path where this build's
Hopper code leaves it out is skipped with the refusal's message; every other error still fails."""

import os
import subprocess
import sys

from helpers import ROOT, SM80_ON_HOPPER_REFUSAL

REFUSAL = ("kernel='sm80' at head dim 64 on cuda:0: this build leaves the sm80 path's backward at the Hopper path's "
           f"head dims out of its sm_90a code, which Hopper GPUs run; {SM80_ON_HOPPER_REFUSAL}")


def test_the_extensions_refusal_carries_the_text_the_hook_looks_for():
    assert SM80_ON_HOPPER_REFUSAL in (ROOT / "csrc" / "flash_api.cpp").read_text()


def test_a_refused_sm80_call_is_skipped_and_other_errors_fail(tmp_path):
    (tmp_path / "test_refusals.py").write_text(
        f"def test_refused():\n    raise RuntimeError({REFUSAL!r})\n\n"
        "def test_other_runtime_error():\n    raise RuntimeError('an illegal memory access was encountered')\n\n"
        f"def test_refusal_text_in_an_assertion():\n    assert False, {REFUSAL!r}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rs", "-q",
                             "--rootdir", str(tmp_path), str(tmp_path / "test_refusals.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "1 skipped" in result.stdout and "2 failed" in result.stdout, result.stdout + result.stderr
    assert "FLASH_CUTLASS_SM80_ON_HOPPER=1" in result.stdout  # the skip's reason, shown by -rs

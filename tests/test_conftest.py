"""tests/conftest.py's report hook: a test whose call the extension refused for a piece this build
left out (the sm80 path in the Hopper code, an option's kernels) is skipped with the refusal's
message; every other error still fails."""

import os
import re
import subprocess
import sys

from helpers import BUILD_LEAVE_OUT_MARK, ROOT

SM80_ON_HOPPER_REFUSAL = f"{BUILD_LEAVE_OUT_MARK}SM80_ON_HOPPER=1"

REFUSAL = ("kernel='sm80' at head dim 64 on cuda:0: this build leaves the sm80 path's backward at the Hopper path's "
           f"head dims out of its sm_90a code, which Hopper GPUs run; {SM80_ON_HOPPER_REFUSAL}")

OPTION_REFUSAL = ("alibi_slopes needs ALiBi in the extended kernels, which this build left out "
                  f"(FLASH_CUTLASS_ALIBI=0); {BUILD_LEAVE_OUT_MARK}ALIBI=1")


def test_the_extensions_refusals_carry_the_text_the_hook_looks_for():
    source = (ROOT / "csrc" / "flash_api.cpp").read_text()
    assert SM80_ON_HOPPER_REFUSAL in source
    # Every leave-out refusal of the extension ends with the mark (the string may be split across lines).
    for flag in ("WINDOW", "SOFTCAP", "ALIBI", "DROPOUT", "BACKWARD", "SM90_SMALL_TILES", "KVCACHE"):
        assert re.search(rf'rebuild with (FLASH_CUTLASS_)?"?\s*"?(FLASH_CUTLASS_)?{flag}=1', source), flag


def test_a_refused_sm80_call_is_skipped_and_other_errors_fail(tmp_path):
    (tmp_path / "test_refusals.py").write_text(
        f"def test_refused():\n    raise RuntimeError({REFUSAL!r})\n\n"
        f"def test_option_left_out():\n    raise RuntimeError({OPTION_REFUSAL!r})\n\n"
        "def test_other_runtime_error():\n    raise RuntimeError('an illegal memory access was encountered')\n\n"
        f"def test_refusal_text_in_an_assertion():\n    assert False, {REFUSAL!r}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rs", "-q",
                             "--rootdir", str(tmp_path), str(tmp_path / "test_refusals.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "2 skipped" in result.stdout and "2 failed" in result.stdout, result.stdout + result.stderr
    # the skips' reasons, shown by -rs
    assert "FLASH_CUTLASS_SM80_ON_HOPPER=1" in result.stdout and "FLASH_CUTLASS_ALIBI=1" in result.stdout

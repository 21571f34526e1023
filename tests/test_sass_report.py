"""tools/sass_report.py: arguments it refuses before compiling anything (no nvcc needed)."""

import pytest

from helpers import load_script

sass_report = load_script("tools", "sass_report")


@pytest.mark.parametrize("argv, message", [
    (["--path", "sm90", "--arch", "80"], "need --arch 90a"),
    (["--direction", "kvcache", "--path", "sm90"], "there is no kvcache kernel of the sm90 path"),
    (["--direction", "kvcache", "--path", "sm80", "--mask", "causal"], "take the mask and score options at run time"),
    (["--path", "sm90", "--head-dim", "48"], "--head-dim must be one of"),
])
def test_bad_arguments_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        sass_report.main(argv)
    assert message in capsys.readouterr().err

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


def _function(mangled, body_lines):
    return f"\n\t\tFunction : {mangled}\n" + "\n".join(
        f"        /*{8 * i:04x}*/                   {line} ;" for i, line in enumerate(body_lines))


def test_local_memory_is_split_between_the_consumers_and_the_producer():
    """Spills counted in the code between the consumers' setmaxnreg and the producer's, as laid out,
    either way round; kernels without setmaxnreg are left out."""
    consumers_first = _function(
        "_ZN13flash_cutlass4sm9014flash_bwd_sm90I6TraitsLNS_8MaskKindE1ELNS_9ExtensionE0ELb0EEEvT_",
        ["USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", "STL [R1], R2", "LDL R2, [R1]", "LDL.LU R3, [R1+0x4]", "EXIT",
         "USETMAXREG.DEALLOC.CTAPOOL 0x18", "STL [R1+0x8], R4", "EXIT"])
    producer_first = _function(
        "_ZN13flash_cutlass4sm9014flash_fwd_sm90I6TraitsLNS_8MaskKindE0ELNS_9ExtensionE0ELb1EEEvT_",
        ["USETMAXREG.DEALLOC.CTAPOOL 0x18", "STL.64 [R1], R4", "LDL.64 R4, [R1]", "EXIT",
         "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", "EXIT"])
    plain = _function("_ZN13flash_cutlass20flash_bwd_preprocessILi128EEEvv", ["STL [R1], R2", "EXIT"])
    found = sass_report.local_memory_by_role("code for sm_90a" + consumers_first + producer_first + plain)
    assert found == [
        ("flash_bwd_sm90 (mask kind 1; extension 0; bool template arguments 0)", (1, 2), (1, 0)),
        ("flash_fwd_sm90 (mask kind 0; extension 0; bool template arguments 1)", (0, 0), (1, 1)),
    ]

"""tools/gradient_error_seeds.py (the backward's error over many seeds) on the CPU's reference path."""

from helpers import load_script

gradient_error_seeds = load_script("tools", "gradient_error_seeds")


def test_reports_each_shape_and_kernel_over_the_seeds(capsys):
    assert gradient_error_seeds.main(["--device", "cpu", "--head-dims", "32", "--seeds", "2", "--kernels", "sm90"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(gradient_error_seeds.FEW_KEY_SHAPES)
    for line in lines:
        # The CPU path is the fp32 reference itself: no seed comes near the rule's 2x.
        assert "head dim 32 sm90: 0/2 seeds past 2x" in line, line

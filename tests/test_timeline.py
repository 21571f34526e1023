"""tools/timeline.py: the phase table of a Hopper forward timeline (on the CPU, from a made-up
timeline), its arguments, and (on a GPU, with a build that has FLASH_CUTLASS_TIMELINE=1) the
timeline a call records."""

import pytest
import torch

import flash_cutlass
from flash_cutlass.backend import forward_timeline
from helpers import load_script

timeline = load_script("tools", "timeline")


def made_up_timeline():
    """Two CTAs, two consumer warpgroups; CTA 0 runs tiles of 4 and 2 key blocks, CTA 1 one of 3.
    Only the tile of 4 blocks has a fourth block from the end to probe as a step (events 8-15)."""
    t = torch.zeros(2, 3, 3, 16, dtype=torch.int64)
    # events: tile start, Q, first S, first block done, last P V, finalized, O staged, store issued
    t[0, 0, 1, :8] = torch.tensor([100, 110, 130, 160, 460, 470, 490, 495])  # 3 blocks after the first: 100 each
    t[0, 0, 2, :8] = torch.tensor([100, 112, 140, 170, 470, 480, 490, 494])
    t[0, 1, 1, :8] = torch.tensor([515, 525, 545, 575, 675, 685, 705, 710])  # 1 block after the first
    t[0, 1, 2, :8] = torch.tensor([514, 526, 555, 585, 685, 695, 705, 709])
    t[1, 0, 1, :8] = torch.tensor([50, 60, 80, 110, 310, 320, 340, 345])
    t[1, 0, 2, :8] = torch.tensor([50, 62, 90, 120, 320, 330, 340, 344])
    # the probed step: K/V, turn, GEMMs issued, S landed, softmax done, P V landed, step done
    t[0, 0, 1, 8:] = torch.tensor([360, 362, 365, 375, 380, 420, 424, 430])
    t[0, 0, 2, 8:] = torch.tensor([370, 371, 380, 388, 395, 430, 431, 440])
    t[0, 0, 0, timeline.KEY_BLOCKS] = 4
    t[0, 1, 0, timeline.KEY_BLOCKS] = 2
    t[1, 0, 0, timeline.KEY_BLOCKS] = 3
    return t


def test_phase_table_medians_per_warpgroup():
    table = timeline.phase_table(made_up_timeline())
    first = table["warpgroups"][1]
    assert first["wait for Q"] == 10
    assert first["first S = Q K^T"] == 20
    assert first["other key blocks"] == 200  # median of 300, 100, 200
    assert first["per key block after the first"] == 100
    assert first["O's store issued"] == 5
    assert first["to the next tile's start"] == 20  # 515 - 495, CTA 0's only pair of tiles
    second = table["warpgroups"][2]
    assert second["wait for Q"] == 12 and second["O into shared memory"] == 10
    assert table["cta_span"]["min"] == 295 and table["cta_span"]["max"] == 610  # 345 - 50, 710 - 100


def test_phase_table_times_the_probed_step_where_it_was_recorded():
    steps = timeline.phase_table(made_up_timeline())["steps"]
    assert sorted(steps) == [1, 2]
    assert steps[1]["waits for K and V"] == 2 and steps[1]["wait for the turn"] == 3
    assert steps[1]["S and the P·V before issued"] == 10 and steps[1]["wait for S"] == 5
    assert steps[1]["softmax"] == 40 and steps[1]["wait for the P·V before"] == 4
    assert steps[1]["O rescaled, P stored"] == 6 and steps[1]["the step"] == 70
    assert steps[2]["softmax"] == 35 and steps[2]["the step"] == 70


def test_phase_table_of_an_empty_timeline():
    table = timeline.phase_table(torch.zeros(2, 3, 3, 16, dtype=torch.int64))
    assert table["warpgroups"] == {} and table["steps"] == {} and "cta_span" not in table


def test_format_table_has_a_row_per_phase():
    text = timeline.format_table(timeline.phase_table(made_up_timeline()))
    assert "| phase | warpgroup 1 | warpgroup 2 |" in text
    assert "| first S = Q K^T | 20 | 28 |" in text
    assert "| softmax | 40 | 35 |" in text
    assert "| the step | 70 | 70 |" in text
    assert "CTA spans (cycles): min 295" in text


@pytest.mark.parametrize("argv", [["--head-dim", "0"], ["--seqlen", "4096", "--tokens", "2048"], ["--warmup", "-1"]])
def test_parse_args_rejects_bad_input(argv, capsys):
    with pytest.raises(SystemExit):
        timeline.parse_args(argv)
    assert "must be" in capsys.readouterr().err


def test_gpu_call_records_ordered_stamps():
    """A persistent call's tiles leave each consumer warpgroup's stamps in order, and reading clears."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if 128 not in flash_cutlass.compiled_sm90_head_dims() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs the Hopper path's head dim 128 on an sm_90 GPU")
    extension = flash_cutlass.backend._extension()
    if not extension.compiled_timeline:
        pytest.skip("needs a build with FLASH_CUTLASS_TIMELINE=1")
    q, k, v = (torch.randn(4, 1024, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    forward_timeline(128)
    flash_cutlass.flash_forward(q, k, v, kernel="sm90")
    torch.cuda.synchronize()
    recorded = forward_timeline(128)
    tiles = 0
    for cta, step, warpgroup in (recorded[:, :, 1:, timeline.TILE_START] != 0).nonzero().tolist():
        stamps = recorded[cta, step, warpgroup + 1]
        # the probed step (events 8-15) runs between the first block's end and the last P V
        in_time_order = torch.cat([stamps[: timeline.LAST_PV], stamps[timeline.STEP_START :],
                                   stamps[timeline.LAST_PV : timeline.STEP_START]])
        assert bool((in_time_order[1:] >= in_time_order[:-1]).all()), (cta, step, warpgroup + 1, stamps.tolist())
        assert bool((stamps != 0).all())  # 8 key blocks: the fourth from the end is a step of every tile
        assert int(recorded[cta, step, 0, timeline.KEY_BLOCKS]) == 8
        tiles += 1
    assert tiles == 2 * 4 * 16 * 8  # two consumer warpgroups on every 128-row tile
    assert not forward_timeline(128).any()


def test_forward_timeline_names_its_build_flag():
    """Without FLASH_CUTLASS_TIMELINE=1 (the default) reading a timeline says which flag it needs."""
    try:
        extension = flash_cutlass.backend._extension()
    except RuntimeError as error:
        pytest.skip(str(error))
    if extension.compiled_timeline:
        pytest.skip("this build has the timeline")
    if not extension.compiled_sm90_head_dims():
        pytest.skip("this build has no Hopper path")
    with pytest.raises(RuntimeError, match="FLASH_CUTLASS_TIMELINE=1"):
        forward_timeline(extension.compiled_sm90_head_dims()[0])


def test_forward_timeline_rejects_a_head_dim_without_a_hopper_kernel():
    try:
        extension = flash_cutlass.backend._extension()
    except RuntimeError as error:
        pytest.skip(str(error))
    if not extension.compiled_sm90_head_dims():
        pytest.skip("this build has no Hopper path")
    for head_dim in (512, 0):
        with pytest.raises(RuntimeError, match=f"head_dim {head_dim} has no Hopper-path forward kernel in this build"):
            forward_timeline(head_dim)


def test_main_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert timeline.main([]) == 1
    assert "timeline.py needs a CUDA GPU" in capsys.readouterr().err

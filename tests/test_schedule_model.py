"""CPU tests of tools/schedule_model.py, the model of how the Hopper forward's grid spreads
its tiles over the SMs."""

import pytest

from helpers import load_script

model = load_script("tools", "schedule_model")


@pytest.mark.parametrize("num_m_blocks,batch_heads,seqlen_k,head_dim", [
    (16, 64, 2048, 256),    # bands of 8 pairs, 8 bands
    (9, 64, 900, 256),      # bands of 18: the last one partial (10)
    (128, 8, 16384, 256),   # one pair a band
    (5, 3, 100, 64),        # one band holding every pair
    (1, 1, 0, 128),         # an empty key sequence
])
def test_longest_first_order_numbers_every_tile_once(num_m_blocks, batch_heads, seqlen_k, head_dim):
    order = model.longest_first_order(num_m_blocks, batch_heads, seqlen_k, head_dim)
    assert sorted(order) == [(m, bh) for m in range(num_m_blocks) for bh in range(batch_heads)]


def test_longest_first_order_runs_each_band_from_its_last_query_block_down():
    num_m_blocks, batch_heads = 16, 64
    order = model.longest_first_order(num_m_blocks, batch_heads, 2048, 256)  # bands of 8
    band = order[:8 * num_m_blocks]
    assert {bh for _, bh in band} == set(range(8))
    assert [m for m, _ in band] == [m for m in range(num_m_blocks - 1, -1, -1) for _ in range(8)]
    assert order[8 * num_m_blocks] == (num_m_blocks - 1, 8)


def test_pairs_leave_the_middle_blocks_cta_half_idle_with_an_odd_block_count():
    # Head dim 64 without a mask at 2k: 11 query blocks of 192, 6 pairs a (batch, head) of which
    # one is the lone middle block; 132 SMs a multiple of 6, so CTAs c with c % 6 == 5 get only
    # middles. 2816 tiles: 21.33 an SM on average, 24 on the busiest with pairs, 22 singly.
    args = dict(head_dim=64, causal=False, seqlen=2048, batch=8, heads=32, sms=132, tile_overhead=0.0)
    assert model.busy_share("pairs", **args) == pytest.approx(2816 / 132 / 24)
    assert model.busy_share("singly", **args) == pytest.approx(2816 / 132 / 22)


@pytest.mark.parametrize("num_m_blocks,batch_heads,grid", [
    (16, 256, 132),  # head dim 64 causal 2k: the tail from a (batch, head)'s first pair
    (9, 60, 132),    # the tail from the middle of a (batch, head), an odd block count
    (1, 300, 132),   # one block a (batch, head)
    (8, 36, 132),    # fewer than two waves: every pair in the tail
    (16, 33, 132),   # pairs that fill their waves: no tail
])
def test_causal_tail_and_pairs_number_every_tile_once(num_m_blocks, batch_heads, grid):
    paired, tail = model.causal_tail(num_m_blocks, batch_heads, grid)
    pairs_per_head = (num_m_blocks + 1) // 2
    tiles = []
    for pair in range(paired):
        batch_head, low = divmod(pair, pairs_per_head)
        tiles += sorted({(low, batch_head), (num_m_blocks - 1 - low, batch_head)})
    assert sorted(tiles + tail) == sorted((m, bh) for m in range(num_m_blocks) for bh in range(batch_heads))
    assert [m for m, _ in tail] == sorted((m for m, _ in tail), reverse=True)
    if tail:
        assert paired % grid == 0 and grid <= pairs_per_head * batch_heads - paired < 2 * grid


def test_causal_tail_evens_out_the_partial_wave():
    # Head dim 64 causal 2k: 2048 pairs of 17 key blocks on 132 SMs end with 68 CTAs one pair
    # ahead (272 blocks against a mean of 263.8); the tail brings the busiest within 1%.
    args = dict(head_dim=64, causal=True, seqlen=2048, batch=8, heads=32, sms=132, tile_overhead=0.0)
    assert model.busy_share("pairs", **args) == pytest.approx(2048 * 17 / 132 / 272)
    assert model.busy_share("pairs, tail", **args) > 0.99


def test_pairs_balance_causal_tiles_that_singly_would_not():
    args = dict(head_dim=128, causal=True, seqlen=4096, batch=4, heads=16, sms=132, tile_overhead=2.0)
    assert model.busy_share("pairs", **args) > model.busy_share("singly", **args) + 0.05


def test_longest_first_beats_the_in_order_start_of_causal_tiles():
    args = dict(head_dim=256, causal=True, seqlen=4096, batch=4, heads=8, sms=132, tile_overhead=2.0)
    assert model.busy_share("longest first", **args) > model.busy_share("in order", **args) + 0.05
    assert model.busy_share("longest first", **args) <= 1.0


def test_tile_shapes_and_shipped_schedules_follow_the_launcher():
    assert model.tile_shape(64, True, 2048) == (128, 128, True)
    assert model.tile_shape(64, True, 2049) == (192, 128, True)
    assert model.tile_shape(64, False, 1024) == (192, 128, True)
    assert model.tile_shape(256, True, 1024) == (128, 64, False)
    assert model.shipped_schedule(True, True) == "pairs, tail"
    assert model.shipped_schedule(True, False) == "singly"
    assert model.shipped_schedule(False, True) == "longest first"
    assert model.shipped_schedule(False, False) == "in order"


def test_causal_key_blocks_stop_at_the_diagonal():
    assert model.key_blocks(0, 128, 128, 2048, 2048, causal=True) == 1
    assert model.key_blocks(15, 128, 128, 2048, 2048, causal=True) == 16
    assert model.key_blocks(0, 128, 64, 2048, 2048, causal=True) == 2
    assert model.key_blocks(0, 128, 128, 2048, 2048, causal=False) == 16
    assert model.key_blocks(0, 128, 128, 1024, 512, causal=True) == 0  # rows that see no key


def test_main_prints_one_row_per_shape(capsys):
    assert model.main(["--head-dims", "64,256", "--seqlens", "1024,2048"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 ") or line.startswith("| 256 ")]
    assert len(rows) == 2 * 2 * 2
    assert all(line.count("*") == 1 for line in rows)


@pytest.mark.parametrize("argv,message", [
    (["--head-dims", "96"], "--head-dims: 64, 128 or 256, got 96"),
    (["--seqlens", "0"], "--seqlens: expected positive integers, got '0'"),
    (["--seqlens", "x"], "--seqlens: expected comma-separated integers, got 'x'"),
    (["--sms", "0"], "--sms must be positive, got 0"),
    (["--tile-overhead", "-1"], "--tile-overhead must be >= 0, got -1.0"),
])
def test_parse_args_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit):
        model.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_snake_needs_an_order_whose_cost_falls_along_the_numbering():
    # Head dim 128 causal at 4k: bands of 8 (batch, head) pairs hold 256 tiles, 1.94 rows of 132,
    # so a reversed row meets the next band's longest tiles (measured 24-28% slower than the pairs).
    args = dict(head_dim=128, causal=True, seqlen=4096, batch=4, heads=16, sms=132, tile_overhead=2.0)
    assert model.busy_share("banded snake", **args) < 0.7 < 0.95 < model.busy_share("pairs", **args)
    # Over the whole grid the order's cost falls monotonically and the snake balances.
    assert model.busy_share("snake", **args) > 0.99

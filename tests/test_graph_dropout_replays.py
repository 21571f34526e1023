"""tools/graph_dropout_replays.py (fresh captures of dropout forwards against the eager call at each
replay's recorded state): its refusals, and on a GPU its report."""
import re

import pytest
import torch

import flash_cutlass
from helpers import has_kernels, load_script, requires_cuda

graph_dropout_replays = load_script("tools", "graph_dropout_replays")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        graph_dropout_replays.main(["--captures", "1"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


@requires_cuda
@pytest.mark.skipif(not has_kernels(flash_cutlass.compiled_dropout),
                    reason="this build has no dropout kernels (FLASH_CUTLASS_DROPOUT=0)")
def test_reports_differing_replays_by_replay_index(capsys):
    status = graph_dropout_replays.main(["--captures", "2", "--replays", "2", "--sync-after-capture"])
    summary = capsys.readouterr().out.splitlines()[-1]
    counts = re.search(r"differing replays by replay index \[(\d+), (\d+)\]$", summary)
    assert counts, summary
    assert status == (1 if any(int(c) for c in counts.groups()) else 0)

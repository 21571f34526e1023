"""Test setup: make ``helpers`` importable, give each test its own seeded generators, and keep
parallel (pytest-xdist) workers from oversubscribing the CPU."""

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Each worker would otherwise start one intra-op thread per core.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs per test, reproducible per run."""
    return torch.Generator().manual_seed(_seed(request))


@pytest.fixture
def cuda_gen(request) -> torch.Generator:
    """Like ``gen``, on the current CUDA device, so large inputs are drawn where they are used."""
    return torch.Generator(device="cuda").manual_seed(_seed(request))

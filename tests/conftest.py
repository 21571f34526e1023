"""Test setup: make ``helpers`` importable and give each test its own seeded generator."""

import sys
import zlib
from pathlib import Path

import pytest
import torch

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs per test, reproducible per run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))

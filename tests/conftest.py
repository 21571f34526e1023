"""Test setup: make ``helpers`` importable, give each test its own seeded generators, keep
parallel (pytest-xdist) workers from oversubscribing the CPU, and report a test whose call meets a
piece this build left out (an option's kernels, the sm80 path in the Hopper code) as skipped."""

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test whose call the extension refused because this build left out what the call needs (its
    message ends "rebuild with FLASH_CUTLASS_...": an option's kernels built with FLASH_CUTLASS_<OPTION>=0,
    kernel="sm80" forced on a Hopper GPU at a head dim the sm_90a code leaves out, ...) is skipped with
    the refusal as its reason, not failed: the test cannot run in this build. Any other error stays a
    failure."""
    outcome = yield
    report = outcome.get_result()
    from helpers import BUILD_LEAVE_OUT_MARK

    error = call.excinfo
    if (report.when == "call" and error is not None and error.errisinstance(RuntimeError)
            and BUILD_LEAVE_OUT_MARK in str(error.value)):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {error.value}")

"""Shared pytest setup: the runtime is chosen before numba loads, and in the
simulator every test runs with simulated threads interleaving finely, so races
(a missing cuda.syncthreads, a `+=` that needed cuda.atomic.add) show up."""

import common  # noqa: F401  (first: picks GPU or simulator before numba is imported)
from common.runtime import interleaved_threads, is_simulator

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _interleave_simulated_threads():
    with interleaved_threads():
        yield


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed on failure to reproduce it."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def pytest_collection_modifyitems(config, items):
    if not is_simulator():
        return
    skip = pytest.mark.skip(reason="needs a real GPU (running in the simulator)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_makereport(item, call):
    # Put the random seed into the failure report, so a failing draw can be replayed.
    if call.when == "call" and call.excinfo is not None:
        for key, value in item.user_properties:
            if key == "seed":
                item.add_report_section("call", "seed", f"rng seed: {value}")

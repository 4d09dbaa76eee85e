"""Shared pytest setup: the runtime is chosen before numba loads; in the simulator
every launch runs under the race detector (common/racecheck.py), so a missing
cuda.syncthreads or a `+=` that needed cuda.atomic.add fails every time."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import likely_cause
from common.internal import racecheck
from common.runtime import interleaved_threads, is_simulator

import atexit
import gc
import os
import sys

import numpy as np
import pytest

# The notebook tests import nbformat, which imports jsonschema, whose format
# checkers import rfc3987_syntax where it is installed: it builds a Lark grammar of
# IRIs on import, 2-4 s of each xdist worker's CPU. Nothing here checks an "iri"
# format (nbformat's schemas name none and it passes no format checker), so the
# import is refused and jsonschema leaves that one format out.
sys.modules.setdefault("rfc3987_syntax", None)


@pytest.fixture(autouse=True)
def _interleave_simulated_threads():
    # With the race detector on, races are found from the accesses themselves, in
    # any interleaving; fine thread switching would only slow the simulator down.
    # Without it (COURSE_RACECHECK=0), switching every microsecond makes races
    # likely to show as wrong answers, which is the best the simulator can do.
    if racecheck.ENABLED:
        yield
        return
    with interleaved_threads():
        yield


SEED_VARIABLE = "COURSE_SEED"


def pytest_addoption(parser):
    parser.addoption(
        "--seed",
        type=int,
        default=None,
        help=f"seed of the rng fixture, to replay the random inputs of a failed test "
        f"(its report prints the seed); the {SEED_VARIABLE} environment variable does the same",
    )
    parser.addoption(
        "--seed-sweep",
        metavar="START:STOP",
        default=None,
        help="run every test that draws from the rng fixture once for each seed in "
        "range(START, STOP), and deselect the others: a tolerance that a correct kernel "
        "misses for some draws shows up as a failing seed",
    )


def _seed_sweep(config):
    """The seeds of ``--seed-sweep START:STOP`` as a range, or None."""
    text = config.getoption("--seed-sweep", default=None)
    if not text:
        return None
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise pytest.UsageError(
            f"--seed-sweep takes START:STOP (e.g. 0:200), got {text!r}"
        ) from None
    if not 0 <= start < stop:
        raise pytest.UsageError(f"--seed-sweep needs 0 <= START < STOP, got {text!r}")
    return range(start, stop)


def pytest_generate_tests(metafunc):
    seeds = _seed_sweep(metafunc.config)
    if seeds is not None and "rng" in metafunc.fixturenames:
        metafunc.parametrize("rng", seeds, indirect=True, ids=lambda s: f"seed{s}")


def _chosen_seed(config):
    seed = config.getoption("--seed", default=None)
    if seed is None and os.environ.get(SEED_VARIABLE, "").strip():
        try:
            seed = int(os.environ[SEED_VARIABLE])
        except ValueError:
            raise pytest.UsageError(
                f"{SEED_VARIABLE} must be an integer, got {os.environ[SEED_VARIABLE]!r}"
            ) from None
    return seed


@pytest.fixture
def rng(request):
    """A generator per test: fresh draws each run, or the ones of ``--seed N``.

    The seed goes into the failure report with the command that replays it.
    """
    seed = getattr(request, "param", None)  # --seed-sweep
    if seed is None:
        seed = _chosen_seed(request.config)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def pytest_configure(config):
    # Under -n auto, let idle workers take queued tests from busy ones
    # ("worksteal") instead of fixed chunks ("load"): a few tests take 10-40 s
    # in the simulator, and fixed chunks leave one worker finishing alone.
    if getattr(config.option, "numprocesses", None) and config.option.dist == "load":
        config.option.dist = "worksteal"
    if hasattr(config, "workerinput"):  # an xdist worker
        atexit.register(_exit_without_teardown)


def pytest_collection_finish(session):
    # Collection imported torch, Numba, Triton and the course: millions of objects
    # that live to the end. Each of Python's full collections walked all of them
    # (0.4 s), about 40 a minute in the simulator's busiest files: a quarter of a
    # worker's CPU. Frozen, they are never walked again, and fewer, larger young
    # collections still find the cycles that tests leave behind (the peak memory
    # grows by about 80 MB). gc.collect() still collects all but the frozen ones.
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # Frozen objects are left out of the collection at interpreter exit, and
    # nanobind (Triton) then reports its objects as leaked. Last: pytest's own
    # unconfigure (unraisableexception) runs a full collection first, which
    # frozen objects keep short.
    gc.unfreeze()


def _exit_without_teardown():
    """The last exit step of an xdist worker: leave without CPython's teardown.

    By the time atexit runs, the worker has sent every report and its final
    status to the controller, and the exit handlers of the libraries it loaded
    (registered after this one) have run. What is left is freeing the
    interpreter's modules one object at a time: torch, numba, LLVM, Triton,
    Jupyter's client, several seconds a worker, which the controller waits
    out before it prints the summary (6-8 s of a 2-core CI run). The worker's
    exit status carries nothing: the controller reads the outcome from the
    reports. A plain ``pytest`` run (no -n) exits normally.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pytest_collection_modifyitems(config, items):
    if _seed_sweep(config) is not None:
        uses_rng = ["rng" in getattr(item, "fixturenames", ()) for item in items]
        config.hook.pytest_deselected(items=[i for i, u in zip(items, uses_rng) if not u])
        items[:] = [i for i, u in zip(items, uses_rng) if u]
    if not is_simulator():
        return
    skip = pytest.mark.skip(reason="needs a real GPU (running in the simulator)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and isinstance(call.excinfo.value, Exception):
        cause = likely_cause(call.excinfo.value)
        if cause and cause not in getattr(call.excinfo.value, "__notes__", []):
            call.excinfo.value.add_note(cause)  # shown under the error's own line
    # Put the random seed into the failure report, with the command that replays the draw.
    if (
        call.when in ("call", "teardown")
        and call.excinfo is not None
        and not call.excinfo.errisinstance(pytest.skip.Exception)
    ):
        for key, value in item.user_properties:
            if key == "seed":
                item.add_report_section(
                    call.when,
                    "seed",
                    f'rng seed: {value}; replay: python -m pytest "{item.nodeid}" --seed {value}',
                )


def _hide_simulator_frames():
    """A kernel that fails in the simulator shows its own line, not the simulator's.

    pytest leaves out of a traceback every frame whose module defines
    ``__tracebackhide__``; these modules are the simulator's thread machinery
    and array wrappers (``pytest --fulltrace`` still shows everything).
    """
    if not is_simulator():
        return
    import threading

    from numba.cuda.simulator import kernel, kernelapi
    from numba.cuda.simulator.cudadrv import devicearray

    for module in (kernel, kernelapi, devicearray, threading):
        module.__tracebackhide__ = True


_hide_simulator_frames()

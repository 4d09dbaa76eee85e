"""The numba-cuda pin and the simulator internals the course's checks patch.

``common.internal.simulator`` and ``common.internal.racecheck`` replace methods
of private classes of Numba's CUDA simulator. Private code can change in any
release, so pyproject.toml pins numba-cuda to the range these were written
against. These tests fail, naming what moved, when the installed numba-cuda is
outside the pin or lacks something the patches need: widen the pin only after
they pass on the new release.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.internal import racecheck
from common.internal.exercises import REPO_ROOT

import importlib
import importlib.metadata
import tomllib

import pytest
from packaging.requirements import Requirement

# module -> attributes the patches read or replace (numba-cuda 0.30.x)
SIMULATOR_INTERNALS = {
    "numba.cuda.simulator.kernel": [
        "FakeCUDAKernel",
        "BlockManager",
        "BlockThread",
        "_kernel_context",
    ],
    "numba.cuda.simulator.kernelapi": [
        "FakeCUDAShared",
        "FakeCUDALocal",
        "FakeCUDAAtomic",
        "FakeCUDAModule",
        "Dim3",
        "_swap_refcount",
    ],
    "numba.cuda.simulator.cudadrv.devicearray": [
        "FakeCUDAArray",
        "FakeWithinKernelCUDAArray",
        "FakeShape",
    ],
    "numba.core.typing": ["signature"],
}
# class -> methods the patches wrap
SIMULATOR_METHODS = {
    ("numba.cuda.simulator.kernel", "FakeCUDAKernel"): ["__getitem__", "__call__"],
    ("numba.cuda.simulator.kernel", "BlockManager"): ["run"],
    ("numba.cuda.simulator.kernel", "BlockThread"): ["syncthreads"],
    ("numba.cuda.simulator.kernelapi", "FakeCUDAShared"): ["array"],
    ("numba.cuda.simulator.kernelapi", "FakeCUDALocal"): ["array"],
    ("numba.cuda.simulator.kernelapi", "FakeCUDAModule"): ["threadfence"],
    ("numba.cuda.simulator.kernelapi", "FakeCUDAAtomic"): list(racecheck.ATOMIC_METHODS),
    ("numba.core.types.abstract", "Type"): ["__call__", "cast_python_value"],
    ("numba.cuda.simulator.cudadrv.devicearray", "FakeWithinKernelCUDAArray"): ["__getattr__"],
}


def _pin() -> Requirement:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(d) for d in project["dependencies"]]
    return next(r for r in pins if r.name == "numba-cuda")


def test_installed_numba_cuda_is_inside_the_pin():
    pin = _pin()
    installed = importlib.metadata.version("numba-cuda")
    assert pin.specifier, "pyproject.toml must pin numba-cuda to a range (the patches need it)"
    assert pin.specifier.contains(installed, prereleases=True), (
        f"numba-cuda {installed} is outside the course's pin {pin.specifier}: "
        f'pip install "numba-cuda{pin.specifier}"'
    )


def test_the_pin_has_an_upper_bound():
    # An open range would let the next release (with changed internals) in unseen.
    assert any(s.operator in ("<", "<=", "==", "~=") for s in _pin().specifier)


@pytest.mark.parametrize("module", sorted(SIMULATOR_INTERNALS))
def test_simulator_internals_exist(module):
    mod = importlib.import_module(module)
    missing = [name for name in SIMULATOR_INTERNALS[module] if not hasattr(mod, name)]
    assert not missing, f"{module} no longer has {missing}: common.internal needs updating"


@pytest.mark.parametrize("owner", sorted(SIMULATOR_METHODS), ids=lambda o: o[1])
def test_simulator_methods_exist(owner):
    cls = getattr(importlib.import_module(owner[0]), owner[1])
    missing = [m for m in SIMULATOR_METHODS[owner] if not callable(getattr(cls, m, None))]
    assert not missing, f"{owner[1]} no longer has {missing}: common.internal needs updating"

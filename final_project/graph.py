"""Capture a stream's kernel launches into a CUDA graph and replay it.

A Numba launch costs more Python on the host than a small kernel takes on the
GPU; a training step of the fast model is 28 launches, so at small batches the
GPU would mostly wait for Python. A CUDA graph records the launches once and
replays them with one call (CUDA C++ Programming Guide, "CUDA Graphs", stream
capture). The capstone README's "How we beat PyTorch" measures both.

Rules for capture, all kept by :class:`final_project.fast_model.FastCNN`:
every kernel compiled and run once before (so no compilation or module load
happens during capture), every buffer allocated before, no host (NumPy)
arguments, and never the legacy default stream (it cannot be captured).
Kernel arguments are recorded by value: the graph replays with the same
arrays, shapes and scalars (a new batch size or learning rate needs a new
graph), while the *contents* of those arrays (the batch, the weights) are
read afresh at each replay.

The driver calls come from NVIDIA's ``cuda.bindings`` (a dependency of
numba-cuda): ``cuStreamBeginCapture``, ``cuStreamEndCapture``,
``cuGraphInstantiate``, ``cuGraphLaunch``.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.runtime import is_simulator

from collections.abc import Callable
from typing import Any


def _check(result: tuple, what: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising on an error code."""
    from cuda.bindings import driver as drv

    err, *rest = result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def _stream_handle(stream: Any) -> Any:
    """The driver handle of a Numba stream, as cuda.bindings wants it."""
    from cuda.bindings import driver as drv

    handle = stream.handle
    if isinstance(handle, drv.CUstream):
        value = int(handle)
    else:  # a ctypes c_void_p (numba's own ctypes binding)
        value = handle.value
    if not value:
        raise ValueError("the legacy default stream cannot be captured: use cuda.stream()")
    return drv.CUstream(value)


class CudaGraph:
    """One captured, instantiated graph; :meth:`launch` replays it on a stream."""

    def __init__(self, graph: Any, graph_exec: Any) -> None:
        self.graph = graph
        self.graph_exec = graph_exec

    def launch(self, stream: Any) -> None:
        from cuda.bindings import driver as drv

        _check(drv.cuGraphLaunch(self.graph_exec, _stream_handle(stream)), "cuGraphLaunch")

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver as drv

            drv.cuGraphExecDestroy(self.graph_exec)
            drv.cuGraphDestroy(self.graph)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


class CudaGraphBackend:
    """Captures with the driver API on a Numba stream."""

    def capture(self, stream: Any, launches: Callable[[], None]) -> CudaGraph:
        """Record what ``launches()`` queues on ``stream`` (nothing runs), instantiate it.

        Raises:
            RuntimeError: a driver call failed (e.g. a launch went to another
                stream, or something synchronised during capture).
        """
        from cuda.bindings import driver as drv
        from numba import cuda

        handle = _stream_handle(stream)
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(drv.cuStreamBeginCapture(handle, mode), "cuStreamBeginCapture")
        try:
            # Numba frees dropped device arrays in batches, whenever its pending list
            # fills; a cuMemFree inside the capture invalidates it (seen: a second
            # model captured while the first one's buffers were being freed)
            with cuda.defer_cleanup():
                launches()
        finally:
            graph = _check(drv.cuStreamEndCapture(handle), "cuStreamEndCapture")
        graph_exec = _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return CudaGraph(graph, graph_exec)


class EagerBackend:
    """The simulator's stand-in: "capture" keeps the function, "launch" calls it.

    It keeps the capture-once-per-key logic testable where no graphs exist; the
    numbers are those of eager launches.
    """

    class _Recorded:
        def __init__(self, launches: Callable[[], None]) -> None:
            self.launches = launches

        def launch(self, stream: Any) -> None:
            self.launches()

    def capture(self, stream: Any, launches: Callable[[], None]) -> "_Recorded":
        return self._Recorded(launches)


def default_graph_backend() -> CudaGraphBackend | None:
    """The driver backend on a GPU; None in the simulator (steps run eagerly)."""
    return None if is_simulator() else CudaGraphBackend()

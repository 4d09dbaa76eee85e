"""Torch tensors as Numba arrays, and Numba launches on torch's stream.

Two things every operator of this chapter does before it launches a kernel:

1. **A view, not a copy, made once.** ``numba_view(t)`` gives a Numba device
   array over the tensor's own memory (through the CUDA Array Interface, as
   ``cuda.as_cuda_array`` does). A kernel that writes the view writes the
   tensor. In the simulator, where tensors live on the CPU, the view wraps the
   tensor's NumPy view the same way (``t.numpy()`` shares memory too).
   Making a view costs about as much as a launch (measured in
   dispatch_overhead.py), and a new view object costs the launch more again
   (Numba works out its type afresh). But a view of a contiguous tensor is
   nothing more than (address, shape, dtype): two tensors with those three
   equal have the same view, whichever object owns the memory. So views are
   cached under that key, made without a reference to the tensor (the cache
   keeps no memory alive), and a training loop, where torch's caching
   allocator hands the same addresses back each step, makes each view once.
   The caller holds the tensor while the kernel runs, so the address is live.
2. **The right stream.** torch queues its kernels on its *current* stream,
   which is not always the legacy default stream Numba launches on when given
   none (``torch.cuda.stream(s)``, CUDA graphs, torch.compile's
   "reduce-overhead" mode all change it). ``torch_stream()`` returns a Numba
   handle to torch's current stream (``cuda.external_stream``), made once per
   stream and cached, so a launch ``kernel[grid, block, torch_stream()]`` is
   ordered after the torch work that produced its inputs and before the torch
   work that reads its outputs.

Both are hidden from ``torch.compile`` (``torch.compiler.disable``): traced by
Dynamo, ``torch.cuda.current_stream()`` becomes a placeholder ``torch.Stream``
without ``cuda_stream``, and a view's device pointer does not exist for the
fake tensors Dynamo traces with. Code that calls them outside a custom op (an
``autograd.Function``, a plain function) therefore gets a graph break there and
runs them eagerly; a custom op's body is never traced, so it gets none
(compile_and_graphs.py counts both).

Both refuse what would go wrong or slow silently: a tensor that requires grad
(wrap ``t.detach()``: same memory), one on the wrong device, a dtype the kernel
was not built for, and a non-contiguous one (Numba would index it through its
strides, right but uncoalesced, and compile the kernel again for that layout;
pass ``t.contiguous()``).

Two more things every script of the chapter needs, kept here so that each is
written once: ``device()``, where the tensors the kernels see live (the GPU, or
the CPU in the simulator), and ``full_float32()``, which switches TF32 off for
torch's matmuls and convolutions while torch is the reference our float32
kernels are checked or timed against.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from numba import cuda

_STREAMS: dict[int, Any] = {}
_VIEWS: OrderedDict[tuple, Any] = OrderedDict()  # (address, shape, dtype, device) -> view
VIEW_CACHE_SIZE = 256  # views kept, least recently used dropped first


def device() -> torch.device:
    """Where the chapter's tensors live: ``cuda``, or ``cpu`` in the simulator
    (the one device numba_view accepts)."""
    return torch.device("cpu" if is_simulator() else "cuda")


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for cuBLAS matmuls and cuDNN convolutions in the block, restored after.

    Our kernels compute in float32; TF32 keeps 10 bits of mantissa, so torch
    with it on is neither the same arithmetic nor a fair timing baseline.
    cuDNN convolutions use TF32 by default (``torch.backends.cudnn.allow_tf32``),
    cuBLAS matmuls do not (``torch.backends.cuda.matmul.allow_tf32``): both
    are switched off. Without a GPU the flags change nothing.
    """
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@torch.compiler.disable
def _check_viewable(t: torch.Tensor, name: str, dtype: torch.dtype | None) -> None:
    """The checks of :func:`numba_view` and :func:`owning_view`, with their messages."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype} ({name}.to({dtype}))")
    if t.requires_grad:
        raise ValueError(
            f"{name} requires grad: wrap {name}.detach() (same memory, outside autograd)"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()"
        )
    if is_simulator():
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the simulator runs on CPU tensors")
    elif t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}: move it with {name}.cuda()")


def numba_view(
    t: torch.Tensor, name: str = "tensor", dtype: torch.dtype | None = None, cached: bool = True
) -> Any:
    """A Numba device array sharing ``t``'s memory (no copy).

    t: a contiguous tensor, on the GPU (or the CPU in the simulator); dtype:
    the dtype it must have (None: any); cached: reuse the view made earlier for
    the same address, shape, dtype and device (False: a new view, as
    ``cuda.as_cuda_array`` would make). Raises TypeError for a non-tensor or the
    wrong dtype, ValueError for a tensor that requires grad, lives on the wrong
    device or is not contiguous, each message naming the fix.
    """
    _check_viewable(t, name, dtype)
    if not cached:
        return _new_view(t)
    key = (t.data_ptr(), t.shape, t.dtype, t.device)
    view = _VIEWS.get(key)
    if view is None:
        view = _VIEWS[key] = _new_view(t)
        if len(_VIEWS) > VIEW_CACHE_SIZE:
            _VIEWS.popitem(last=False)
    else:
        _VIEWS.move_to_end(key)
    return view


def owning_view(t: torch.Tensor, name: str = "tensor", dtype: torch.dtype | None = None) -> Any:
    """A Numba device array over ``t``'s memory that keeps ``t`` alive (no copy,
    not cached): for a tensor made only to be launched on, such as the contiguous
    copy of a transposed input. :func:`numba_view`'s views do not hold their
    tensor, so a copy nothing else holds would go back to torch's allocator when
    the launching function returns, and the next allocation on the stream (the
    next input's copy) could take its memory before the kernel reads it.
    Errors as :func:`numba_view`.
    """
    _check_viewable(t, name, dtype)
    return _new_view(t, owner=t)


def _new_view(t: torch.Tensor, owner: torch.Tensor | None = None) -> Any:
    if is_simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        # The simulator's device array over the same memory. It holds the tensor
        # (NumPy's base), so in the simulator a cached address cannot be reused.
        return FakeCUDAArray(t.numpy())
    # owner=None (numba_view's views): the view neither keeps the tensor alive nor
    # frees it; owning_view passes the tensor, which the view then holds
    return cuda.from_cuda_array_interface(t.__cuda_array_interface__, owner=owner)


@torch.compiler.disable
def torch_stream() -> Any:
    """Numba's handle to torch's current CUDA stream (0 in the simulator), cached per stream."""
    if is_simulator():
        return 0
    handle = torch.cuda.current_stream().cuda_stream
    stream = _STREAMS.get(handle)
    if stream is None:
        stream = _STREAMS[handle] = cuda.external_stream(handle)
    return stream

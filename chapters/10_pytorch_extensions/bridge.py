"""Torch tensors as Numba arrays, and Numba launches on torch's stream.

Two things every operator of this chapter does before it launches a kernel:

1. **A view, not a copy.** ``numba_view(t)`` gives a Numba device array over
   the tensor's own memory (``cuda.as_cuda_array``, through the CUDA Array
   Interface). A kernel that writes the view writes the tensor. In the
   simulator, where tensors live on the CPU, the view wraps the tensor's NumPy
   view the same way (``t.numpy()`` shares memory too).
2. **The right stream.** torch queues its kernels on its *current* stream,
   which is not always the legacy default stream Numba launches on when given
   none (``torch.cuda.stream(s)``, CUDA graphs, torch.compile's
   "reduce-overhead" mode all change it). ``torch_stream()`` returns a Numba
   handle to torch's current stream (``cuda.external_stream``), made once per
   stream and cached, so a launch ``kernel[grid, block, torch_stream()]`` is
   ordered after the torch work that produced its inputs and before the torch
   work that reads its outputs.

Both refuse what would go wrong or slow silently: a tensor that requires grad
(wrap ``t.detach()``: same memory), one on the wrong device, a dtype the kernel
was not built for, and a non-contiguous one (Numba would index it through its
strides, right but uncoalesced, and compile the kernel again for that layout;
pass ``t.contiguous()``).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common import is_simulator

from typing import Any

import torch
from numba import cuda

_STREAMS: dict[int, Any] = {}


def numba_view(t: torch.Tensor, name: str = "tensor", dtype: torch.dtype | None = None) -> Any:
    """A Numba device array sharing ``t``'s memory (no copy).

    t: a contiguous tensor, on the GPU (or the CPU in the simulator); dtype:
    the dtype it must have (None: any). Raises TypeError for a non-tensor or the
    wrong dtype, ValueError for a tensor that requires grad, lives on the wrong
    device or is not contiguous, each message naming the fix.
    """
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
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(t.numpy())  # the simulator's device array, over the same memory
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}: move it with {name}.cuda()")
    return cuda.as_cuda_array(t)


def torch_stream() -> Any:
    """Numba's handle to torch's current CUDA stream (0 in the simulator), cached per stream."""
    if is_simulator():
        return 0
    handle = torch.cuda.current_stream().cuda_stream
    stream = _STREAMS.get(handle)
    if stream is None:
        stream = _STREAMS[handle] = cuda.external_stream(handle)
    return stream

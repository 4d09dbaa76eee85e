"""PyTorch's ways of running the capstone's training step: the configurations we race.

    eager                     torch_train_step as written: one launch per operation,
                              Python between them (PyTorch's default)
    compile                   torch.compile(model) for the forward (and so the backward)
                              plus a compiled SGD step: TorchInductor fuses operations
                              into fewer kernels (Triton on the GPU, C++ on the CPU)
    compile-reduce-overhead   the same with mode="reduce-overhead": inductor's graphs
                              replay as CUDA graphs, cutting the per-launch CPU cost
    cuda-graph                the whole step (forward, backward, SGD update) captured by
                              hand in one CUDA graph and replayed: one launch a step

Each can run with ``cudnn_benchmark=True`` (``torch.backends.cudnn.benchmark``, what
a user chasing speed sets): cuDNN then times its convolution algorithms on the
first call at each shape and keeps the fastest, instead of picking by heuristics.

Each can also run in mixed precision, ``autocast=torch.bfloat16``: the forward and
the loss under ``torch.autocast(device_type, dtype=torch.bfloat16)``, the backward
and the SGD update outside it, as PyTorch's "Automatic Mixed Precision" recipe and
the ``torch.autocast`` docs prescribe. Autocast runs the convolutions and the
linear layers in BF16 (tensor cores on the GPU, float32 accumulation) and the
cross-entropy in float32; weights, gradients and the update stay float32. BF16
has float32's exponent range, so no GradScaler. Every configuration keeps the
region: "compile" and "compile-reduce-overhead" call the compiled forward inside
it (dynamo guards on the autocast state and traces the BF16 casts into the
graph it compiles), "cuda-graph" warms up and captures the step with the region
in it, so each replay runs the casts and the BF16 kernels.

Every configuration starts from the same weights (``TorchCNN.from_state_dict``),
trains with plain SGD (``torch.optim.SGD(lr=lr)``) and reads its batch from two
static device tensors that the caller refills in place, so the configurations
differ only in how the step is launched. Usage::

    x = torch.empty(64, 1, 28, 28, device="cuda")
    y = torch.empty(64, dtype=torch.int64, device="cuda")
    step = make_torch_step("cuda-graph", config, init_params(config, 0), x, y, 0.05, "cuda")
    # or make_torch_step(..., cudnn_benchmark=True, autocast=torch.bfloat16)
    for xb, yb in batches:                 # pinned host tensors
        x.copy_(xb, non_blocking=True)
        y.copy_(yb, non_blocking=True)
        step.run()
    print(float(step.loss()))              # the one host synchronisation
    ms = time_torch_config(step.run, steps=100, windows=5, warmup=10, device="cuda")

Methods from PyTorch's documentation: ``torch.compile`` and its modes
(https://pytorch.org/docs/stable/generated/torch.compile.html), compiled
optimizers (the "Compiling the optimizer with torch.compile" recipe), CUDA graphs
"whole network capture" (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs),
"Automatic Mixed Precision" (https://pytorch.org/docs/stable/amp.html, the
``torch.autocast`` reference and the "Automatic Mixed Precision" recipe).
"""

from __future__ import annotations

# isort: off
import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

# isort: on
import contextlib
import importlib.util
import math
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from final_project.model import NetConfig
from final_project.torch_twin import TorchCNN, forward_autocast, torch_train_step

TORCH_CONFIGS = ("eager", "compile", "compile-reduce-overhead", "cuda-graph")
_GPU_ONLY = ("compile-reduce-overhead", "cuda-graph")
_COMPILED = ("compile", "compile-reduce-overhead")
CUDA_GRAPH_WARMUP_STEPS = 3  # as PyTorch's "whole network capture" example


class TorchStep(NamedTuple):
    """One configuration's training step, ready to run.

    run: ``run()`` launches one full training step on the batch now in the
        static ``x``, ``y`` (zero grad, forward in train mode, mean
        cross-entropy, backward, SGD update). It neither synchronises nor reads
        anything back to the host.
    loss: ``loss()`` returns the loss of the last step (computed before its
        update) as a new 0-d float32 tensor on the device: a copy, so later
        steps do not change it (the cuda-graph step rewrites one static loss
        tensor on every replay). NaN before the first step. No synchronisation.
    model: the ``TorchCNN`` being trained; its parameters and batchnorm buffers
        are the state after the steps run so far.
    """

    run: Callable[[], None]
    loss: Callable[[], torch.Tensor]
    model: TorchCNN


def _why_unavailable(name: str, device: torch.device) -> str | None:
    """None if configuration ``name`` can run on ``device``, else the reason.

    Raises:
        ValueError: ``name`` is not one of TORCH_CONFIGS.
    """
    if name not in TORCH_CONFIGS:
        raise ValueError(
            f"unknown torch configuration {name!r}; choose one of {', '.join(TORCH_CONFIGS)}"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        return "this torch sees no CUDA GPU"
    if name in _GPU_ONLY and device.type != "cuda":
        return f"it needs a CUDA GPU (it replays CUDA graphs), and the device is {device}"
    if name not in _COMPILED:
        return None
    if device.type == "cpu":
        from torch._inductor import config as inductor_config

        # Inductor compiles its CPU kernels as C++ with the first of these found.
        names = inductor_config.cpp.cxx
        names = (names,) if isinstance(names, str) else names
        if not any(n and shutil.which(n) for n in names):
            return (
                "TorchInductor needs a C++ compiler for the CPU and found none of "
                f"{[n for n in names if n]} on PATH"
            )
        return None
    if device.type == "cuda":
        # Inductor writes Triton kernels for the GPU; Triton needs compute capability 7.0+.
        if importlib.util.find_spec("triton") is None:
            return "TorchInductor needs Triton for the GPU and it is not installed"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 7:
            return (
                f"TorchInductor's Triton kernels need compute capability 7.0+, got {major}.{minor}"
            )
        return None
    return f"this module compiles only for the CPU and CUDA, not {device.type}"


def available_configs(device: torch.device | str) -> tuple[str, ...]:
    """The names in TORCH_CONFIGS that can run on ``device`` here, in that order.

    On the CPU: "eager", and "compile" when a C++ compiler that TorchInductor
    uses (``torch._inductor.config.cpp.cxx``, g++ by default) is on PATH. On a
    CUDA GPU: all four, the compiled ones only when Triton is installed and the
    GPU has compute capability 7.0+. The check compiles nothing (a PATH
    look-up, a package look-up; the first call on the CPU imports
    TorchInductor's config, about 1 s, as torch.compile would), so a compiler
    that is present but broken shows only when the first step compiles.
    """
    device = torch.device(device)
    return tuple(n for n in TORCH_CONFIGS if _why_unavailable(n, device) is None)


def _check_batch(x: torch.Tensor, y: torch.Tensor, config: NetConfig, device: torch.device) -> None:
    want = (config.in_channels, config.height, config.width)
    if x.dim() != 4 or tuple(x.shape[1:]) != want or x.dtype != torch.float32:
        raise ValueError(
            f"x must be a float32 tensor (N, {want[0]}, {want[1]}, {want[2]}), "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    if y.shape != (x.shape[0],) or y.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"y must be an int32 or int64 tensor ({x.shape[0]},), got {y.dtype} {tuple(y.shape)}"
        )
    for t, label in ((x, "x"), (y, "y")):
        if t.device.type != device.type or (
            device.index is not None and t.device.index != device.index
        ):
            raise ValueError(
                f"{label} is on {t.device}, not on {device}: the step reads the "
                f"batch where it lives, so allocate {label} on {device}"
            )


def make_torch_step(
    config_name: str,
    net_config: NetConfig,
    state: dict[str, Any],
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    device: torch.device | str,
    cudnn_benchmark: bool = False,
    autocast: torch.dtype | None = None,
) -> TorchStep:
    """A fresh twin of ``state`` and its training step in configuration ``config_name``.

    Args:
        config_name: one of TORCH_CONFIGS (see the module docstring).
        net_config: the network's sizes.
        state: initial parameters (and optionally batchnorm buffers) as NumPy
            arrays by torch name, as ``final_project.model.init_params`` or
            ``NumbaCNN.state_dict()`` return; copied, never modified.
        x: (N, C, H, W) float32 on ``device``; y: (N,) int32 or int64 labels on
            ``device``. Static buffers: every step reads them where they are,
            so refill them in place (``x.copy_(batch, non_blocking=True)``)
            between steps; never rebind or reallocate them. N is fixed.
        lr: SGD learning rate (plain SGD: no momentum, no weight decay).
        device: where the model lives (``"cuda"``, ``"cpu"``, a torch.device).
        cudnn_benchmark: run the step (and the cuda-graph warm-up and capture)
            with ``torch.backends.cudnn.benchmark`` on; the flag is put back as
            it was after each call. False leaves the flag as the caller set it.
        autocast: None (the default): the step in the model's float32.
            ``torch.bfloat16``: the forward and the loss under
            ``torch.autocast(device.type, dtype=torch.bfloat16)`` in every
            configuration (see the module docstring); the loss is still a
            float32 tensor, the parameters float32.

    Returns:
        TorchStep(run, loss, model). The work each configuration does before
        returning: "compile" and "compile-reduce-overhead" compile lazily, so
        their first one or two ``run()`` calls are slow (compilation, and
        cudagraph recording for reduce-overhead): time after a warm-up.
        "cuda-graph" runs CUDA_GRAPH_WARMUP_STEPS (3) steps on a side stream
        before capturing (cuBLAS/cuDNN handles and workspaces must exist
        before capture), then puts the parameters, buffers and batchnorm
        counters back as they were, so its first ``run()`` is the first step,
        exactly as for the others.

    Precision: the global TF32 switches are left alone (under BF16 autocast
    they matter only for what autocast leaves in float32). For an FP32
    comparison (our kernels are FP32) the caller must set
    ``torch.backends.cuda.matmul.allow_tf32 = False`` and
    ``torch.backends.cudnn.allow_tf32 = False`` before building the step
    (cuDNN convolutions use TF32 by default).

    Compiled configurations: each is compiled with ``dynamic=False``, so every
    batch size gets kernels specialised to it (the fastest torch, as eager's
    cuDNN calls are per shape). Building one first calls
    ``torch.compiler.reset()``, which drops every compiled function of the
    process: dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8)
    versions of a function, counting those of optimizers already freed, and
    past it silently runs the function eagerly; every TorchStep adds a version
    of the SGD step, so without the reset the ninth one built would be timed
    as "compile" while running eagerly. A compiled step built earlier still
    trains correctly, but recompiles on its next call: warm it up again
    before timing it.

    Raises:
        ValueError: an unknown ``config_name`` (the message lists the choices);
            a configuration that cannot run on ``device`` ("cuda-graph" and
            "compile-reduce-overhead" need a CUDA GPU; "compile" needs a C++
            compiler on the CPU, Triton on the GPU); x or y of the wrong shape,
            dtype or device; an ``autocast`` dtype other than None or
            torch.bfloat16 (float16 would need a GradScaler).
        RuntimeError: ``state`` does not fit the network (from
            ``TorchCNN.from_state_dict``); BF16 autocast on a GPU without BF16
            (from ``torch.autocast``).
    """
    device = torch.device(device)
    forward_autocast(device.type, autocast)  # a bad dtype fails here, before any work
    reason = _why_unavailable(config_name, device)
    if reason is not None:
        raise ValueError(
            f"torch configuration {config_name!r} cannot run here: {reason}; "
            f"available on {device}: {', '.join(available_configs(device))}"
        )
    _check_batch(x, y, net_config, device)
    model = TorchCNN.from_state_dict(net_config, state, device)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if config_name == "cuda-graph":
        # the algorithms are chosen in the warm-up and fixed by the capture
        with _cudnn_benchmark(True) if cudnn_benchmark else contextlib.nullcontext():
            return _cuda_graph_step(model, opt, x, y, autocast)
    if config_name == "eager":
        step = _eager_step(model, opt, x, y, autocast)
    else:
        mode = "reduce-overhead" if config_name == "compile-reduce-overhead" else None
        step = _compiled_step(model, opt, x, y, mode, autocast)
    if not cudnn_benchmark:
        return step

    def run() -> None:
        with _cudnn_benchmark(True):
            step.run()

    return step._replace(run=run)


@contextlib.contextmanager
def _cudnn_benchmark(on: bool) -> Iterator[None]:
    """``torch.backends.cudnn.benchmark = on`` inside, as it was after."""
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = was


def _nan_loss(device: torch.device) -> torch.Tensor:
    return torch.full((), math.nan, dtype=torch.float32, device=device)


def _eager_step(
    model: TorchCNN,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast: torch.dtype | None,
) -> TorchStep:
    last = [_nan_loss(x.device)]

    def run() -> None:
        last[0] = torch_train_step(model, opt, x, y, autocast)

    return TorchStep(run, lambda: last[0].clone(), model)


def _compiled_step(
    model: TorchCNN,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    mode: str | None,
    autocast: torch.dtype | None,
) -> TorchStep:
    # The module is compiled (dynamo traces forward, AOTAutograd
    # derives the backward, inductor fuses both) and so is the optimizer step,
    # which eagerly is one foreach launch per group; the loss stays eager.
    # Under autocast the compiled forward is called inside the region: the
    # autocast state is part of dynamo's guards, so the graph it compiles (on the
    # first call, inside the region) holds the BF16 casts and kernels.
    torch.compiler.reset()  # see make_torch_step: else the 9th build runs eagerly
    forward = torch.compile(model, mode=mode, dynamic=False)

    @torch.compile(mode=mode, dynamic=False)
    def sgd_update() -> None:
        opt.step()

    last = [_nan_loss(x.device)]
    reduce_overhead = mode == "reduce-overhead"

    def run() -> None:
        if reduce_overhead:
            # Tells cudagraph trees that the last step's outputs are dead, so
            # this step may replay over their memory (else it re-records).
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with forward_autocast(x.device.type, autocast):
            loss = F.cross_entropy(forward(x), y.long())
        loss.backward()
        sgd_update()
        last[0] = loss.detach()

    return TorchStep(run, lambda: last[0].clone(), model)


def _cuda_graph_step(
    model: TorchCNN,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast: torch.dtype | None,
) -> TorchStep:
    # PyTorch's "whole network capture" recipe. Capture records kernels without
    # running them, so everything that allocates or initialises lazily (cuBLAS
    # and cuDNN handles, workspaces, the caching allocator's blocks) must have
    # run once before: hence the warm-up, on a side stream as the docs ask.
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    side = torch.cuda.Stream(device=x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        for _ in range(CUDA_GRAPH_WARMUP_STEPS):
            torch_train_step(model, opt, x, y, autocast)
    torch.cuda.current_stream(x.device).wait_stream(side)
    # The warm-up trained; undo it in place (same storage, which the graph will
    # read) so the first replay is the first step, as in the other configurations.
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(initial[k])

    graph = torch.cuda.CUDAGraph()
    # Grads are None when capture starts, so the captured backward allocates
    # them in the graph's private pool and each replay overwrites them: no
    # zero_grad inside the graph, and no accumulation across replays.
    opt.zero_grad(set_to_none=True)
    # Autocast's cache of cast weights is off in the capture, as
    # torch.cuda.make_graphed_callables requires of autocast around captured
    # work; each weight is cast once a step anyway, so the step is the same.
    with torch.cuda.graph(graph):
        with forward_autocast(x.device.type, autocast, cache_enabled=False):
            static_loss = F.cross_entropy(model(x), y.long())
        static_loss.backward()
        opt.step()
    static_loss = static_loss.detach()
    static_loss.fill_(math.nan)  # capture ran nothing: no step yet
    return TorchStep(graph.replay, lambda: static_loss.clone(), model)


def time_torch_config(
    step: Callable[[], None], steps: int, windows: int, warmup: int, device: torch.device | str
) -> list[float]:
    """Milliseconds of each of ``windows`` windows of ``steps`` consecutive ``step()`` calls.

    ``warmup`` untimed calls run first (compilation, cudagraph recording,
    cuDNN's choice of algorithm, the caching allocator's growth). On a CUDA
    device each window starts after ``torch.cuda.synchronize`` (so it starts
    with an empty queue) and is bracketed by two CUDA events on the current
    stream, where every configuration launches; the host keeps launching while
    the GPU runs, as in training. Elsewhere the host clock
    (``time.perf_counter``) times each window, which for the CPU is the
    work itself. Divide a window by ``steps`` for ms per step; report the
    median over windows.

    Args:
        step: a zero-argument callable, e.g. ``make_torch_step(...).run``.
        steps: >= 1; windows: >= 1; warmup: >= 0.
        device: the device ``step`` runs on.

    Returns:
        ``windows`` floats, ms per window (not per step).

    Raises:
        ValueError: steps or windows < 1, or warmup < 0.
    """
    if steps < 1 or windows < 1 or warmup < 0:
        raise ValueError(
            f"need steps >= 1, windows >= 1, warmup >= 0; got steps={steps}, "
            f"windows={windows}, warmup={warmup}"
        )
    device = torch.device(device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(windows):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times

"""PyTorch's configurations of the capstone step (final_project.torch_configs):
eager against a float64 SGD step by hand, every other configuration against
eager, in-place refills of the static batch, and the errors."""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import check, rounding_tolerance
from common.runtime import is_simulator

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from final_project import checks
from final_project.model import BUFFER_NAMES, PARAM_NAMES, NetConfig, init_params
from final_project.torch_configs import (
    TORCH_CONFIGS,
    available_configs,
    make_torch_step,
    time_torch_config,
)
from final_project.torch_twin import TorchCNN

SMALL = NetConfig(height=8, width=8, c1=3, c2=4, hidden=8, num_classes=5)
LR = 0.1
CPU = torch.device("cpu")


def _batch(config, n, rng, device=CPU):
    """x (n, C, H, W) float32, y (n,) int32 (the labels our kernels take) on ``device``."""
    x, y = checks.random_batch(config, n, rng)
    return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


def _sgd_by_hand(state, x, y, lr, config):
    """One SGD step in float64, p - lr * grad by hand: (loss, {name: value}) for
    the parameters and the batchnorm running statistics."""
    twin = TorchCNN.from_state_dict(config, state, dtype=torch.float64)
    twin.train()
    loss = F.cross_entropy(twin(x.double()), y.long())
    loss.backward()
    out = {name: (p - lr * p.grad).detach() for name, p in twin.named_parameters()}
    buffers = dict(twin.named_buffers())
    out.update({name: buffers[name] for name in BUFFER_NAMES})
    return loss.detach(), out


def _state(step):
    return {k: v.detach() for k, v in step.model.state_dict().items()}


def test_eager_step_is_one_sgd_step(rng):
    state = init_params(SMALL, int(rng.integers(1000)))
    before = {k: v.copy() for k, v in state.items()}
    x, y = _batch(SMALL, 4, rng)
    step = make_torch_step("eager", SMALL, state, x, y, LR, "cpu")
    assert torch.isnan(step.loss()), "loss() before any step should be NaN"
    step.run()
    ref_loss, ref = _sgd_by_hand(state, x, y, LR, SMALL)
    check(step.loss(), ref_loss, 1e-5, "loss")
    after = _state(step)
    for name in (*PARAM_NAMES, *BUFFER_NAMES):
        check(after[name], ref[name], 1e-5, name)
    assert int(after["bn1.num_batches_tracked"]) == 1
    for name, value in before.items():
        assert np.array_equal(state[name], value), f"make_torch_step trained {name} in place"


def test_eager_loss_falls_on_a_fixed_batch():
    rng = np.random.default_rng(0)  # about learning, not hostile inputs
    x, y = _batch(SMALL, 4, rng)
    step = make_torch_step("eager", SMALL, init_params(SMALL, 1), x, y, LR, "cpu")
    losses = []
    for _ in range(6):
        step.run()
        losses.append(float(step.loss()))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0], f"loss did not fall in 5 steps: {losses}"


def test_loss_is_a_copy_not_the_live_value(rng):
    x, y = _batch(SMALL, 4, rng)
    step = make_torch_step("eager", SMALL, init_params(SMALL, 2), x, y, LR, "cpu")
    step.run()
    first = step.loss()
    step.run()
    second = step.loss()
    assert first.shape == () and first.dtype == torch.float32
    assert float(first) != float(second)


def test_refilled_batch_is_what_the_next_step_trains_on(rng):
    """The step reads x and y where they are: refill them in place and it trains
    on the new batch (not on a copy taken when the step was built)."""
    state = init_params(SMALL, int(rng.integers(1000)))
    x, y = _batch(SMALL, 4, rng)
    x2, y2 = _batch(SMALL, 4, rng)
    step = make_torch_step("eager", SMALL, state, x, y, LR, "cpu")
    x.copy_(x2)
    y.copy_(y2)
    step.run()
    _, ref = _sgd_by_hand(state, x2, y2, LR, SMALL)
    for name in PARAM_NAMES:
        check(_state(step)[name], ref[name], 1e-5, f"{name} after a step on the refilled batch")


@functools.cache
def _inductor_cannot_compile() -> str | None:
    """None if TorchInductor compiles a tiny function on the CPU here, else why not
    (checked once per session)."""
    if "compile" not in available_configs("cpu"):
        return "no C++ compiler for TorchInductor on PATH"
    try:
        torch.compile(lambda t: t * 2 + 1, dynamic=False)(torch.ones(3))
    except Exception as e:  # any failure means: this machine cannot compile
        return f"TorchInductor cannot compile here: {type(e).__name__}: {str(e)[:200]}"
    return None


def _gpu_case(device, rng, name):
    """(device, config, state, 3 batches) for a GPU test of configuration ``name``
    on the capstone's full-size network; skips where ``name`` cannot run."""
    if name not in available_configs(device):
        pytest.skip(f"{name} is not available on this GPU (see available_configs)")
    config = NetConfig()
    state = init_params(config, int(rng.integers(1000)))
    return device, config, state, [_batch(config, 32, rng, device) for _ in range(3)]


def _run_steps(step, x, y, batches):
    losses = []
    for xb, yb in batches:
        x.copy_(xb)
        y.copy_(yb)
        step.run()
        losses.append(step.loss())
    return torch.stack(losses)


def test_compile_matches_eager_on_the_cpu(rng, monkeypatch):
    # The "compile" step as make_torch_step builds it: dynamo traces the module and
    # the SGD update, AOTAutograd derives the backward. Without a GPU (CI: 2 cores)
    # the traced graphs run through aot_eager, because inductor's C++ build of them
    # takes ~45 s there from a cold cache; with a GPU, inductor compiles them here
    # too (and compare.py times them on the GPU).
    if is_simulator():
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    else:
        reason = _inductor_cannot_compile()
        if reason:
            pytest.skip(reason)
    state = init_params(SMALL, int(rng.integers(1000)))
    batches = [_batch(SMALL, 4, rng) for _ in range(2)]
    results = {}
    for name in ("eager", "compile"):
        x, y = _batch(SMALL, 4, rng)
        step = make_torch_step(name, SMALL, state, x, y, LR, "cpu")
        results[name] = (_run_steps(step, x, y, batches), _state(step))
    (loss_e, eager), (loss_c, compiled) = results["eager"], results["compile"]
    check(loss_c, loss_e, 1e-5, "compile: losses of 2 steps")
    for name in (*PARAM_NAMES, *BUFFER_NAMES):
        check(compiled[name], eager[name], 1e-5, f"compile: {name} after 2 steps")


def test_unknown_config_names_the_choices():
    x, y = _batch(SMALL, 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="unknown torch configuration 'jit'.*eager, compile"):
        make_torch_step("jit", SMALL, init_params(SMALL, 0), x, y, LR, "cpu")


@pytest.mark.parametrize("name", ["cuda-graph", "compile-reduce-overhead"])
def test_gpu_only_configs_refuse_the_cpu(name):
    x, y = _batch(SMALL, 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match=f"{name}.*needs a CUDA GPU"):
        make_torch_step(name, SMALL, init_params(SMALL, 0), x, y, LR, "cpu")


def test_available_configs_on_the_cpu():
    names = available_configs("cpu")
    assert names[0] == "eager"
    assert set(names) <= {"eager", "compile"}
    assert set(names) <= set(TORCH_CONFIGS)


def test_bad_batch_is_refused():
    x, y = _batch(SMALL, 4, np.random.default_rng(0))
    state = init_params(SMALL, 0)
    with pytest.raises(ValueError, match="x must be a float32"):
        make_torch_step("eager", SMALL, state, x.double(), y, LR, "cpu")
    with pytest.raises(ValueError, match="y must be an int32 or int64"):
        make_torch_step("eager", SMALL, state, x, y[:3], LR, "cpu")


def test_time_torch_config_on_the_cpu():
    x, y = _batch(SMALL, 4, np.random.default_rng(0))
    step = make_torch_step("eager", SMALL, init_params(SMALL, 0), x, y, LR, "cpu")
    ms = time_torch_config(step.run, steps=2, windows=3, warmup=1, device="cpu")
    assert len(ms) == 3 and all(t > 0 for t in ms)
    assert int(step.model.bn1.num_batches_tracked) == 1 + 3 * 2
    with pytest.raises(ValueError, match="steps >= 1"):
        time_torch_config(step.run, steps=0, windows=1, warmup=0, device="cpu")


@pytest.fixture
def fp32_cuda():
    """Full FP32 on the GPU for the duration of a test (cuDNN defaults to TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _bn_shift_magnitudes(step):
    """Hooks on ``step``'s batchnorm layers: {"bn1.bias": M, ...}, filled as the
    steps run, M (C,) = lr * the sum over steps, images and pixels of |dL/dy|:
    the size of the terms each batchnorm shift's updates add up."""
    sums = {}

    def hook(name):
        def add(module, grad_in, grad_out):
            g = grad_out[0].detach().abs().sum(dim=(0, 2, 3)).double() * LR
            sums[name] = sums.get(name, 0) + g

        return add

    for layer in ("bn1", "bn2"):
        getattr(step.model, layer).register_full_backward_hook(hook(f"{layer}.bias"))
    return sums


def _check_states(other, eager, magnitudes, terms, what, tol=1e-4):
    """Every state tensor within ``tol`` of eager's, the batchnorm shifts within their
    rounding: they start at 0 and each step adds a sum of ``terms`` values that
    cancel, which cuDNN and inductor add in orders of their own (rounding_tolerance
    with ``terms`` roundings, the bound for a sum in any order). A configuration
    that trains on the wrong batch or skips an update errs by the size of the
    update itself, far past that."""
    for key in (*PARAM_NAMES, *BUFFER_NAMES):
        key_tol = tol
        if key in magnitudes:
            key_tol = rounding_tolerance(eager[key], magnitudes[key], terms, tol)
        check(other[key], eager[key], key_tol, f"{what}: {key} after 3 steps")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cuda-graph", "compile-reduce-overhead", "compile"])
def test_gpu_config_matches_eager(fp32_cuda, rng, name):
    """3 steps on 3 batches refilled in place: the same losses and state as eager.
    The capstone's full-size network, so cuDNN and Triton pick their real kernels."""
    device, config, state, batches = _gpu_case(fp32_cuda, rng, name)
    results, magnitudes = {}, {}
    for cfg in ("eager", name):
        x, y = _batch(config, 32, rng, device)
        step = make_torch_step(cfg, config, state, x, y, LR, device)
        if cfg == "eager":
            magnitudes = _bn_shift_magnitudes(step)
        results[cfg] = (_run_steps(step, x, y, batches), _state(step))
    (loss_e, eager), (loss_n, other) = results["eager"], results[name]
    check(loss_n, loss_e, 1e-4, f"{name}: losses of 3 steps")
    _check_states(other, eager, magnitudes, 32 * config.height * config.width, name)
    assert int(other["bn1.num_batches_tracked"]) == 3, "warm-up steps were not undone"


@pytest.mark.gpu
def test_time_torch_config_on_the_gpu(fp32_cuda, rng):
    x, y = _batch(SMALL, 4, rng, fp32_cuda)
    step = make_torch_step("cuda-graph", SMALL, init_params(SMALL, 0), x, y, LR, fp32_cuda)
    ms = time_torch_config(step.run, steps=5, windows=2, warmup=2, device=fp32_cuda)
    assert len(ms) == 2 and all(t > 0 for t in ms)
    assert int(step.model.bn1.num_batches_tracked) == 2 + 2 * 5


@pytest.mark.parametrize("was", [False, True])
def test_cudnn_benchmark_is_on_during_the_step_only(rng, was, monkeypatch):
    """cudnn_benchmark=True: the flag is on while the step runs (seen from inside
    the forward) and as the caller left it afterwards; the step is the same step."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", was)
    state = init_params(SMALL, int(rng.integers(1000)))
    x, y = _batch(SMALL, 4, rng)
    plain = make_torch_step("eager", SMALL, state, x, y, LR, "cpu")
    bench = make_torch_step("eager", SMALL, state, x, y, LR, "cpu", cudnn_benchmark=True)
    seen = []
    bench.model.conv1.register_forward_hook(lambda *_: seen.append(torch.backends.cudnn.benchmark))
    plain.run()
    bench.run()
    assert seen == [True] and torch.backends.cudnn.benchmark is was
    assert torch.equal(bench.loss(), plain.loss())
    for key, value in _state(plain).items():
        assert torch.equal(_state(bench)[key], value), key


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["eager", "cuda-graph"])
def test_gpu_cudnn_benchmark_matches_eager(fp32_cuda, rng, name):
    """cuDNN's timed choice of algorithms trains the same step (to rounding)."""
    config = NetConfig()
    state = init_params(config, int(rng.integers(1000)))
    batches = [_batch(config, 32, rng, fp32_cuda) for _ in range(3)]
    results, magnitudes = [], {}
    for cfg, bench in (("eager", False), (name, True)):
        x, y = _batch(config, 32, rng, fp32_cuda)
        step = make_torch_step(cfg, config, state, x, y, LR, fp32_cuda, cudnn_benchmark=bench)
        if not bench:
            magnitudes = _bn_shift_magnitudes(step)
        results.append((_run_steps(step, x, y, batches), _state(step)))
    (loss_e, eager), (loss_b, other) = results
    check(loss_b, loss_e, 1e-4, f"{name} +benchmark: losses of 3 steps")
    # cuDNN's timed choice may be a Winograd or FFT algorithm, which round more than
    # the direct convolution (the transforms' sums): conv2.weight differed by 1.01e-4
    # after 3 steps on an H100. A wrong step errs by the size of its updates.
    _check_states(other, eager, magnitudes, 32 * config.height * config.width, name, 1e-3)
    assert torch.backends.cudnn.benchmark is False


# A BF16 rounding in float32 ones (eps 2**-8 against 2**-24), for rounding_tolerance.
BF16_ROUNDING = 2**16


def test_bf16_autocast_step_runs_the_layers_in_bf16(rng):
    """autocast=torch.bfloat16: conv and linear outputs are BF16 (seen by forward
    hooks), the loss is float32 (so the cross-entropy ran inside the region) and
    within BF16's rounding of the FP32 step's (1.9e-3 at most over 1000 draws),
    yet not equal to it; the parameters stay float32, and fc2's update is the
    FP32 step's to BF16 rounding (2.7% at most over 1000 draws; a skipped update
    errs by 100%). The earlier layers' updates are not compared: their gradients
    sum terms that cancel through batchnorm, on 4 images of 8x8, and a BF16 step
    moves them by up to 100% of the FP32 update on such tiny draws."""
    state = init_params(SMALL, int(rng.integers(1000)))
    x, y = _batch(SMALL, 4, rng)
    plain = make_torch_step("eager", SMALL, state, x, y, LR, "cpu")
    amp = make_torch_step("eager", SMALL, state, x, y, LR, "cpu", autocast=torch.bfloat16)
    seen = {}
    for layer in ("conv1", "conv2", "fc1", "fc2"):
        getattr(amp.model, layer).register_forward_hook(
            lambda module, args, out, layer=layer: seen.__setitem__(layer, out.dtype)
        )
    plain.run()
    amp.run()
    assert seen == dict.fromkeys(("conv1", "conv2", "fc1", "fc2"), torch.bfloat16)
    assert not torch.is_autocast_enabled("cpu"), "the autocast region leaked out of the step"
    loss, ref = amp.loss(), plain.loss()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    check(loss, ref, 1e-2, "bf16-autocast loss against the fp32 step's")
    assert float(loss) != float(ref), "same loss as FP32: did autocast run at all?"
    after, ref_after = _state(amp), _state(plain)
    for name in PARAM_NAMES:
        assert after[name].dtype == torch.float32, f"{name} left float32"
        assert torch.isfinite(after[name]).all(), f"{name} is not finite after the step"
    for name in ("fc2.weight", "fc2.bias"):
        start = torch.from_numpy(state[name])
        check(after[name] - start, ref_after[name] - start, 1e-1, f"{name}'s bf16-autocast update")


def test_bf16_autocast_with_cudnn_benchmark_is_the_same_step(rng):
    state = init_params(SMALL, int(rng.integers(1000)))
    x, y = _batch(SMALL, 4, rng)
    amp = make_torch_step("eager", SMALL, state, x, y, LR, "cpu", autocast=torch.bfloat16)
    both = make_torch_step(
        "eager", SMALL, state, x, y, LR, "cpu", cudnn_benchmark=True, autocast=torch.bfloat16
    )
    amp.run()
    both.run()
    assert torch.equal(both.loss(), amp.loss())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_autocast_dtypes_are_refused(dtype):
    x, y = _batch(SMALL, 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="None or torch.bfloat16.*GradScaler"):
        make_torch_step("eager", SMALL, init_params(SMALL, 0), x, y, LR, "cpu", autocast=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cuda-graph", "compile-reduce-overhead", "compile"])
def test_gpu_bf16_autocast_config_matches_eager(fp32_cuda, rng, name):
    """Under BF16 autocast every configuration runs the eager BF16-autocast step:
    its logits are BF16 (a hook on fc2: it runs while dynamo traces and replays
    its side effects; a global one while the CUDA graph is warmed up and captured), the
    first step's loss, from the same weights, agrees within BF16's rounding
    (inductor may keep intermediates in float32 where eager rounds them to BF16),
    and the warm-up steps were undone. Later steps are not compared: SGD on
    gradients rounded in another order drifts apart by several percent of the
    weights in three steps (measured on an H100)."""
    device, config, state, batches = _gpu_case(fp32_cuda, rng, name)
    results, seen = {}, []

    def record(module, args, out):
        if isinstance(module, torch.nn.Linear) and module.out_features == config.num_classes:
            seen.append(out.dtype)

    for cfg in ("eager", name):
        x, y = _batch(config, 32, rng, device)
        # cuda-graph runs the forward in Python only while make_torch_step warms up
        # and captures it: a global hook is there then; the compiled ones trace later
        hook = None
        if cfg == "cuda-graph":
            hook = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            step = make_torch_step(cfg, config, state, x, y, LR, device, autocast=torch.bfloat16)
        finally:
            if hook is not None:
                hook.remove()
        if cfg not in ("eager", "cuda-graph"):
            step.model.fc2.register_forward_hook(record)
        results[cfg] = (_run_steps(step, x, y, batches), _state(step))
    (loss_e, _), (loss_n, other) = results["eager"], results[name]
    assert seen and set(seen) == {torch.bfloat16}, f"{name}: fc2 gave {set(seen)}"
    assert loss_n.dtype == torch.float32 and torch.isfinite(loss_n).all()
    check(loss_n[:1], loss_e[:1], 2e-2, f"{name} bf16-autocast: the first step's loss")
    assert int(other["bn1.num_batches_tracked"]) == 3, "warm-up steps were not undone"

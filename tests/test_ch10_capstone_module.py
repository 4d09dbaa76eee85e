"""Chapter 10, capstone_module.py: FastCNN as a torch module, trained by a PyTorch loop.

Tiny network (8x8 images, channels 2/4, hidden 16): a simulated step takes a few seconds,
so the tests share one step (a module fixture) and run nine steps in all. For that they
share one seed too: this module's ``rng`` is conftest's at module scope (``--seed N``
replays it, ``--seed-sweep`` runs the module once a seed).
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import EPS32, check, rounding_tolerance
from common.internal.exercises import load_chapter_module

import os

import numpy as np
import pytest
import torch

from final_project.fast_model import FastCNN
from final_project.model import PARAM_NAMES, NetConfig
from final_project.torch_twin import TorchCNN
from final_project.train import TINY

cm = load_chapter_module("10_pytorch_extensions", "capstone_module")
bridge = load_chapter_module("10_pytorch_extensions", "bridge")
CONFIG = NetConfig(height=8, width=8, c1=TINY.c1, c2=TINY.c2, hidden=TINY.hidden)
LR = TINY.lr
MAX_BATCH = 4
DEVICE = bridge.device()  # where CapstoneNet's tensors live


@pytest.fixture(scope="module")
def rng(request):
    """The rng fixture of conftest.py, once for the module: the seed of
    ``--seed-sweep`` (a parameter), else ``--seed N`` or COURSE_SEED, else fresh."""
    chosen = getattr(request, "param", None)
    if chosen is None:
        chosen = request.config.getoption("--seed", default=None)
    if chosen is None and os.environ.get("COURSE_SEED", "").strip():
        chosen = int(os.environ["COURSE_SEED"])
    if chosen is None:
        chosen = int(np.random.SeedSequence().entropy % 2**31)
    return np.random.default_rng(chosen)


@pytest.fixture
def seed(request, rng):
    """The module's seed (initial weights, the batch), put into this test's
    failure report with the command that replays it."""
    value = int(rng.bit_generator.seed_seq.entropy)
    request.node.user_properties.append(("seed", value))
    return value


def random_batch(seed: int, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """n images of N(0, 1) (n = 3: not the max batch) and labels in [0, 10), int64,
    on DEVICE."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, CONFIG.height, CONFIG.width)).astype(np.float32)
    y = rng.integers(0, CONFIG.num_classes, n)
    return torch.from_numpy(x).to(DEVICE), torch.from_numpy(y).to(DEVICE)


@pytest.fixture(scope="module")
def one_step(rng):
    """One step of the PyTorch loop on CapstoneNet, and FastCNN.train_step from the
    same weights on the same batch."""
    seed = int(rng.bit_generator.seed_seq.entropy)
    x, y = random_batch(seed)
    net = cm.CapstoneNet(CONFIG, MAX_BATCH, seed=seed)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    optimizer.zero_grad()
    loss = net(x, y)
    loss.backward()
    grads = {name: net.get_parameter(name).grad.clone() for name in PARAM_NAMES}
    optimizer.step()

    ref = FastCNN(CONFIG, MAX_BATCH, seed=seed, graph=False)
    ref.train_step(x.cpu().numpy(), y.cpu().numpy().astype(np.int32), LR)
    ref.synchronize()
    return {
        "seed": seed,
        "x": x,
        "y": y,
        "net": net,
        "before": before,
        "loss": loss.item(),
        "grads": grads,
        "ref": ref,
        "ref_loss": float(ref.loss.copy_to_host()[0]),
        "ref_grads": ref.grads.download(),
        "ref_state": ref.state_dict(),
    }


def test_parameters_and_buffers_share_fastcnn_memory_both_ways(seed):
    rng = np.random.default_rng(seed)
    net = cm.CapstoneNet(CONFIG, MAX_BATCH, seed=seed)
    fast = net.fast
    for name, tensor in net.state_dict().items():
        if name.endswith("num_batches_tracked"):
            continue
        store = fast.params if name in PARAM_NAMES else fast.buffers
        from_torch = rng.standard_normal(tuple(tensor.shape)).astype(np.float32)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(from_torch))  # write through torch ...
        np.testing.assert_array_equal(store[name].copy_to_host(), from_torch, err_msg=name)
        from_numba = rng.standard_normal(tuple(tensor.shape)).astype(np.float32)
        store[name].copy_to_device(from_numba)  # ... and through Numba
        np.testing.assert_array_equal(tensor.cpu().numpy(), from_numba, err_msg=name)


def test_state_dict_keys_are_the_twins_and_load_into_it(seed):
    net = cm.CapstoneNet(CONFIG, MAX_BATCH, seed=seed)
    twin = TorchCNN(CONFIG)
    assert list(net.state_dict()) == list(twin.state_dict())
    twin.load_state_dict(net.state_dict())  # strict: every name and shape fits
    for name, value in net.fast.state_dict().items():
        np.testing.assert_array_equal(twin.state_dict()[name].numpy(), value, err_msg=name)
    # and back: a state dict loaded into CapstoneNet lands in FastCNN's buffers
    state = {k: v.clone() for k, v in TorchCNN(CONFIG).state_dict().items()}
    state["bn1.num_batches_tracked"].fill_(7)
    state["bn2.num_batches_tracked"].fill_(7)
    net.load_state_dict(state)
    for name, value in net.fast.state_dict().items():
        np.testing.assert_array_equal(value, state[name].numpy(), err_msg=name)
    assert net.fast.num_batches_tracked == 7


@pytest.mark.usefixtures("seed")  # its replay command in a failure report
def test_backward_gives_fastcnns_gradients(one_step):
    s = one_step
    assert s["loss"] == pytest.approx(s["ref_loss"], rel=1e-6), f"seed {s['seed']}"
    for name in PARAM_NAMES:
        check(s["grads"][name], s["ref_grads"][name], tol=1e-6, name=f"{name}.grad")


@pytest.mark.usefixtures("seed")  # its replay command in a failure report
def test_one_torch_sgd_step_equals_fastcnn_train_step(one_step):
    s = one_step
    after = s["net"].state_dict()
    for name in PARAM_NAMES:
        old, grad = s["before"][name].cpu().numpy(), s["ref_grads"][name]
        if name not in ("conv1.bias", "conv2.bias"):  # batchnorm cancels a conv bias: grad ~0
            assert not np.array_equal(after[name].cpu().numpy(), old), f"{name} did not move"
        # torch: p + (-lr) * g in float32; FastCNN: p - lr * g with lr in float64,
        # one rounding to float32: a couple of roundings of |p| + lr |g| apart.
        tol = rounding_tolerance(s["ref_state"][name], np.abs(old) + LR * np.abs(grad), 3, 0.0)
        check(after[name], s["ref_state"][name], tol=tol, name=name)
    for name in ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"):
        check(after[name], s["ref_state"][name], tol=4 * EPS32, name=name)
    assert int(after["bn1.num_batches_tracked"]) == s["ref"].num_batches_tracked == 1


@pytest.mark.usefixtures("seed")  # its replay command in a failure report
def test_backward_scales_by_grad_output_and_accumulates(one_step):
    s = one_step
    net = cm.CapstoneNet(CONFIG, MAX_BATCH, seed=s["seed"])  # the weights before the step
    loss = net(s["x"], s["y"])
    (2.5 * loss).backward(retain_graph=True)
    for name in PARAM_NAMES:
        check(net.get_parameter(name).grad, 2.5 * s["grads"][name], tol=1e-6, name=name)
    again = net(s["x"], s["y"])  # overwrites FastCNN's gradient buffer
    with pytest.raises(RuntimeError, match="before the next forward"):
        loss.backward()
    again.backward()  # p.grad accumulates, as for any torch module
    for name in PARAM_NAMES:
        check(net.get_parameter(name).grad, 3.5 * s["grads"][name], tol=1e-6, name=name)


@pytest.mark.usefixtures("seed")  # its replay command in a failure report
def test_bad_inputs_are_refused_before_any_launch(one_step):
    net = cm.CapstoneNet(CONFIG, MAX_BATCH, seed=0)
    x, y = one_step["x"], one_step["y"]
    with pytest.raises(ValueError, match="x.detach"):
        net(x.clone().requires_grad_(), y)
    with pytest.raises(TypeError, match="float32"):
        net(x.double(), y)
    with pytest.raises(ValueError, match="max_batch"):
        net(torch.cat([x, x]), torch.cat([y, y]))
    net.eval()
    with pytest.raises(RuntimeError, match="training loss only"):
        net(x, y)
    net.train()
    net.double()  # replaces the shared tensors
    with pytest.raises(RuntimeError, match="no longer shares memory"):
        net(x, y)
    assert net.fast.num_batches_tracked == 0  # nothing ran


def test_loss_curve_follows_the_torch_twin(seed):
    batches = cm.mnist_batches(CONFIG, MAX_BATCH, 3, seed=seed)
    curves = cm.compare_with_twin(CONFIG, batches, LR, seed=seed)
    assert len(curves.ours) == len(curves.twin32) == 3
    assert curves.ours[0] != curves.ours[-1], "the weights did not change between steps"
    assert curves.first_step <= cm.FIRST_STEP_TOLERANCE, (seed, cm.format_curves(curves))
    assert curves.ours_vs_twin <= curves.tolerance, (seed, cm.format_curves(curves))
    assert curves.passed


def test_main_exits_0_and_prints_the_curves(tmp_path, capsys):
    assert cm.main(["--steps", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "torch f32" in out and "max relative difference" in out
    assert (tmp_path / "capstone_module.json").is_file()


@pytest.fixture
def simulator_tolerance(monkeypatch):
    """The simulator's curve tolerance on any machine: these tests feed Curves
    hand-made losses, sized for it (a GPU's run is 100 steps at 2e-2)."""
    monkeypatch.setattr(cm, "TOLERANCE", 1e-4)


def test_curve_tolerance_widens_with_the_twins_own_drift_only(simulator_tolerance):
    twin32 = [2.0, 1.9, 1.8]
    ours = [2.0, 1.91, 1.8]  # 0.5% off at step 1: a wrong gradient's size
    assert not cm.Curves(ours, twin32, twin32).passed  # no drift: TOLERANCE holds
    chaotic = [2.0, 1.9, 1.802]  # float64 twin 1.1e-3 away: rounding amplified 1e4-fold
    curves = cm.Curves(ours, twin32, chaotic)
    assert curves.tolerance == pytest.approx(cm.DRIFT_FACTOR * 0.002 / 1.802)
    assert curves.passed
    assert not cm.Curves([2.0, 1.91, 1.6], twin32, chaotic).passed  # 11% off: still wrong
    assert not cm.Curves([2.001, 1.9, 1.8], twin32, chaotic).passed  # first step is exact


def test_curve_tolerance_widens_when_one_ulp_twins_land_across_a_kink(simulator_tolerance):
    # Seed 161 of the tiny network (torch 2.11 CPU): at step 2 the float32 twin
    # lands with the float64 twin, ours on the other side of a kink that
    # float32 rounding decides; twins started one ulp away land on both sides.
    ours = [2.1356826, 2.5056188, 2.0913157]
    twin32 = [2.1356826, 2.5056190, 2.0903106]
    twin64 = [2.1356825, 2.5056188, 2.0903107]
    assert not cm.Curves(ours, twin32, twin64).passed
    perturbed = [[2.1356826, 2.5056188, 2.0903108], [2.1356826, 2.5056190, 2.0913157]]
    curves = cm.Curves(ours, twin32, twin64, perturbed)
    assert curves.float32_drift == pytest.approx((2.0913157 - 2.0903106) / 2.0903106)
    assert curves.passed
    assert not cm.Curves([2.1356826, 2.52, 2.0913157], twin32, twin64, perturbed).passed


def test_one_ulp_away_moves_every_weight_exactly_one_ulp_both_ways():
    net = cm.CapstoneNet(CONFIG, MAX_BATCH, seed=3)
    twin = cm.twin_of(net, torch.float32)
    before = [p.detach().clone() for p in twin.parameters()]
    cm.one_ulp_away(twin, torch.Generator().manual_seed(0))
    ups = downs = 0
    for b, p in zip(before, twin.parameters()):
        up, down = torch.nextafter(b, b + 1), torch.nextafter(b, b - 1)
        assert torch.all((p == up) | (p == down))
        ups, downs = ups + int((p == up).sum()), downs + int((p == down).sum())
    assert ups > 0 and downs > 0

"""FastCNN (fast kernels, one CUDA graph a step) against the float64 PyTorch twin,
and the graph path's logic (capture once per batch size and learning rate,
replay, a new batch size builds a new graph) as far as the simulator allows.

The step check is the same one the naive model passes (final_project.checks,
relative error 1e-4 on the loss, every gradient, every parameter and running
statistic after the update); sizes are hostile: odd channel counts, batch 1,
a batch that is not a multiple of any tile nor of the batchnorm backward
reduce's group of images; a label equal to the class count gives a NaN loss.
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import CheckError, check
from common.internal import racecheck
from common.internal.float32_purity import recording_launches

import numpy as np
import pytest
from mutants import mutant
from numba import cuda

from final_project import checks, fast_model, reference
from final_project import fast_layers as fl
from final_project.fast_model import STAGES, FastCNN, Stage
from final_project.graph import EagerBackend
from final_project.model import NetConfig, NumbaCNN, init_params

TINY = NetConfig(height=8, width=8, c1=3, c2=5, hidden=7, num_classes=4)
# Images 8 x (3/2) BN_REDUCE_BLOCK: bn1's pooled planes hold 3 BN_REDUCE_BLOCK
# values, so its backward reduce (about 8 values a thread) takes 2 images a block
# (fl.bn_backward_images_per_block) and a batch of 3 leaves the last block one
# image: with the GPU's block size as with the simulator's.
TAIL = NetConfig(height=8, width=3 * fl.BN_REDUCE_BLOCK // 2, c1=3, c2=5, hidden=7, num_classes=4)
TAIL_BATCH = 3
# conv1's fused backward (first_conv) takes 1 to 3 input channels; 4 take the
# two-kernel path with dz1 in memory
RGB = NetConfig(in_channels=3, height=8, width=8, c1=3, c2=5, hidden=7, num_classes=4)
FOUR_IN = NetConfig(in_channels=4, height=8, width=8, c1=3, c2=5, hidden=7, num_classes=4)


# A batch is redrawn while an input of fc1's ReLU lies within KINK_MARGIN of the
# size of its terms (sum |a w| + |b|) from 0. There float32 rounding, about
# K eps32 of those terms for K inputs (7e-6 for the 60 inputs of TAIL), can
# close a unit the float64 reference opens: one (image, unit) of a batch of 3
# then moves that unit's row of fc1's weight gradient by O(1) (seen: an input
# of 1.3e-7). check_train_step takes the model's max-pool choice at near-ties;
# for ReLU kinks it has no rule, and no check can judge the draw.
KINK_MARGIN = 1e-4


def judgeable_batch(state, config, n, rng):
    """checks.random_batch, drawn again while the float64 forward from ``state``
    puts an input of fc1's ReLU within KINK_MARGIN of its terms' size from 0."""
    for _ in range(100):
        x, y = checks.random_batch(config, n, rng)
        _, caches, _ = reference.reference_forward(state, x, config, training=True)
        a, w = caches["fc1"]
        terms = np.abs(a) @ np.abs(w.T) + np.abs(state["fc1.bias"].astype(np.float64))
        if np.all(np.abs(caches["relu_fc1"]) > KINK_MARGIN * terms):
            return x, y
    raise AssertionError("100 batches in a row put a ReLU input at its kink")


def _poison_bn_partials(model):
    """NaN in the batchnorm partial-sum buffers, so a row a step leaves unwritten
    shows (freshly allocated memory may hold the right numbers from an earlier
    step or test: a graph replay reads the previous step's)."""
    for name in ("bn1_partials", "bn2_partials", "bn1_back_partials", "bn2_back_partials"):
        buf = getattr(model, name)
        buf.copy_to_device(np.full(buf.shape, np.nan, buf.dtype))


def _assert_short_last_bn1_block(config, n):
    per = fl.bn_backward_images_per_block(n, config.height // 2, config.width // 2)
    assert n % per, f"a batch of {n} is {n // per} whole groups of {per} images"


@pytest.mark.parametrize(
    "config, n",
    [(TINY, 1), (TINY, 3), (TAIL, TAIL_BATCH), (RGB, 2), (FOUR_IN, 2)],
    ids=["batch1", "batch3", "batch3-short-last-bn-block", "rgb", "4-channels-unfused-conv1"],
)
def test_fast_train_step_matches_reference(rng, config, n):
    if config is TAIL:
        _assert_short_last_bn1_block(config, n)
    # max_batch n + 1: a batch smaller than the buffers uses their first rows
    model = FastCNN(config, max_batch=n + 1, seed=int(rng.integers(1000)))
    assert model.conv1_kind == ("fused" if config.in_channels <= 3 else "direct")
    _poison_bn_partials(model)
    x, y = judgeable_batch(model.state_dict(), config, n, rng)
    checks.check_train_step(model, x, y, lr=0.1)


# All 32 classes the fused classifier holds: a label of 32 is then past the end of
# its logit row, so a bounds test with <= for < reads outside the row (an
# IndexError in the simulator, a neighbour's finite logit on a GPU).
FULL_HEAD = NetConfig(height=8, width=8, c1=2, c2=3, hidden=5, num_classes=fl.CLS_MAX_CLASSES)


def check_label_equal_to_classes_gives_nan_loss(rng):
    """One label equal to num_classes (one past the last class): the model's
    contract is a NaN loss (labels are checked on the device, not refused)."""
    model = FastCNN(FULL_HEAD, max_batch=2, seed=int(rng.integers(1000)))
    x, y = checks.random_batch(FULL_HEAD, 2, rng)
    y[1] = FULL_HEAD.num_classes
    model.loss_and_grads(x, y)
    model.synchronize()
    loss = float(model.loss.copy_to_host()[0])
    assert np.isnan(loss), f"label {y[1]} of {FULL_HEAD.num_classes} classes gave the loss {loss}"


def test_label_equal_to_classes_gives_nan_loss(rng):
    check_label_equal_to_classes_gives_nan_loss(rng)


def test_nan_loss_check_catches_label_equal_to_classes(rng, monkeypatch):
    kernel = mutant(
        fl.classifier_fused_kernel,
        ("if (label >= 0 and label < classes)", "if (label >= 0 and label <= classes)"),
    )
    monkeypatch.setattr(fl, "classifier_fused_kernel", kernel)
    with pytest.raises((AssertionError, IndexError)):
        check_label_equal_to_classes_gives_nan_loss(rng)


def test_fast_eval_forward_matches_reference(rng):
    checks.check_eval_forward(TINY, 3, rng, model_cls=FastCNN)


def test_fast_conv1_igemm_variant_matches_naive_model(rng):
    """conv1 through the implicit GEMM instead of the direct kernel: same step."""
    state = init_params(TINY, 1)
    x, y = judgeable_batch(state, TINY, 2, rng)  # the two models round differently too
    fast = FastCNN(TINY, max_batch=2, params=state, conv1="igemm")
    naive = NumbaCNN(TINY, max_batch=2, params=state)
    for model in (fast, naive):
        model.train_step(cuda.to_device(x), cuda.to_device(y), 0.1)
    check(fast.loss, naive.loss.copy_to_host().astype(np.float64), 1e-5, "loss")
    ours, ref = fast.state_dict(), naive.state_dict()
    for name in ref:
        if ref[name].dtype.kind != "f":
            continue
        if not ref[name].any():
            # A conv bias right before batchnorm gets a zero gradient (the batch mean
            # cancels it), so both models may keep it at exactly zero: compare absolutely.
            assert np.abs(ours[name]).max() <= 1e-6, (name, ours[name])
            continue
        check(ours[name], ref[name].astype(np.float64), 1e-5, name)


class CountingBackend(EagerBackend):
    """Eager stand-in for the CUDA graph backend that counts captures and replays."""

    def __init__(self):
        self.captures = []
        self.replays = 0

    def capture(self, stream, launches):
        self.captures.append(launches)
        recorded = super().capture(stream, launches)
        backend = self

        class Counted:
            def launch(self, s):
                backend.replays += 1
                recorded.launch(s)

        return Counted()


def test_graph_captured_once_per_batch_size_and_replayed(rng):
    state = init_params(TINY, 2)
    backend = CountingBackend()
    # Batches of 2, 1, 2: two batch sizes (two graphs), then a replay; small,
    # because each step runs every kernel in the simulator.
    graphed = FastCNN(TINY, max_batch=2, params=state, graph_backend=backend)
    eager = FastCNN(TINY, max_batch=2, params=state, graph=False)
    batches = [checks.random_batch(TINY, n, rng) for n in (2, 1, 2)]
    # About graphs, not races: the race detector checks each kernel's first launch
    # here (test_fast_train_step_matches_reference checks every launch of a step).
    with racecheck.first_launch_of_each_kernel():
        for x, y in batches:
            for model in (graphed, eager):
                model.train_step(x, y, 0.05)
    # first step at a batch size runs eagerly and is captured; the rest replay
    assert len(backend.captures) == 2
    assert backend.replays == len(batches) - 2
    assert set(graphed.graphs) == {(2, 0.05), (1, 0.05)}
    # a new learning rate is a new graph (the scalar is recorded in it)
    with racecheck.first_launch_of_each_kernel():
        graphed.train_step(*batches[0], 0.01)
        eager.train_step(*batches[0], 0.01)
    assert len(backend.captures) == 3
    a, b = graphed.state_dict(), eager.state_dict()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def _step_by_stage(model, x, y, lr):
    """train_step with on_stage: [(stage, [kernels launched since the previous
    stage])] in the order of the calls."""
    stages = []
    with recording_launches() as launches:

        def on_stage(name):
            done = sum(len(k) for _, k in stages)
            stages.append((name, [fn.__name__ for fn, _, _ in launches[done:]]))

        model.train_step(x, y, lr, on_stage=on_stage)
    return stages


def test_on_stage_comes_after_each_stages_launches_in_stages_order(rng):
    """on_stage(name) once per stage of STAGES, in that order, right after that
    stage's launches, which run from the host: with a graph backend, neither
    before nor after the step's graph exists is anything captured or replayed
    for it. The stages' kernels are the step's 28 launches, each in its stage."""
    state = init_params(TINY, 4)
    backend = CountingBackend()
    graphed = FastCNN(TINY, max_batch=2, params=state, graph_backend=backend)
    eager = FastCNN(TINY, max_batch=2, params=state, graph=False)
    x, y = checks.random_batch(TINY, 2, rng)
    with racecheck.first_launch_of_each_kernel():
        first = _step_by_stage(graphed, x, y, 0.05)
        assert (len(backend.captures), backend.replays) == (0, 0)
        graphed.train_step(x, y, 0.05)  # the plain step: captured
        second = _step_by_stage(graphed, x, y, 0.05)
        assert (len(backend.captures), backend.replays) == (1, 0)
        for _ in range(3):
            eager.train_step(x, y, 0.05)
    for stages in (first, second):
        assert [name for name, _ in stages] == list(STAGES)
        kernels = dict(stages)
        assert all(kernels.values()), f"stages with no launch: {kernels}"
        assert sum(map(len, kernels.values())) == 28
        assert kernels[Stage.SGD_UPDATE] == ["sgd_update_naive"]
        # the linear layers and the convolutions share one split-K reduction
        assert kernels[Stage.FC1_GRAD_WEIGHT] == ["gemm_splitk", "splitk_reduce_weight_bias"]
        assert kernels[Stage.CONV2_GRAD_WEIGHT] == [
            "conv2d_grad_weight_igemm",
            "splitk_reduce_weight_bias",
        ]
        # conv1 (one input channel) computed once, in the max-pool kernel; its
        # statistics and weight gradient from the images' patch Gram matrix
        assert kernels[Stage.CONV1_FORWARD] == [
            "patch_gram_kernel",
            "gram_finalize_kernel",
            "gram_bn_sums_kernel",
        ]
        assert kernels[Stage.BN1_RELU_POOL1] == ["conv_bn_relu_maxpool"]
        assert kernels[Stage.BN1_BACKWARD_REDUCE] == ["winners_reduce", "bn_backward_finalize"]
        assert kernels[Stage.CONV1_GRAD_WEIGHT] == [
            "splitk_reduce_weight_bias",
            "gram_grad_weight_kernel",
        ]
    a, b = graphed.state_dict(), eager.state_dict()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_step_whose_marks_drift_from_stages_fails(rng, monkeypatch):
    """A step that marks its stages in another order than STAGES (here: STAGES
    with its first two swapped) stops at the first disagreement, naming both."""
    drifted = (STAGES[1], STAGES[0], *STAGES[2:])
    monkeypatch.setattr(fast_model, "STAGES", drifted)
    model = FastCNN(TINY, max_batch=2, seed=0)
    seen = []
    with pytest.raises(RuntimeError, match="'conv1 forward' where fast_model.STAGES has 'bn1"):
        model.train_step(*checks.random_batch(TINY, 2, rng), 0.05, on_stage=seen.append)
    assert seen == []


def test_a_batch_in_the_static_buffers_is_not_copied_again(rng, monkeypatch):
    """static_batch's arrays passed back to train_step: no copy, the same step."""
    state = init_params(TINY, 5)
    staged = FastCNN(TINY, max_batch=3, params=state, graph=False)
    plain = FastCNN(TINY, max_batch=3, params=state, graph=False)
    x, y = checks.random_batch(TINY, 2, rng)
    xs, ys = staged.static_batch(2)
    assert (xs.shape, ys.shape) == (x.shape, y.shape)
    xs.copy_to_device(x)
    ys.copy_to_device(y)
    copies = []
    for a in (xs, ys):
        monkeypatch.setattr(a, "copy_to_device", lambda *args, **kw: copies.append(args))
    with racecheck.first_launch_of_each_kernel():
        staged.train_step(xs, ys, 0.05)
        plain.train_step(x, y, 0.05)
    assert copies == []
    a, b = staged.state_dict(), plain.state_dict()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_graph_refused_in_simulator_without_backend():
    if not common.is_simulator():
        pytest.skip("on a GPU graph=True is the default path")
    with pytest.raises(ValueError, match="no CUDA graphs"):
        FastCNN(TINY, max_batch=2, graph=True)


@pytest.mark.parametrize(
    "x, y, match",
    [
        (np.zeros((2, 1, 8, 8), np.float64), np.zeros(2, np.int32), "dtype float64"),
        (np.zeros((2, 1, 8, 6), np.float32), np.zeros(2, np.int32), "shape"),
        (np.zeros((3, 1, 8, 8), np.float32), np.zeros(3, np.int32), "max_batch=2"),
        (np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64), "dtype int64"),
        (np.zeros((2, 1, 8, 8), np.float32), np.zeros(1, np.int32), "one label per image"),
        (np.zeros((2, 1, 8, 8), np.float32)[:, :, :, ::-1], np.zeros(2, np.int32), "contiguous"),
    ],
)
def test_fast_model_refuses_bad_batches(x, y, match):
    model = FastCNN(TINY, max_batch=2, graph=False)
    with pytest.raises(ValueError, match=match):
        model.train_step(x, y, 0.1)


def test_fast_model_refuses_fused_conv1_for_four_input_channels():
    with pytest.raises(ValueError, match="1 to 3 input channels.*conv1 'direct'"):
        FastCNN(FOUR_IN, max_batch=2, conv1="fused")


def test_fast_model_refuses_too_many_classes():
    with pytest.raises(ValueError, match="at most 32 classes"):
        FastCNN(NetConfig(height=8, width=8, c1=2, c2=2, hidden=4, num_classes=40), max_batch=2)


@pytest.mark.gpu
def test_gpu_graph_step_equals_eager_step(rng):
    """On a GPU: the replayed graph computes exactly what the eager launches do."""
    config = NetConfig()
    state = init_params(config, 3)
    graphed = FastCNN(config, max_batch=64, params=state, graph=True)
    eager = FastCNN(config, max_batch=64, params=state, graph=False)
    for _ in range(3):
        x, y = checks.random_batch(config, 64, rng)
        graphed.train_step(x, y, 0.05)
        eager.train_step(x, y, 0.05)
    assert len(graphed.graphs) == 1
    a, b = graphed.state_dict(), eager.state_dict()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_step_check_refuses_a_relu_decision_far_from_zero(rng):
    """The ReLU tie rule follows the model's on/off decisions only near 0: a model
    whose fc1 unit is off where its input is clearly positive (here: relu_open
    reporting the most open unit closed) fails, named, instead of being followed."""

    class ClosesOneUnit(FastCNN):
        def relu_open(self, n):
            pool1, pool2, fc1 = super().relu_open(n)
            hidden = self._rows("hidden_act", n).copy_to_host()
            fc1[np.unravel_index(hidden.argmax(), hidden.shape)] = False
            return pool1, pool2, fc1

    model = ClosesOneUnit(TINY, max_batch=3, seed=int(rng.integers(1 << 30)))
    x, y = checks.random_batch(TINY, 3, rng)
    with pytest.raises(CheckError, match="fc1 ReLU"):
        checks.check_train_step(model, x, y, lr=0.1)

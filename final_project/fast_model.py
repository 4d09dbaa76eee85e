"""The capstone network on the fast kernels, one CUDA graph a training step.

Same network, parameters, state dicts and checks as :class:`final_project.model.NumbaCNN`
(both derive from :class:`~final_project.model.CNNBase`); what changes is how a
step runs:

    forward   conv1's BN sums from the images' patch Gram matrix (conv1 not
              computed) -> BN1 statistics -> conv1 + BN1 apply + ReLU + max-pool
              (one kernel; the window winners' conv outputs kept for the backward)
              -> conv2 (implicit GEMM, BN
              partials in the epilogue) -> BN2 statistics -> BN2 + ReLU + pool
              -> fc1 (split-K GEMM, bias + ReLU when reducing) -> fc2 + log-softmax
              + NLL + dlogits + fc1's masked output gradient (one kernel) -> mean loss
    backward  fc2 and fc1 weight gradients (split-K GEMMs, bias as a column of ones)
              -> fc1 input gradient -> pool2/ReLU2/BN2 backward (partials, then dz2)
              -> conv2 weight gradient (split-K) and input gradient (implicit GEMM)
              -> pool1/ReLU1/BN1 backward reduce over the window winners, with
              the winners' sums S -> conv1's weight gradient from G and S
    update    one SGD launch over the flat parameter buffer

conv1's output and its gradient are never in memory: with one input channel the
images' patch Gram matrix G gives conv1's statistics and weight gradient
(:mod:`final_project.conv1_gram`); with 2 or 3 the sums and the backward kernels
compute conv1 again from the images (:mod:`final_project.first_conv`). With
conv1="direct" or "igemm" (and for inputs first_conv does not take) conv1
writes its output and the BN1 kernels read it, as chapter 9 profiled.

With ``precision="tf32"`` conv2's three GEMMs (forward, weight gradient, input
gradient) run on the tensor cores instead (:mod:`final_project.tf32_conv`); the
forward and the input gradient read channels-last copies of their inputs: the
conv2 forward stage also converts the conv2 weights and pool1's output, the grad
input stage dz2, and the weight gradient adds its split-K partials in a second
launch (4 launches more).

That is 28 launches (FP32; 26 for 2 or 3 input channels), every one on the
model's own stream, with every buffer allocated once for ``max_batch``. On a
GPU the first step at a new batch size (or learning rate) runs eagerly, which
compiles and warms every kernel, and is then captured once into a CUDA graph (``cuStreamBeginCapture`` on that stream,
CUDA C++ Programming Guide, "CUDA Graphs: stream capture"); every later step
copies the batch into the static input buffers and replays the graph, so the
step costs no Python per launch (the README's "How we beat PyTorch" measures
both). In the simulator, which has no graphs, the same launches run eagerly.

The launches fall into the stages of :data:`STAGES` (one table: the step's
marks, ``compare``'s per-stage work and timing, and chapter 9's profiles all
read it). ``train_step(..., on_stage=f)`` calls ``f(stage)`` after each
stage's launches, which then run from the host, never from a graph.

Usage::

    model = FastCNN(NetConfig(), max_batch=64, seed=0)
    model.train_step(x, y, lr=0.05)   # x (N, 1, 28, 28) f32, y (N,) int32: host or device
    loss = model.loss.copy_to_host()[0]
    model.train_step(x, y, lr=0.05, on_stage=print)   # "conv1 forward", ..., "sgd update"
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.runtime import is_simulator

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda

from final_project import conv1_gram, first_conv, tf32_conv
from final_project import fast_conv as fconv
from final_project import fast_layers as fl
from final_project import kernels as naive
from final_project.graph import CudaGraphBackend, default_graph_backend
from final_project.model import CNNBase, NetConfig, _Layer
from final_project.reference import TF32_OPS


class Stage:
    """The stages of one training step, in launch order (a stage is one or two
    launches). The class is the table: :data:`STAGES` is read from it, and the
    step marks the end of each stage with one of these names."""

    CONV1_FORWARD = "conv1 forward"
    BN1_STATISTICS = "bn1 statistics"
    BN1_RELU_POOL1 = "bn1+relu+pool1"
    CONV2_FORWARD = "conv2 forward"
    BN2_STATISTICS = "bn2 statistics"
    BN2_RELU_POOL2 = "bn2+relu+pool2"
    FC1_FORWARD = "fc1 forward"
    FC2_LOSS_GRADS = "fc2+loss+grads"
    LOSS_MEAN = "loss mean"
    FC2_GRAD_WEIGHT = "fc2 grad weight"
    FC1_GRAD_WEIGHT = "fc1 grad weight"
    FC1_GRAD_INPUT = "fc1 grad input"
    BN2_BACKWARD_REDUCE = "bn2 backward reduce"
    BN2_BACKWARD_DX = "bn2 backward dx"
    CONV2_GRAD_WEIGHT = "conv2 grad weight"
    CONV2_GRAD_INPUT = "conv2 grad input"
    BN1_BACKWARD_REDUCE = "bn1 backward reduce"
    CONV1_GRAD_WEIGHT = "conv1 grad weight"
    SGD_UPDATE = "sgd update"


# The stage names in launch order: what train_step's on_stage receives, and the
# keys of compare.stage_work.
STAGES: tuple[str, ...] = tuple(v for k, v in vars(Stage).items() if k.isupper())


PRECISIONS = ("fp32", "tf32")
CONV1_KINDS = ("fused", "direct", "igemm")


def tf32_refusal(config: NetConfig) -> str | None:
    """Why precision "tf32" cannot run ``config`` (a sentence), or None: conv2's
    sizes must be ones the TF32 kernels take (:func:`final_project.tf32_conv.supported`)."""
    return tf32_conv.supported(config.c1, config.c2, config.height // 2, config.width // 2)


def default_conv1(config: NetConfig) -> str:
    """FastCNN's conv1 kind when none is given: "fused" where
    :func:`final_project.first_conv.supported` takes the input, else "direct"."""
    fused = first_conv.supported(config.in_channels, config.height, config.width) is None
    return "fused" if fused else "direct"


def uses_patch_gram(config: NetConfig, conv1: str) -> bool:
    """Whether conv1 kind ``conv1`` takes conv1's statistics and weight gradient
    from the patch Gram matrix (:mod:`final_project.conv1_gram`): "fused" with
    one input channel."""
    return (
        conv1 == "fused"
        and conv1_gram.supported(config.in_channels, config.height, config.width) is None
    )


def _no_mark(name: str) -> None:
    pass


def _in_order(on_stage: Callable[[str], None]) -> tuple[Callable[[str], None], Callable[[], None]]:
    """(mark, done): ``mark(name)`` checks that ``name`` is the next of STAGES and
    calls ``on_stage(name)``; ``done()`` checks that every stage was marked. So a
    step whose marks drift from STAGES fails where it drifts, instead of a
    profile or a timing table putting one stage's kernels under another's name."""
    expected = iter(STAGES)

    def mark(name: str) -> None:
        want = next(expected, None)
        if name != want:
            raise RuntimeError(
                f"the step marked stage {name!r} where fast_model.STAGES has {want!r}: "
                "the marks in FastCNN's step and the Stage table disagree"
            )
        on_stage(name)

    def done() -> None:
        left = next(expected, None)
        if left is not None:
            raise RuntimeError(f"the step ended before stage {left!r} of fast_model.STAGES")

    return mark, done


def _max_size(fn: Callable[[int], int], max_batch: int) -> int:
    """Largest scratch size any batch 1..max_batch needs (split counts vary with N)."""
    return max(fn(n) for n in range(1, max_batch + 1))


class FastCNN(CNNBase, _Layer):
    """The capstone network on the fast kernels (see the module docstring).

    Args:
        config: layer sizes (:class:`NetConfig`); num_classes <= 32, hidden <= 1024.
        max_batch: the largest batch; every buffer is allocated once for it.
        seed: seed for :func:`~final_project.model.init_params` (unless ``params``).
        params: initial state as NumPy arrays by torch name.
        graph: capture each step into a CUDA graph (default: on a GPU; the
            simulator has none). ``False`` launches every kernel from Python.
        conv1: "fused" (the default where :func:`final_project.first_conv.supported`
            allows: conv1's output never in memory, computed from the images where
            it is needed; with one input channel its statistics and weight
            gradient from the patch Gram matrix), else "direct" (default
            otherwise: a kernel for tiny input channel counts writes conv1's
            output) or "igemm".
        graph_backend: what captures and replays a step (tests pass a fake one).
        precision: "fp32" (every kernel on the CUDA cores) or "tf32": conv2's
            forward, weight gradient and input gradient on the tensor cores in TF32
            (:mod:`final_project.tf32_conv`; Hopper GPUs only), the rest FP32.

    Raises:
        ValueError: max_batch < 1, a config the fused classifier cannot hold,
            ``graph=True`` in the simulator, a bad ``params``, an unknown
            precision, or channel counts the TF32 convolution cannot take.
        RuntimeError: precision "tf32" without a Hopper GPU.
    """

    def __init__(
        self,
        config: NetConfig,
        max_batch: int,
        seed: int = 0,
        params: dict | None = None,
        graph: bool | None = None,
        conv1: str | None = None,
        graph_backend: Any = None,
        precision: str = "fp32",
    ) -> None:
        super().__init__(config, max_batch)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision == "tf32":
            reason = tf32_refusal(config)
            if reason:
                raise ValueError(f"precision 'tf32': {reason}; use precision 'fp32'")
            tf32_conv.require_tf32_convs()
        self.precision = precision
        if config.num_classes > fl.CLS_MAX_CLASSES or config.hidden > fl.CLS_MAX_HIDDEN:
            raise ValueError(
                f"FastCNN's fused classifier holds at most {fl.CLS_MAX_CLASSES} classes and "
                f"{fl.CLS_MAX_HIDDEN} hidden units, got {config.num_classes} and "
                f"{config.hidden}; use NumbaCNN for larger heads"
            )
        fused_refusal = first_conv.supported(config.in_channels, config.height, config.width)
        conv1 = conv1 or default_conv1(config)
        if conv1 not in CONV1_KINDS:
            raise ValueError(f"conv1 must be one of {CONV1_KINDS}, got {conv1!r}")
        if conv1 == "fused" and fused_refusal:
            raise ValueError(f"conv1 'fused': {fused_refusal}; use conv1 'direct'")
        if graph and is_simulator() and graph_backend is None:
            raise ValueError(
                "the simulator has no CUDA graphs: use graph=False (or leave it to the default)"
            )
        self.conv1_kind = conv1
        # one input channel: conv1's statistics and weight gradient from the
        # images' patch Gram matrix (final_project.conv1_gram)
        self.conv1_gram = uses_patch_gram(config, conv1)
        self.graph_backend = graph_backend or (
            default_graph_backend() if graph is not False else None
        )
        self._graphs: dict[tuple[int, float], Any] = {}
        self.stream = cuda.stream()
        self._alloc()
        self._views: dict[tuple[str, int], Any] = {}
        self._load_initial_state(seed, params)

    # -- buffers ---------------------------------------------------------------

    def _alloc(self) -> None:
        c, m = self.config, self.max_batch
        f32, f64 = np.float32, np.float64
        h, w = c.height, c.width
        h2, w2 = h // 2, w // 2
        h4, w4 = h // 4, w // 4
        dev = cuda.device_array
        self.x_static = dev((m, c.in_channels, h, w), f32)
        self.y_static = dev(m, np.int32)
        # forward
        # Partial-sum row counts depend on the tiles, which depend on N (small
        # grids get smaller tiles): size each buffer for the worst N.
        if self.conv1_kind != "fused":
            self.z1 = dev((m, c.c1, h, w), f32)
        if self.conv1_gram:
            rows1 = 1  # the sums come from the patch Gram matrix
        elif self.conv1_kind == "fused":
            rows1 = _max_size(lambda n: first_conv.bn_partial_rows(n, c.c1, c.in_channels, h, w), m)
        elif self.conv1_kind == "direct":
            rows1 = _max_size(lambda n: fconv.conv2d_forward_direct_partial_rows(n, h, w, c.c1), m)
        elif self.conv1_kind == "igemm":
            rows1 = _max_size(lambda n: fconv.conv2d_forward_igemm_partial_rows(n, h, w), m)
        self.bn1_partials = dev((rows1, 2, c.c1), f64)
        self.z2 = dev((m, c.c2, h2, w2), f32)
        rows2 = _max_size(lambda n: self._conv2_partial_rows(n), m)
        if self.precision == "tf32":  # channels-last copies and weight layouts
            self.pooled1_nhwc = dev((m, h2, w2, c.c1), f32)
            self.dz2_nhwc = dev((m, h2, w2, c.c2), f32)
            self.w2_forward = dev((c.c2, 3, 3, c.c1), f32)
            self.w2_grad_input = dev((c.c1, 3, 3, c.c2), f32)
        self.bn2_partials = dev((rows2, 2, c.c2), f64)
        for name, ch in (("bn1", c.c1), ("bn2", c.c2)):
            for stat in ("mean", "invstd", "scale", "shift"):
                setattr(self, f"{name}_{stat}", dev(ch, f32))
        self.pooled1 = dev((m, c.c1, h2, w2), f32)
        self.argmax1 = dev((m, c.c1, h2, w2), np.int8)
        # the window winners' conv outputs: the backward reductions read them in order
        self.zwin1 = dev((m, c.c1, h2, w2), f32)
        self.pooled2 = dev((m, c.c2, h4, w4), f32)
        self.argmax2 = dev((m, c.c2, h4, w4), np.int8)
        self.zwin2 = dev((m, c.c2, h4, w4), f32)
        feat = c.flat_features
        # fc1's split-K partials; the evaluation forward reuses them for fc2.
        self.fc1_partials = dev(
            _max_size(
                lambda n: max(
                    fl.splitk_partials_size(n, c.hidden, feat),
                    fl.splitk_partials_size(n, c.num_classes, c.hidden),
                ),
                m,
            ),
            f32,
        )
        self.hidden_act = dev((m, c.hidden), f32)
        self.logits = dev((m, c.num_classes), f32)
        self.row_loss = dev(m, f32)
        self.dlogits = dev((m, c.num_classes), f32)
        self.loss_buf = dev(1, f32)
        self.predictions = dev(m, np.int32)
        # backward
        self.d_hidden = dev((m, c.hidden), f32)
        self.fc2_grad_partials = dev(
            _max_size(lambda n: fl.splitk_partials_size(c.num_classes, c.hidden + 1, n), m), f32
        )
        self.fc1_grad_partials = dev(
            _max_size(lambda n: fl.splitk_partials_size(c.hidden, feat + 1, n), m), f32
        )
        self.d_pooled2 = dev((m, c.c2, h4, w4), f32)
        self.bn2_back_partials = dev(
            (_max_size(lambda n: fl.bn_backward_partial_rows(n, h4, w4), m), 2, c.c2), f64
        )
        self.dz2 = dev((m, c.c2, h2, w2), f32)
        if self.precision == "tf32":
            grad2_size = lambda n: tf32_conv.grad_weight_partials_size(n, c.c1, c.c2, h2, w2)  # noqa: E731
        else:
            grad2_size = lambda n: int(  # noqa: E731
                np.prod(fconv.conv2d_grad_weight_igemm_partials_shape(n, h2, w2, c.c2, c.c1, 3))
            )
        self.conv2_grad_partials = dev(_max_size(grad2_size, m), f32)
        self.d_pooled1 = dev((m, c.c1, h2, w2), f32)
        back_rows1 = lambda n: fl.bn_backward_partial_rows(n, h2, w2)  # noqa: E731
        if self.conv1_gram:
            back_rows1 = lambda n: conv1_gram.winners_partials_shape(n, c.c1, h, w)[0][0]  # noqa: E731
        self.bn1_back_partials = dev((_max_size(back_rows1, m), 2, c.c1), f64)
        if self.conv1_gram:
            self.gram_partials = dev(conv1_gram.gram_partials_shape(m), f64)
            self.gram = dev(conv1_gram.ENTRIES, f64)
            self.gram_s_sum = dev((c.c1, conv1_gram.V - 1), f32)
            self.gram_s_bias = dev(c.c1, f32)
            grad1_shape = lambda n: conv1_gram.winners_partials_shape(n, c.c1, h, w)[1]  # noqa: E731
        elif self.conv1_kind == "fused":
            grad1_shape = lambda n: first_conv.partials_shape(n, c.c1, c.in_channels, h, w)  # noqa: E731
        else:
            self.dz1 = dev((m, c.c1, h, w), f32)
            grad1_shape = lambda n: fconv.conv2d_grad_weight_igemm_partials_shape(  # noqa: E731
                n, h, w, c.c1, c.in_channels, 3
            )
        self.conv1_grad_partials = dev(_max_size(lambda n: int(np.prod(grad1_shape(n))), m), f32)

    def _conv2_partial_rows(self, n: int) -> int:
        h2, w2 = self.config.height // 2, self.config.width // 2
        if self.precision == "tf32":
            return tf32_conv.forward_partial_rows(n, h2, w2)
        return fconv.conv2d_forward_igemm_partial_rows(n, h2, w2)

    @property
    def tf32_ops(self) -> tuple[str, ...]:
        """The operations run in TF32, as the float64 reference names them
        (:data:`final_project.reference.TF32_OPS`: precision "tf32" runs them
        all); empty in FP32."""
        return TF32_OPS if self.precision == "tf32" else ()

    def _scratch(self, name: str, n: int, shape_fn: Callable[[int], tuple]) -> Any:
        key = (name, n)
        view = self._views.get(key)
        if view is None:
            shape = tuple(shape_fn(n))
            view = self._views[key] = getattr(self, name)[: int(np.prod(shape))].reshape(shape)
        return view

    # -- the step ----------------------------------------------------------------

    def _forward_features(self, n: int, training: bool, mark=_no_mark) -> Any:
        """Conv blocks and fc1 on x_static[:n]; returns fc1's ReLU output (n, hidden)."""
        c, s, p = self.config, self.stream, self.params
        x = self._rows("x_static", n)
        z2 = self._rows("z2", n)
        h, w = c.height, c.width
        if self.conv1_gram:
            rows1 = 1
            if training:  # the evaluation forward uses the running statistics
                conv1_gram.patch_gram(x, self._rows("gram_partials", n), self.gram, stream=s)
                conv1_gram.gram_bn_sums(
                    self.gram, p["conv1.weight"], p["conv1.bias"], self.bn1_partials[:1], stream=s
                )
        elif self.conv1_kind == "fused":
            rows1 = first_conv.bn_partial_rows(n, c.c1, c.in_channels, h, w)
            if training:  # the evaluation forward uses the running statistics
                first_conv.conv_bn_sums(
                    x, p["conv1.weight"], p["conv1.bias"], self.bn1_partials[:rows1], stream=s
                )
        elif self.conv1_kind == "direct":
            z1 = self._rows("z1", n)
            rows1 = fconv.conv2d_forward_direct_partial_rows(n, h, w, c.c1)
            fconv.conv2d_forward_direct(
                x, p["conv1.weight"], p["conv1.bias"], 1, z1, self.bn1_partials[:rows1], stream=s
            )
        else:
            z1 = self._rows("z1", n)
            rows1 = fconv.conv2d_forward_igemm_partial_rows(n, h, w)
            fconv.conv2d_forward_igemm(
                x, p["conv1.weight"], p["conv1.bias"], 1, z1, self.bn1_partials[:rows1], stream=s
            )
        mark(Stage.CONV1_FORWARD)
        self._bn_scale_shift("bn1", self.bn1_partials[:rows1], n * h * w, training)
        mark(Stage.BN1_STATISTICS)
        pool1 = [self._rows(k, n) for k in ("pooled1", "argmax1", "zwin1")]
        if self.conv1_kind == "fused":
            first_conv.conv_bn_relu_maxpool(
                x,
                p["conv1.weight"],
                p["conv1.bias"],
                self.bn1_scale,
                self.bn1_shift,
                *pool1,
                stream=s,
            )
        else:
            fl.bn_relu_maxpool_forward(
                z1, self.bn1_scale, self.bn1_shift, *pool1[:2], s, zwin=pool1[2]
            )
        mark(Stage.BN1_RELU_POOL1)
        rows2 = self._conv2_partial_rows(n)
        if self.precision == "tf32":
            # the weights changed at the last update: both layouts, for this
            # forward and this step's input gradient
            tf32_conv.permute_conv_weights(
                p["conv2.weight"], self.w2_forward, self.w2_grad_input, stream=s
            )
            x_nhwc = self._rows("pooled1_nhwc", n)
            tf32_conv.nchw_to_nhwc(self._rows("pooled1", n), x_nhwc, stream=s)
            tf32_conv.conv2d_forward_tf32(
                x_nhwc, self.w2_forward, p["conv2.bias"], z2, self.bn2_partials[:rows2], stream=s
            )
        else:
            fconv.conv2d_forward_igemm(
                self._rows("pooled1", n),
                p["conv2.weight"],
                p["conv2.bias"],
                1,
                z2,
                self.bn2_partials[:rows2],
                stream=s,
            )
        mark(Stage.CONV2_FORWARD)
        self._bn_scale_shift("bn2", self.bn2_partials[:rows2], n * (h // 2) * (w // 2), training)
        mark(Stage.BN2_STATISTICS)
        pooled2 = self._rows("pooled2", n)
        fl.bn_relu_maxpool_forward(
            z2,
            self.bn2_scale,
            self.bn2_shift,
            pooled2,
            self._rows("argmax2", n),
            s,
            zwin=self._rows("zwin2", n),
        )
        mark(Stage.BN2_RELU_POOL2)
        flat = pooled2.reshape((n, c.flat_features))
        hidden = self._rows("hidden_act", n)
        fl.linear_forward(
            flat, p["fc1.weight"], p["fc1.bias"], hidden, self.fc1_partials, relu=True, stream=s
        )
        mark(Stage.FC1_FORWARD)
        return hidden

    def _bn_scale_shift(self, name: str, partials: Any, count: int, training: bool) -> None:
        p, b = self.params, self.buffers
        gamma, beta = p[f"{name}.weight"], p[f"{name}.bias"]
        rm, rv = b[f"{name}.running_mean"], b[f"{name}.running_var"]
        scale, shift = getattr(self, f"{name}_scale"), getattr(self, f"{name}_shift")
        if training:
            fl.bn_stats_finalize(
                partials,
                count,
                gamma,
                beta,
                self.config.bn_eps,
                self.config.bn_momentum,
                rm,
                rv,
                getattr(self, f"{name}_mean"),
                getattr(self, f"{name}_invstd"),
                scale,
                shift,
                self.stream,
            )
        else:
            fl.bn_eval_scale_shift(
                gamma, beta, rm, rv, self.config.bn_eps, scale, shift, self.stream
            )

    def _loss_and_grads(self, n: int, mark=_no_mark) -> None:
        c, s, p, g = self.config, self.stream, self.params, self.grads
        hidden = self._forward_features(n, True, mark)
        labels = self._rows("y_static", n)
        d_hidden = self._rows("d_hidden", n)
        fl.classifier_fused(
            hidden,
            p["fc2.weight"],
            p["fc2.bias"],
            labels,
            self._rows("logits", n),
            self._rows("row_loss", n),
            self._rows("dlogits", n),
            d_hidden,
            s,
        )
        mark(Stage.FC2_LOSS_GRADS)
        fl.mean_reduce(self._rows("row_loss", n), self.loss_buf, s)
        mark(Stage.LOSS_MEAN)
        # backward
        fl.linear_grad_weight(
            self._rows("dlogits", n),
            hidden,
            g["fc2.weight"],
            g["fc2.bias"],
            self.fc2_grad_partials,
            s,
        )
        mark(Stage.FC2_GRAD_WEIGHT)
        flat = self._rows("pooled2", n).reshape((n, c.flat_features))
        fl.linear_grad_weight(
            d_hidden, flat, g["fc1.weight"], g["fc1.bias"], self.fc1_grad_partials, s
        )
        mark(Stage.FC1_GRAD_WEIGHT)
        d_pooled2 = self._rows("d_pooled2", n)
        fl.linear_grad_input(d_hidden, p["fc1.weight"], d_pooled2.reshape((n, c.flat_features)), s)
        mark(Stage.FC1_GRAD_INPUT)
        dz2 = self._bn_backward(
            "bn2",
            n,
            d_pooled2,
            self._rows("argmax2", n),
            self._rows("z2", n),
            self._rows("dz2", n),
            self.bn2_back_partials,
            mark,
            (Stage.BN2_BACKWARD_REDUCE, Stage.BN2_BACKWARD_DX),
        )
        h2, w2 = c.height // 2, c.width // 2
        if self.precision == "tf32":
            tf32_conv.conv2d_grad_weight_tf32(
                dz2,
                self._rows("pooled1", n),
                g["conv2.weight"],
                g["conv2.bias"],
                self.conv2_grad_partials,
                stream=s,
            )
        else:
            part2 = self._scratch(
                "conv2_grad_partials",
                n,
                lambda k: fconv.conv2d_grad_weight_igemm_partials_shape(k, h2, w2, c.c2, c.c1, 3),
            )
            fconv.conv2d_grad_weight_igemm(
                dz2,
                self._rows("pooled1", n),
                1,
                g["conv2.weight"],
                g["conv2.bias"],
                part2,
                stream=s,
            )
        mark(Stage.CONV2_GRAD_WEIGHT)
        d_pooled1 = self._rows("d_pooled1", n)
        if self.precision == "tf32":
            dz2_nhwc = self._rows("dz2_nhwc", n)
            tf32_conv.nchw_to_nhwc(dz2, dz2_nhwc, stream=s)
            tf32_conv.conv2d_grad_input_tf32(dz2_nhwc, self.w2_grad_input, d_pooled1, stream=s)
        else:
            fconv.conv2d_grad_input_igemm(dz2, p["conv2.weight"], 1, d_pooled1, stream=s)
        mark(Stage.CONV2_GRAD_INPUT)
        x = self._rows("x_static", n)
        stats = [getattr(self, f"bn1_{k}") for k in ("mean", "invstd")]
        affine = [getattr(self, f"bn1_{k}") for k in ("scale", "shift")]
        if self.conv1_gram:
            bn_shape, s_shape = conv1_gram.winners_partials_shape(n, c.c1, c.height, c.width)
            bn_parts = self.bn1_back_partials[: bn_shape[0]]
            s_parts = self._scratch("conv1_grad_partials", n, lambda k: s_shape)
            conv1_gram.winners_reduce(
                x, d_pooled1, self._rows("argmax1", n), self._rows("zwin1", n), *stats, *affine,
                bn_parts, s_parts, stream=s,
            )  # fmt: skip
            fl.bn_backward_finalize(bn_parts, g["bn1.weight"], g["bn1.bias"], s)
        else:
            self._bn_backward_reduce("bn1", n, d_pooled1, self.bn1_back_partials)
        mark(Stage.BN1_BACKWARD_REDUCE)
        if self.conv1_gram:
            conv1_gram.gram_grad_weight(
                self.gram, s_parts, self.gram_s_sum, self.gram_s_bias, p["conv1.weight"],
                p["conv1.bias"], stats[1], p["bn1.weight"], g["bn1.weight"], g["bn1.bias"],
                g["conv1.weight"], g["conv1.bias"], stream=s,
            )  # fmt: skip
        elif self.conv1_kind == "fused":
            part1 = self._scratch(
                "conv1_grad_partials",
                n,
                lambda k: first_conv.partials_shape(k, c.c1, c.in_channels, c.height, c.width),
            )
            first_conv.bn_backward_conv_grad_weight(
                x,
                p["conv1.weight"],
                p["conv1.bias"],
                d_pooled1,
                self._rows("argmax1", n),
                self._rows("zwin1", n),
                *stats,
                p["bn1.weight"],
                *affine,
                g["bn1.weight"],
                g["bn1.bias"],
                g["conv1.weight"],
                g["conv1.bias"],
                part1,
                stream=s,
            )
        else:  # inputs the fused kernel does not take: dz1 in memory
            dz1 = self._rows("dz1", n)
            fl.bn_relu_maxpool_backward_dx(
                d_pooled1,
                self._rows("argmax1", n),
                self._rows("z1", n),
                *stats,
                *affine,
                p["bn1.weight"],
                g["bn1.weight"],
                g["bn1.bias"],
                dz1,
                s,
            )
            part1 = self._scratch(
                "conv1_grad_partials",
                n,
                lambda k: fconv.conv2d_grad_weight_igemm_partials_shape(
                    k, c.height, c.width, c.c1, c.in_channels, 3
                ),
            )
            fconv.conv2d_grad_weight_igemm(
                dz1, x, 1, g["conv1.weight"], g["conv1.bias"], part1, stream=s
            )
        mark(Stage.CONV1_GRAD_WEIGHT)

    def _bn_backward_reduce(self, name, n, d_pooled, partials_buf) -> None:
        """dgamma and dbeta of BN -> ReLU -> pool ``name`` (into the grads)."""
        g, s = self.grads, self.stream
        stats = [getattr(self, f"{name}_{k}") for k in ("mean", "invstd", "scale", "shift")]
        _, _, ph, pw = d_pooled.shape
        partials = partials_buf[: fl.bn_backward_partial_rows(n, ph, pw)]
        zwin = self._rows(f"zwin{name[-1]}", n)
        fl.bn_relu_maxpool_backward_reduce_winners(d_pooled, zwin, *stats, partials, s)
        fl.bn_backward_finalize(partials, g[f"{name}.weight"], g[f"{name}.bias"], s)

    def _bn_backward(self, name, n, d_pooled, argmax, z, dz, partials_buf, mark, stages) -> Any:
        """The backward of BN -> ReLU -> pool ``name``: two stages, ``stages`` =
        (dgamma and dbeta, dz)."""
        p, g, s = self.params, self.grads, self.stream
        stats = [getattr(self, f"{name}_{k}") for k in ("mean", "invstd", "scale", "shift")]
        self._bn_backward_reduce(name, n, d_pooled, partials_buf)
        mark(stages[0])
        fl.bn_relu_maxpool_backward_dx(
            d_pooled,
            argmax,
            z,
            *stats,
            p[f"{name}.weight"],
            g[f"{name}.weight"],
            g[f"{name}.bias"],
            dz,
            s,
        )
        mark(stages[1])
        return dz

    def _step(self, n: int, lr: float, mark=_no_mark) -> None:
        """Forward, loss, backward and SGD on x_static[:n], y_static[:n]: launches only."""
        self._loss_and_grads(n, mark)
        naive.sgd_update_naive[
            naive._grid(self.params.flat.size)[0], naive.THREADS_PER_BLOCK, self.stream
        ](self.params.flat, self.grads.flat, lr)
        mark(Stage.SGD_UPDATE)

    # -- input staging -------------------------------------------------------------

    def _stage(self, x: Any, y: Any = None) -> int:
        """Copy a batch into the static input buffers on the model's stream; returns N.

        x, y: device arrays (or CUDA torch tensors), or host NumPy arrays (pinned
        memory makes the copy asynchronous), shaped and typed as
        :meth:`~final_project.model.CNNBase.validate_batch` requires.
        """
        x, y = self.validate_batch(x, y, allow_host=True)
        n = x.shape[0]
        x_static, y_static = self.static_batch(n)
        if x is not x_static:
            x_static.copy_to_device(x, stream=self.stream)
        if y is not None and y is not y_static:
            y_static.copy_to_device(y, stream=self.stream)
        return n

    def static_batch(self, n: int) -> tuple[Any, Any]:
        """(x, y): the static input buffers a step of ``n`` images reads, device
        arrays (n, C, H, W) float32 and (n,) int32. A batch written there (say
        ``x.copy_to_device(host_x, stream=model.stream)``) and passed back as
        these same arrays is not copied again by :meth:`train_step`, as a CUDA
        graph's static inputs are filled once and reused."""
        return self._rows("x_static", n), self._rows("y_static", n)

    # -- public ----------------------------------------------------------------------

    def train_step(
        self, x: Any, y: Any, lr: float, *, on_stage: Callable[[str], None] | None = None
    ) -> None:
        """One plain-SGD step on (x, y), as :meth:`NumbaCNN.train_step`; only
        queues work on :attr:`stream` (no host synchronisation).

        With graphs on, the first step at each (batch size, lr) runs eagerly and
        is then captured; later steps replay the graph.

        on_stage: called as ``on_stage(name)`` right after the launches of each
            stage are queued, once per name of :data:`STAGES`, in that order (to
            record a CUDA event or close a profiler range there). The step then
            launches every kernel from the host: it neither replays nor captures
            a graph (a replay has no host code between its kernels). The batch
            is copied into the static buffers before the first stage, unless x
            and y are those buffers (:meth:`static_batch`).

        Raises:
            ValueError: a batch of the wrong shape, dtype or layout.
            RuntimeError: the step's marks disagree with :data:`STAGES` (with
                ``on_stage`` only).
        """
        n = self._stage(x, y)
        lr = float(lr)
        self.num_batches_tracked += 1
        if on_stage is not None:
            mark, done = _in_order(on_stage)
            self._step(n, lr, mark)
            done()
            return
        if self.graph_backend is None:
            self._step(n, lr)
            return
        key = (n, lr)
        graph = self._graphs.get(key)
        if graph is None:
            self._step(n, lr)  # compiles and warms every kernel at this shape
            self._graphs[key] = self.graph_backend.capture(self.stream, lambda: self._step(n, lr))
        else:
            graph.launch(self.stream)

    @property
    def graphs(self) -> dict[tuple[int, float], Any]:
        """The captured step graphs by (batch size, lr)."""
        return self._graphs

    def loss_and_grads(self, x: Any, y: Any) -> None:
        """Training-mode forward, loss and backward (no update), launched eagerly."""
        n = self._stage(x, y)
        self.num_batches_tracked += 1
        self._loss_and_grads(n)

    def pool_windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`NumbaCNN.pool_windows`: the fused kernels keep the window
        position (0..3, row-major) of each maximum already."""
        self.synchronize()
        return (self._rows("argmax1", n).copy_to_host(), self._rows("argmax2", n).copy_to_host())

    def relu_open(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whether each ReLU was on in the last forward pass (batch ``n``), where
        its decision reaches the gradient: at each max-pool's taken element (the
        pooled output > 0; (n, C, H/2, W/2) and (n, C2, H/4, W/4)) and at each fc1
        unit ((n, hidden)); bool host arrays, for a float64 twin that follows them
        (:func:`final_project.checks.check_train_step`)."""
        self.synchronize()
        return tuple(
            self._rows(name, n).copy_to_host() > 0 for name in ("pooled1", "pooled2", "hidden_act")
        )

    def forward(self, x: Any, training: bool = False) -> Any:
        """Logits (N, num_classes) device array (a view of an internal buffer).

        training=False uses the running statistics; True the batch's, updating
        the running statistics.
        """
        n = self._stage(x)
        if training:
            self.num_batches_tracked += 1
        hidden = self._forward_features(n, training)
        logits = self._rows("logits", n)
        p = self.params
        fl.linear_forward(
            hidden,
            p["fc2.weight"],
            p["fc2.bias"],
            logits,
            self.fc1_partials,
            relu=False,
            stream=self.stream,
        )
        return logits

    def predict(self, x: Any) -> Any:
        """Predicted classes (N,) int32 device array (evaluation mode)."""
        logits = self.forward(x, training=False)
        out = self._rows("predictions", logits.shape[0])
        naive.argmax_rows_naive[naive._grid(out.size)[0], naive.THREADS_PER_BLOCK, self.stream](
            logits, out
        )
        return out

    @property
    def loss(self) -> Any:
        """Device float32 array (1,): the mean NLL of the last training step's batch."""
        return self.loss_buf

    def synchronize(self) -> None:
        """Wait for everything queued on the model's stream."""
        self.stream.synchronize()


__all__ = ["FastCNN", "PRECISIONS", "STAGES", "Stage", "TF32_OPS", "CudaGraphBackend"]

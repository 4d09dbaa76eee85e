"""The capstone CNN on the GPU: layers made of our own kernels, trained with plain SGD.

    conv 3x3 pad 1 (C -> c1) -> batchnorm -> ReLU -> max-pool 2x2
    -> conv 3x3 pad 1 (c1 -> c2) -> batchnorm -> ReLU -> max-pool 2x2
    -> flatten (c2 * H/4 * W/4, NCHW order) -> linear -> ReLU -> linear (num_classes)
    -> log-softmax + NLL (mean over the batch)

Each layer is a small class, micrograd style: ``forward`` launches the forward
kernels and remembers what the backward pass needs; ``backward`` launches the
gradient kernels and returns the gradient with respect to its input. Every
array (parameters, gradients, activations, saved tensors) is allocated once on
the device for ``max_batch`` images; a batch of N <= max_batch uses the first N
rows (cached views), so a training step only launches kernels: no allocation,
no host copy, no synchronisation.

All parameters live in one flat float32 device buffer (and all gradients in
another, same layout), each parameter a reshaped view of its slice, so the SGD
update is one launch over every parameter.

Usage::

    model = NumbaCNN(NetConfig(), max_batch=64, seed=0)
    model.train_step(x_dev, y_dev, lr=0.05)     # x (N, 1, 28, 28) f32, y (N,) int32
    print(model.loss.copy_to_host()[0])
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)
from common.checking import require_device_array

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from final_project import kernels


@dataclass(frozen=True)
class NetConfig:
    """Sizes of the network. Height and width must be divisible by 4 (two 2x2 pools)."""

    in_channels: int = 1
    height: int = 28
    width: int = 28
    c1: int = 32
    c2: int = 64
    hidden: int = 128
    num_classes: int = 10
    bn_eps: float = 1e-5
    bn_momentum: float = 0.1

    def __post_init__(self) -> None:
        for name in ("in_channels", "height", "width", "c1", "c2", "hidden", "num_classes"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"NetConfig.{name} must be a positive int, got {v!r}")
        if self.height % 4 or self.width % 4:
            raise ValueError(
                f"NetConfig height and width must be divisible by 4 (two 2x2 max-pools), "
                f"got {self.height}x{self.width}; pad or crop the images"
            )
        if self.num_classes < 2:
            raise ValueError(f"NetConfig.num_classes must be >= 2, got {self.num_classes}")

    @property
    def flat_features(self) -> int:
        """fc1's input size: c2 * (H/4) * (W/4)."""
        return self.c2 * (self.height // 4) * (self.width // 4)


PARAM_NAMES = (
    "conv1.weight",
    "conv1.bias",
    "bn1.weight",
    "bn1.bias",
    "conv2.weight",
    "conv2.bias",
    "bn2.weight",
    "bn2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
)
BUFFER_NAMES = ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var")
# torch's BatchNorm2d also keeps a step counter; we keep it (on the host) so
# state dicts load into the twin with strict=True.
COUNTER_NAMES = ("bn1.num_batches_tracked", "bn2.num_batches_tracked")


def param_shapes(config: NetConfig) -> dict[str, tuple[int, ...]]:
    """Torch shapes of every parameter and buffer: conv OIHW, linear (out, in)."""
    c = config
    return {
        "conv1.weight": (c.c1, c.in_channels, 3, 3),
        "conv1.bias": (c.c1,),
        "bn1.weight": (c.c1,),
        "bn1.bias": (c.c1,),
        "conv2.weight": (c.c2, c.c1, 3, 3),
        "conv2.bias": (c.c2,),
        "bn2.weight": (c.c2,),
        "bn2.bias": (c.c2,),
        "fc1.weight": (c.hidden, c.flat_features),
        "fc1.bias": (c.hidden,),
        "fc2.weight": (c.num_classes, c.hidden),
        "fc2.bias": (c.num_classes,),
        "bn1.running_mean": (c.c1,),
        "bn1.running_var": (c.c1,),
        "bn2.running_mean": (c.c2,),
        "bn2.running_var": (c.c2,),
    }


def init_params(config: NetConfig, seed: int) -> dict[str, np.ndarray]:
    """PyTorch's default initialisation, drawn from ``np.random.default_rng(seed)``.

    Conv and linear weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    (``kaiming_uniform_(a=sqrt(5))`` gives exactly this bound for the weights;
    torch.nn.Linear / Conv2d ``reset_parameters`` uses it for the biases);
    fan_in = in_channels * K * K for conv, in_features for linear. Batchnorm
    weight 1, bias 0; running mean 0, running var 1. Drawn in PARAM_NAMES order.

    Returns:
        PARAM_NAMES and BUFFER_NAMES -> float32 NumPy arrays in torch shapes.
    """
    rng = np.random.default_rng(seed)
    shapes = param_shapes(config)
    out: dict[str, np.ndarray] = {}
    for name in PARAM_NAMES:
        layer, kind = name.split(".")
        shape = shapes[name]
        if layer.startswith("bn"):
            value = np.ones(shape) if kind == "weight" else np.zeros(shape)
        else:
            w_shape = shapes[f"{layer}.weight"]
            fan_in = int(np.prod(w_shape[1:]))
            bound = 1.0 / math.sqrt(fan_in)
            value = rng.uniform(-bound, bound, shape)
        out[name] = value.astype(np.float32)
    for name in BUFFER_NAMES:
        out[name] = (np.zeros if name.endswith("mean") else np.ones)(shapes[name], np.float32)
    return out


class _FlatStore:
    """Named float32 device arrays that are views into one flat device buffer."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = dict(shapes)
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, shape in self.shapes.items():
            size = int(np.prod(shape))
            self.offsets[name] = (total, total + size)
            total += size
        self.flat = cuda.device_array(total, dtype=np.float32)
        self.views = {
            name: self.flat[a:b].reshape(self.shapes[name]) for name, (a, b) in self.offsets.items()
        }

    def __getitem__(self, name: str) -> Any:
        return self.views[name]

    def upload(self, values: dict[str, np.ndarray]) -> None:
        host = np.empty(self.flat.size, dtype=np.float32)
        for name, (a, b) in self.offsets.items():
            host[a:b] = np.asarray(values[name], dtype=np.float32).ravel()
        self.flat.copy_to_device(host)

    def download(self) -> dict[str, np.ndarray]:
        host = self.flat.copy_to_host()
        return {
            name: host[a:b].reshape(self.shapes[name]).copy()
            for name, (a, b) in self.offsets.items()
        }


class _Layer:
    """Device buffers sized for max_batch, sliced to the current batch (views cached)."""

    def _rows(self, buffer_name: str, n: int) -> Any:
        key = (buffer_name, n)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = getattr(self, buffer_name)[:n]
        return view


# ---------------------------------------------------------------------------
# Layers: a forward, a backward, and the few lines that launch the kernels
# ---------------------------------------------------------------------------


class Conv2d(_Layer):
    """3x3 convolution, stride 1, pad 1: (N, Ci, H, W) -> (N, Co, H, W)."""

    def __init__(self, name, params, grads, max_batch, in_shape, need_dx, pad=1):
        self._views = {}
        self.w, self.b = params[f"{name}.weight"], params[f"{name}.bias"]
        self.dw, self.db = grads[f"{name}.weight"], grads[f"{name}.bias"]
        self.pad = pad
        c_in, h, w = in_shape
        k = self.w.shape[2]
        self.out_shape = (self.w.shape[0], h + 2 * pad - k + 1, w + 2 * pad - k + 1)
        self.out = cuda.device_array((max_batch, *self.out_shape), np.float32)
        self.dx = cuda.device_array((max_batch, *in_shape), np.float32) if need_dx else None

    def forward(self, x):
        self.x = x
        out = self._rows("out", x.shape[0])
        kernels.conv2d_forward(x, self.w, self.b, self.pad, out)
        return out

    def backward(self, dout):
        kernels.conv2d_grad_weight(dout, self.x, self.pad, self.dw)
        kernels.conv2d_grad_bias(dout, self.db)
        if self.dx is None:
            return None
        dx = self._rows("dx", dout.shape[0])
        kernels.conv2d_grad_input(dout, self.w, self.pad, dx)
        return dx


class BatchNorm2d(_Layer):
    """Per-channel batchnorm: batch statistics in training (updating the running
    statistics), running statistics in evaluation; as torch.nn.BatchNorm2d."""

    def __init__(self, name, params, grads, buffers, max_batch, shape, eps, momentum):
        self._views = {}
        self.gamma, self.beta = params[f"{name}.weight"], params[f"{name}.bias"]
        self.dgamma, self.dbeta = grads[f"{name}.weight"], grads[f"{name}.bias"]
        self.running_mean = buffers[f"{name}.running_mean"]
        self.running_var = buffers[f"{name}.running_var"]
        self.eps, self.momentum = eps, momentum
        c = shape[0]
        self.mean = cuda.device_array(c, np.float32)
        self.invstd = cuda.device_array(c, np.float32)
        self.xhat = cuda.device_array((max_batch, *shape), np.float32)
        self.out = cuda.device_array((max_batch, *shape), np.float32)
        self.dx = cuda.device_array((max_batch, *shape), np.float32)

    def forward(self, x, training):
        n = x.shape[0]
        out = self._rows("out", n)
        if training:
            kernels.batchnorm_forward_train(
                x,
                self.gamma,
                self.beta,
                self.eps,
                self.momentum,
                self.mean,
                self.invstd,
                self.running_mean,
                self.running_var,
                self._rows("xhat", n),
                out,
            )
        else:
            kernels.batchnorm_forward_eval(
                x, self.gamma, self.beta, self.running_mean, self.running_var, self.eps, out
            )
        return out

    def backward(self, dout):
        n = dout.shape[0]
        dx = self._rows("dx", n)
        kernels.batchnorm_backward(
            dout, self._rows("xhat", n), self.gamma, self.invstd, self.dgamma, self.dbeta, dx
        )
        return dx


class ReLU(_Layer):
    def __init__(self, max_batch, shape):
        self._views = {}
        self.out = cuda.device_array((max_batch, *shape), np.float32)
        self.dx = cuda.device_array((max_batch, *shape), np.float32)

    def forward(self, x):
        self.x = x
        out = self._rows("out", x.shape[0])
        kernels.relu_forward(x, out)
        return out

    def backward(self, dout):
        dx = self._rows("dx", dout.shape[0])
        kernels.relu_backward(dout, self.x, dx)
        return dx


class MaxPool2x2(_Layer):
    def __init__(self, max_batch, in_shape):
        self._views = {}
        c, h, w = in_shape
        self.out = cuda.device_array((max_batch, c, h // 2, w // 2), np.float32)
        self.argmax = cuda.device_array((max_batch, c, h // 2, w // 2), np.int32)
        self.dx = cuda.device_array((max_batch, *in_shape), np.float32)

    def forward(self, x):
        n = x.shape[0]
        out = self._rows("out", n)
        kernels.maxpool2x2_forward(x, out, self._rows("argmax", n))
        return out

    def backward(self, dout):
        n = dout.shape[0]
        dx = self._rows("dx", n)
        kernels.maxpool2x2_backward(dout, self._rows("argmax", n), dx)
        return dx


class Linear(_Layer):
    """y = x W^T + b: (N, I) -> (N, O), W (O, I) as torch.nn.Linear."""

    def __init__(self, name, params, grads, max_batch):
        self._views = {}
        self.w, self.b = params[f"{name}.weight"], params[f"{name}.bias"]
        self.dw, self.db = grads[f"{name}.weight"], grads[f"{name}.bias"]
        n_out, n_in = self.w.shape
        self.out = cuda.device_array((max_batch, n_out), np.float32)
        self.dx = cuda.device_array((max_batch, n_in), np.float32)

    def forward(self, x):
        self.x = x
        out = self._rows("out", x.shape[0])
        kernels.linear_forward(x, self.w, self.b, out)
        return out

    def backward(self, dout):
        dx = self._rows("dx", dout.shape[0])
        kernels.linear_backward(dout, self.x, self.w, dx, self.dw, self.db)
        return dx


class LogSoftmaxNLL(_Layer):
    """Mean cross-entropy of logits (N, C) against int32 labels (N,)."""

    def __init__(self, max_batch, num_classes):
        self._views = {}
        self.logprobs = cuda.device_array((max_batch, num_classes), np.float32)
        self.row_loss = cuda.device_array(max_batch, np.float32)
        self.loss = cuda.device_array(1, np.float32)
        self.dlogits = cuda.device_array((max_batch, num_classes), np.float32)

    def forward(self, logits, labels):
        self.labels = labels
        n = logits.shape[0]
        kernels.log_softmax_nll_forward(
            logits, labels, self._rows("logprobs", n), self._rows("row_loss", n), self.loss
        )
        return self.loss

    def backward(self):
        n = self.labels.shape[0]
        d = self._rows("dlogits", n)
        kernels.log_softmax_nll_backward(self._rows("logprobs", n), self.labels, d)
        return d


# ---------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------


def _is_c_contiguous(a: Any) -> bool:
    """Row-major with no gaps, ignoring the strides of length-1 axes.

    NumPy ignores them too (``images[:, None]`` is contiguous to NumPy, with a
    stride of 0 on the new axis); Numba's device arrays on a GPU do not, so
    their own ``is_c_contiguous()`` would refuse such a batch.
    """
    expected = a.dtype.itemsize
    for dim, stride in zip(reversed(a.shape), reversed(a.strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


class CNNBase:
    """What every implementation of the capstone network shares: the parameters,
    gradients and running statistics (flat device buffers, torch names and
    shapes), state dicts, and the checks on a batch. Subclasses add the layers.

    Args:
        config: layer sizes (:class:`NetConfig`).
        max_batch: the largest batch ``train_step``/``forward`` will see; every
            device buffer is allocated once for it.

    Raises:
        ValueError: max_batch < 1.
    """

    def __init__(self, config: NetConfig, max_batch: int) -> None:
        if not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        self.config = config
        self.max_batch = int(max_batch)
        shapes = param_shapes(config)
        self.params = _FlatStore({k: shapes[k] for k in PARAM_NAMES})
        self.grads = _FlatStore({k: shapes[k] for k in PARAM_NAMES})
        self.buffers = _FlatStore({k: shapes[k] for k in BUFFER_NAMES})
        self.num_batches_tracked = 0

    def _load_initial_state(self, seed: int, params: dict | None) -> None:
        state = params if params is not None else init_params(self.config, seed)
        self.load_state_dict(state, strict_buffers=False)

    # -- state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and buffers copied to the host: torch names, torch shapes,
        float32 (num_batches_tracked: int64 scalars, as torch)."""
        state = {**self.params.download(), **self.buffers.download()}
        for name in COUNTER_NAMES:
            state[name] = np.array(self.num_batches_tracked, dtype=np.int64)
        return {k: state[k] for k in (*PARAM_NAMES, *BUFFER_NAMES, *COUNTER_NAMES)}

    def load_state_dict(self, state: dict[str, np.ndarray], strict_buffers: bool = True) -> None:
        """Copy ``state`` (NumPy arrays by torch name) into the device buffers.

        Every name of PARAM_NAMES (and BUFFER_NAMES unless ``strict_buffers`` is
        False, when missing buffers take torch's initial values) must be present
        with its torch shape and a floating dtype; num_batches_tracked is optional.

        Raises:
            ValueError: a missing or unknown name, a wrong shape, a non-float dtype,
                or a non-finite value.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict of NumPy arrays, got {type(state).__name__}")
        shapes = param_shapes(self.config)
        known = set(PARAM_NAMES) | set(BUFFER_NAMES) | set(COUNTER_NAMES)
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"unknown names in state dict: {unknown}; expected {sorted(known)}")
        required = list(PARAM_NAMES) + (list(BUFFER_NAMES) if strict_buffers else [])
        missing = [k for k in required if k not in state]
        if missing:
            raise ValueError(f"state dict is missing {missing}")
        values = {}
        for name in (*PARAM_NAMES, *BUFFER_NAMES):
            if name not in state:
                values[name] = (np.zeros if name.endswith("mean") else np.ones)(shapes[name])
                continue
            a = np.asarray(state[name])
            if a.shape != shapes[name]:
                raise ValueError(
                    f"{name}: shape {a.shape}, expected {shapes[name]} for {self.config}"
                )
            if a.dtype.kind != "f":
                raise ValueError(f"{name}: dtype {a.dtype}, expected a float dtype (float32)")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{name}: holds NaN or inf")
            values[name] = a
        self.params.upload(values)
        self.buffers.upload(values)
        if COUNTER_NAMES[0] in state:
            self.num_batches_tracked = int(np.asarray(state[COUNTER_NAMES[0]]))

    # -- checks --------------------------------------------------------------

    def validate_batch(self, x: Any, y: Any = None, allow_host: bool = False) -> tuple[Any, Any]:
        """Check a batch's shapes, dtypes and layout (no host copy); return device arrays.

        x: float32 (N, C, H, W) C-contiguous device array, 1 <= N <= max_batch;
        y: int32 (N,) device array, or None (forward only). CUDA torch tensors are
        accepted (viewed, not copied). Label values are checked on the device:
        a label outside [0, num_classes) makes the loss NaN. With ``allow_host``
        NumPy arrays pass too (checked the same way, returned as they are).

        Raises:
            TypeError: a host array (unless allowed) or anything not on the GPU
                (:func:`common.checking.require_device_array`).
            ValueError: wrong dtype, shape, batch size or layout, each with
                what to do instead.
        """

        def as_array(a: Any, name: str) -> Any:
            return a if allow_host and isinstance(a, np.ndarray) else require_device_array(a, name)

        c = self.config
        x = as_array(x, "x")
        want = (c.in_channels, c.height, c.width)
        if len(x.shape) != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(
                f"x has shape {tuple(x.shape)}, expected (N, {want[0]}, {want[1]}, "
                f"{want[2]}) (NCHW; add a channel axis with x[:, None])"
            )
        n = x.shape[0]
        if not 1 <= n <= self.max_batch:
            raise ValueError(
                f"batch size N={n} must be between 1 and max_batch="
                f"{self.max_batch} (make the model with a larger max_batch)"
            )
        if x.dtype != np.float32:
            raise ValueError(f"x has dtype {x.dtype}, expected float32 (x.astype(np.float32))")
        if not _is_c_contiguous(x):
            raise ValueError(
                "x is not C-contiguous; copy it with np.ascontiguousarray before cuda.to_device"
            )
        if y is None:
            return x, None
        y = as_array(y, "y")
        if tuple(y.shape) != (n,):
            raise ValueError(f"y has shape {tuple(y.shape)}, expected ({n},): one label per image")
        if y.dtype != np.int32:
            raise ValueError(f"y has dtype {y.dtype}, expected int32 (y.astype(np.int32))")
        if not _is_c_contiguous(y):
            raise ValueError("y is not contiguous; copy it with np.ascontiguousarray")
        return x, y


class NumbaCNN(CNNBase):
    """The capstone network, trained with our own kernels (the naive versions:
    one thread per output element; :class:`final_project.fast_model.FastCNN` is
    the fast one).

    Args:
        config: layer sizes (:class:`NetConfig`).
        max_batch: the largest batch ``train_step``/``forward`` will see; every
            device buffer is allocated once for it.
        seed: seed for :func:`init_params` (ignored when ``params`` is given).
        params: initial state (PARAM_NAMES, optionally BUFFER_NAMES) as NumPy
            arrays in torch shapes; validated like :meth:`load_state_dict`.

    Raises:
        ValueError: max_batch < 1, or ``params`` has wrong names, shapes or dtypes.
    """

    def __init__(
        self, config: NetConfig, max_batch: int, seed: int = 0, params: dict | None = None
    ) -> None:
        super().__init__(config, max_batch)
        c, h, w = config.in_channels, config.height, config.width
        p, g, b, m = self.params, self.grads, self.buffers, self.max_batch
        eps, mom = config.bn_eps, config.bn_momentum
        self.conv1 = Conv2d("conv1", p, g, m, (c, h, w), need_dx=False)
        self.bn1 = BatchNorm2d("bn1", p, g, b, m, (config.c1, h, w), eps, mom)
        self.relu1 = ReLU(m, (config.c1, h, w))
        self.pool1 = MaxPool2x2(m, (config.c1, h, w))
        h2, w2 = h // 2, w // 2
        self.conv2 = Conv2d("conv2", p, g, m, (config.c1, h2, w2), need_dx=True)
        self.bn2 = BatchNorm2d("bn2", p, g, b, m, (config.c2, h2, w2), eps, mom)
        self.relu2 = ReLU(m, (config.c2, h2, w2))
        self.pool2 = MaxPool2x2(m, (config.c2, h2, w2))
        self.fc1 = Linear("fc1", p, g, m)
        self.relu3 = ReLU(m, (config.hidden,))
        self.fc2 = Linear("fc2", p, g, m)
        self.criterion = LogSoftmaxNLL(m, config.num_classes)
        self._predictions = cuda.device_array(m, np.int32)

        self._load_initial_state(seed, params)

    # -- forward, backward, step ---------------------------------------------

    def _forward(self, x, training: bool):
        h = self.conv1.forward(x)
        h = self.bn1.forward(h, training)
        h = self.relu1.forward(h)
        h = self.pool1.forward(h)
        h = self.conv2.forward(h)
        h = self.bn2.forward(h, training)
        h = self.relu2.forward(h)
        h = self.pool2.forward(h)
        self._pooled_shape = h.shape
        h = h.reshape((h.shape[0], self.config.flat_features))  # NCHW flatten: a view
        h = self.fc1.forward(h)
        h = self.relu3.forward(h)
        return self.fc2.forward(h)

    def _backward(self):
        d = self.criterion.backward()
        d = self.fc2.backward(d)
        d = self.relu3.backward(d)
        d = self.fc1.backward(d)
        d = d.reshape(self._pooled_shape)
        d = self.pool2.backward(d)
        d = self.relu2.backward(d)
        d = self.bn2.backward(d)
        d = self.conv2.backward(d)
        d = self.pool1.backward(d)
        d = self.relu1.backward(d)
        d = self.bn1.backward(d)
        self.conv1.backward(d)

    def forward(self, x: Any, training: bool = False) -> Any:
        """Logits (N, num_classes) float32 device array (a view of an internal
        buffer, overwritten by the next call) for x (N, C, H, W).

        training=False: batchnorm uses the running statistics, nothing changes.
        training=True: batch statistics, and the running statistics are updated.
        """
        x, _ = self.validate_batch(x)
        if training:
            self.num_batches_tracked += 1
        return self._forward(x, training)

    def predict(self, x: Any) -> Any:
        """Predicted classes (N,) int32 device array (evaluation mode)."""
        logits = self.forward(x, training=False)
        out = self._predictions[: logits.shape[0]]
        kernels.argmax_rows(logits, out)
        return out

    def pool_windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each 2x2 max-pool of the last forward pass (batch ``n``) took its
        maximum: two int8 host arrays (n, C, H/2, W/2) of window positions 0..3
        (row-major), for checking against a float64 twin that follows them."""
        out = []
        for pool in (self.pool1, self.pool2):
            flat = pool.argmax[:n].copy_to_host().astype(np.int64)
            _, _, h, w = pool.dx.shape
            out.append((((flat // w) % h % 2) * 2 + flat % w % 2).astype(np.int8))
        return out[0], out[1]

    def loss_and_grads(self, x: Any, y: Any) -> None:
        """Training-mode forward, loss and backward, without the update: fills
        ``self.loss`` and ``self.grads`` (by parameter name). Updates running stats."""
        x, y = self.validate_batch(x, y)
        self.num_batches_tracked += 1
        logits = self._forward(x, training=True)
        self.criterion.forward(logits, y)
        self._backward()

    def train_step(self, x: Any, y: Any, lr: float) -> None:
        """One plain-SGD step on the batch (x, y): forward with batch statistics
        (running statistics updated), mean NLL loss, backward, p -= lr * grad.

        x: float32 (N, C, H, W) C-contiguous device array; y: int32 (N,) device
        array; 1 <= N <= max_batch. Only launches kernels (no host sync or copy);
        read the loss afterwards from :attr:`loss`.

        Raises:
            ValueError: see :meth:`validate_batch`.
        """
        self.loss_and_grads(x, y)
        kernels.sgd_update(self.params.flat, self.grads.flat, float(lr))

    @property
    def loss(self) -> Any:
        """Device float32 array (1,): the mean NLL of the last train_step's batch."""
        return self.criterion.loss

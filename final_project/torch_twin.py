"""The same network in PyTorch: the twin we check against and race.

Layer names match :mod:`final_project.model` (conv1, bn1, conv2, bn2, fc1, fc2),
so ``state_dict()`` keys are identical and weights move both ways. Usage::

    twin = TorchCNN.from_state_dict(config, model.state_dict(), device="cuda")
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    loss = torch_train_step(twin, opt, x, y)
"""

import common  # noqa: F401, I001  (first: picks GPU or simulator before numba loads)
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from final_project.model import NetConfig


def pool_at(x: torch.Tensor, windows: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """2x2 pooling that takes, in each window, the element at ``windows`` (0..3,
    row-major) instead of the maximum; returns (pooled, gap), gap = window max -
    taken value (0 where the choice is the maximum).

    Why: where two values of a window are within float32 rounding of each other, a
    float32 model and this float64 twin may pick different maxima; the gradient
    then flows to a different pixel and a batch-wide sum (a batchnorm or conv weight
    gradient) differs by ~1e-3 for one near-tie. Following the model's choices,
    and checking each choice is a maximum up to rounding (``gap``), compares the
    rest of the step exactly.
    """
    n, c, h, w = x.shape
    x = x[:, :, : h // 2 * 2, : w // 2 * 2]  # floor, as max_pool2d
    win = x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(
        n, c, h // 2, w // 2, 4)
    idx = torch.as_tensor(np.asarray(windows), dtype=torch.int64).unsqueeze(-1)
    taken = win.gather(-1, idx).squeeze(-1)
    return taken, win.detach().amax(-1) - taken.detach()


def _pool(x: torch.Tensor, windows: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (F.max_pool2d(x, 2), None) if windows is None else pool_at(x, windows)


class TorchCNN(nn.Module):
    """conv-bn-relu-pool x2, flatten, fc-relu-fc; returns logits (N, num_classes)."""

    def __init__(self, config: NetConfig) -> None:
        super().__init__()
        c = config
        self.config = config
        self.conv1 = nn.Conv2d(c.in_channels, c.c1, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c.c1, eps=c.bn_eps, momentum=c.bn_momentum)
        self.conv2 = nn.Conv2d(c.c1, c.c2, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c.c2, eps=c.bn_eps, momentum=c.bn_momentum)
        self.fc1 = nn.Linear(c.flat_features, c.hidden)
        self.fc2 = nn.Linear(c.hidden, c.num_classes)

    def forward(self, x: torch.Tensor, pool_windows: tuple[Any, Any] | None = None
                ) -> torch.Tensor:
        """Logits. ``pool_windows``: optional (pool1, pool2) window positions
        (int, (N, C, H/2, W/2), 0..3 row-major in each 2x2 window), e.g. a NumbaCNN's
        ``pool_windows(n)``: each max-pool then takes that element of its window
        instead of its own maximum (see :func:`pool_at`)."""
        w1, w2 = pool_windows if pool_windows is not None else (None, None)
        x, gap1 = _pool(F.relu(self.bn1(self.conv1(x))), w1)
        x, gap2 = _pool(F.relu(self.bn2(self.conv2(x))), w2)
        self.pool_gaps = (gap1, gap2)  # how far each followed choice is below its max
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)

    @classmethod
    def from_state_dict(cls, config: NetConfig, state: dict[str, Any], device: Any = "cpu",
                        dtype: torch.dtype = torch.float32) -> "TorchCNN":
        """A twin holding ``state`` (NumPy arrays by torch name, e.g.
        ``NumbaCNN.state_dict()`` or ``init_params``) on ``device`` in ``dtype``.
        Missing buffers keep torch's initial values; a wrong name or shape raises
        RuntimeError (from torch's load_state_dict)."""
        model = cls(config)
        tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        params = {name for name, _ in model.named_parameters()}
        if unexpected or params & set(missing):
            raise RuntimeError(f"state does not fit TorchCNN: missing {sorted(missing)}, "
                               f"unexpected {sorted(unexpected)}")
        return model.to(device=device, dtype=dtype)


def torch_train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                     x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """zero_grad, forward (train mode), cross-entropy (mean), backward, optimizer step.

    x (N, C, H, W) float, y (N,) integer labels, on the model's device. Returns
    the loss before the step as a detached 0-d tensor (no host sync).
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y.long())
    loss.backward()
    optimizer.step()
    return loss.detach()

"""The same network in PyTorch: the twin we race (``final_project.compare``).

It is not a ground truth for our kernels (that is :mod:`final_project.reference`,
which the tests check against this twin's float64 training step).

Layer names match :mod:`final_project.model` (conv1, bn1, conv2, bn2, fc1, fc2),
so ``state_dict()`` keys are identical and weights move both ways. Usage::

    twin = TorchCNN.from_state_dict(config, model.state_dict(), device="cuda")
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    loss = torch_train_step(twin, opt, x, y)
    loss = torch_train_step(twin, opt, x, y, autocast=torch.bfloat16)  # mixed precision
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

import contextlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from final_project.model import NetConfig


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, num_classes) for x (N, C, H, W)."""
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)

    @classmethod
    def from_state_dict(
        cls,
        config: NetConfig,
        state: dict[str, Any],
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "TorchCNN":
        """A twin holding ``state`` (NumPy arrays by torch name, e.g.
        ``NumbaCNN.state_dict()`` or ``init_params``) on ``device`` in ``dtype``.
        Missing buffers keep torch's initial values; a wrong name or shape raises
        RuntimeError (from torch's load_state_dict)."""
        model = cls(config)
        tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        params = {name for name, _ in model.named_parameters()}
        if unexpected or params & set(missing):
            raise RuntimeError(
                f"state does not fit TorchCNN: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        return model.to(device=device, dtype=dtype)


# The autocast dtypes the step takes: bfloat16 keeps float32's 8-bit exponent, so
# small gradients do not underflow and no loss scaling (GradScaler) is needed.
AUTOCAST_DTYPES = (torch.bfloat16,)


def forward_autocast(
    device_type: str, dtype: torch.dtype | None, cache_enabled: bool = True
) -> contextlib.AbstractContextManager:
    """The region the forward and the loss run in: ``torch.autocast(device_type,
    dtype=dtype, cache_enabled=cache_enabled)``, or a null context for ``dtype`` None.

    Inside it autocast runs the convolutions and matmuls (conv2d, linear) in
    ``dtype`` with float32 accumulation and the cross-entropy in float32; the
    weights stay float32 and so do their gradients. The method is PyTorch's
    "Automatic Mixed Precision" recipe (the ``torch.autocast`` and
    ``torch.amp`` docs): autocast around the forward and the loss only.

    Raises:
        ValueError: ``dtype`` is neither None nor one of AUTOCAST_DTYPES (float16
            would need a GradScaler against gradient underflow, which the step
            does not have).
    """
    if dtype is None:
        return contextlib.nullcontext()
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast dtype must be None or torch.bfloat16, got {dtype}: float16 would "
            "need loss scaling (torch.amp.GradScaler), which this step does not do"
        )
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled)


def torch_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """zero_grad, forward (train mode), cross-entropy (mean), backward, optimizer step.

    x (N, C, H, W) float, y (N,) integer labels, on the model's device.
    ``autocast`` (None or torch.bfloat16): the forward and the loss run under
    :func:`forward_autocast`; the backward and the update outside it, as
    PyTorch's AMP recipe says. Returns the loss before the step as a detached
    0-d tensor (no host sync), float32 under autocast.

    Raises:
        ValueError: another ``autocast`` dtype (see :func:`forward_autocast`).
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with forward_autocast(x.device.type, autocast):
        loss = F.cross_entropy(model(x), y.long())
    loss.backward()
    optimizer.step()
    return loss.detach()

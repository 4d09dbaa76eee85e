"""The same network in PyTorch: the twin we race (``final_project.compare``).

It is not a ground truth for our kernels (that is :mod:`final_project.reference`,
which the tests check against this twin's float64 training step).

Layer names match :mod:`final_project.model` (conv1, bn1, conv2, bn2, fc1, fc2),
so ``state_dict()`` keys are identical and weights move both ways. Usage::

    twin = TorchCNN.from_state_dict(config, model.state_dict(), device="cuda")
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    loss = torch_train_step(twin, opt, x, y)
"""

import common  # noqa: F401  (first: picks GPU or simulator before numba loads)

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


def torch_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
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

"""The seed tutorial's ConvNet: single-device, plain PyTorch, no Ray."""

from __future__ import annotations

import torch
from torch import nn

#: Per-channel statistics of the MNIST training set, used to normalise inputs.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


class ConvNet(nn.Module):
    """Two conv(5x5) + BatchNorm + ReLU + max-pool blocks, then one linear layer.

    Input: float images of shape ``(N, 1, 28, 28)``, already normalised.
    Output: logits of shape ``(N, num_classes)``.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.fc = nn.Linear(7 * 7 * 32, num_classes)
        # Channels-last conv kernels: oneDNN's NHWC path trains this net faster on CPU
        # (benchmarks/README.md), and cuDNN prefers it under AMP. A 1-channel input is already
        # channels-last; checkpoints and load_state_dict are unaffected.
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(x))
        return self.fc(x.flatten(1))


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(N, 28, 28)`` → normalised float ``(N, 1, 28, 28)``, on the images' device.

    Data travels as uint8 (4x less to move) and becomes float only where it is used.
    """
    return images.unsqueeze(1).float().div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)

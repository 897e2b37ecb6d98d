"""The benchmark models: the seed MLP, a larger MLP and a small CNN (inputs are synthetic)."""

from __future__ import annotations

import torch

MODELS = ("seed_mlp", "large_mlp", "cnn")
# Selectable with --models, not run by default: the CNN in PyTorch's default NCHW layout, to show
# what channels_last buys (``python -m benchmarks --models cnn,cnn_nchw``).
EXTRA_MODELS = ("cnn_nchw",)


def make_model(name: str) -> torch.nn.Module:
    if name == "seed_mlp":  # the notebook's 784-128-10
        return torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    if name == "large_mlp":
        return torch.nn.Sequential(
            torch.nn.Linear(784, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )
    if name in ("cnn", "cnn_nchw"):
        cnn = torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 28, 28)),
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 7 * 7, 10),
        )
        # channels_last (NHWC), PyTorch's advice for convolutions on the CPU and the layout TensorFlow
        # uses natively: oneDNN's convolutions and ATen's max-pooling have NHWC kernels, and with
        # NHWC weights the convolutions' outputs come out NHWC (the 1-channel input is both
        # layouts at once). Every torch configuration (phalanx, DDP, the ceiling) uses this model.
        return cnn.to(memory_format=torch.channels_last) if name == "cnn" else cnn
    raise ValueError(f"unknown model {name!r}; choose from {MODELS + EXTRA_MODELS}")


def batches(batch: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(count)]

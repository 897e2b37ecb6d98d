"""The benchmark workloads: a model, its synthetic batches, its loss and optimizer (no data is downloaded).

Three small ones stand for the host-bound end (a step of 1-2 ms on a GPU): the seed MLP, a larger
MLP and a small CNN. Two real ones stand for what people train on GPUs:

* ``transformer_lm``: a decoder-only transformer language model (6 pre-norm layers, d=512, 8 heads,
  sequence 256, vocabulary 8192; causal self-attention through ``nn.TransformerEncoderLayer`` with a
  causal mask), AdamW, bfloat16 autocast on a GPU. About 75 parameter tensors.
* ``resnet``: a ResNet-18-style CNN with BatchNorm for 32x32 images (four stages of two basic
  blocks, 64-512 channels, channels_last), SGD with momentum.

``transformer_small`` is the language model at a small width (d=32, sequence 16, vocabulary 256):
as many parameter tensors, little compute per step, so the host time of the gradient path shows
on a CPU. It is the CPU proxy of the GPU figures (``python -m benchmarks.hooks``).

Example:
    >>> w = workload("transformer_small")
    >>> model = w.make()
    >>> x, y = w.batches(4, 1)[0]
    >>> w.per_example_loss(model(x), y).shape
    torch.Size([4])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MODELS = ("seed_mlp", "large_mlp", "cnn")
# Selectable with --models, not run by default: the CNN in PyTorch's default NCHW layout, to show
# what channels_last buys (``python -m benchmarks --models cnn,cnn_nchw``), and the real models,
# whose steps take seconds on a 2-core CPU (``--device cuda`` runs them).
EXTRA_MODELS = ("cnn_nchw", "transformer_lm", "resnet", "transformer_small")
GPU_MODELS = ("seed_mlp", "large_mlp", "cnn", "transformer_lm", "resnet")


class TransformerLM(torch.nn.Module):
    """A decoder-only language model: embeddings, ``layers`` causal pre-norm blocks, a final norm and head."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.position = torch.nn.Parameter(torch.randn(seq, d_model) * 0.02)
        block = torch.nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        h = self.blocks(h, mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(h))


class _Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.short = (
            torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else torch.nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.short(x))


class ResNet(torch.nn.Module):
    """ResNet-18's shape for 32x32 inputs (CIFAR's): a stem, four stages of two basic blocks, a head."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU()
        )
        stages, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            stages += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.stages = torch.nn.Sequential(*stages)
        self.head = torch.nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stages(self.stem(x))
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


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
    if name == "transformer_lm":
        return TransformerLM(vocab=8192, d_model=512, layers=6, heads=8, seq=256)
    if name == "transformer_small":
        return TransformerLM(vocab=256, d_model=32, layers=6, heads=4, seq=16)
    if name == "resnet":
        return ResNet().to(memory_format=torch.channels_last)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS + EXTRA_MODELS}")


def batches(batch: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """MNIST-shaped batches (784 features, 10 classes) for the MLPs and the small CNN."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(count)]


def _token_batches(vocab: int, seq: int) -> Callable[[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]]:
    def make(batch: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(count):
            tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))  # predict the next token
        return out

    return make


def _image_batches(batch: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last),
            torch.randint(0, 10, (batch,), generator=g),
        )
        for _ in range(count)
    ]


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per example: over classes, or averaged over a sequence's tokens."""
    if out.dim() == 2:  # classification: the ops the benchmark has always timed
        return torch.nn.functional.cross_entropy(out.float(), y, reduction="none")
    per_item = torch.nn.functional.cross_entropy(out.float().flatten(0, -2), y.flatten(), reduction="none")
    return per_item.view(y.shape[0], -1).mean(1)


@dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    Attributes:
        name: as ``--models`` names it.
        global_batch: examples per step over all replicas.
        optimizer: ``adam``, ``adamw`` or ``sgd`` (with momentum).
        autocast_on_gpu: the dtype of the forward's autocast on a GPU (None: float32).
    """

    name: str
    global_batch: int = 256
    optimizer: str = "adam"
    autocast_on_gpu: torch.dtype | None = None

    def make(self) -> torch.nn.Module:
        return make_model(self.name)

    def batches(self, batch: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.name.startswith("transformer"):
            vocab, seq = (8192, 256) if self.name == "transformer_lm" else (256, 16)
            return _token_batches(vocab, seq)(batch, count, seed)
        if self.name == "resnet":
            return _image_batches(batch, count, seed)
        return batches(batch, count, seed)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-3)

    def autocast(self, device: str) -> torch.autocast:
        """The forward's autocast on ``device`` (disabled on the CPU and for float32 workloads)."""
        dtype = self.autocast_on_gpu if device == "cuda" else None
        return torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    per_example_loss = staticmethod(per_example_loss)


_WORKLOADS = {
    "transformer_lm": Workload("transformer_lm", global_batch=32, optimizer="adamw", autocast_on_gpu=torch.bfloat16),
    "transformer_small": Workload("transformer_small", global_batch=4, optimizer="adamw"),
    "resnet": Workload("resnet", global_batch=128, optimizer="sgd"),
}


def workload(name: str) -> Workload:
    """The workload ``name`` (the MLPs and the small CNN: global batch 256, Adam, float32).

    Raises:
        ValueError: no such model.
    """
    if name not in MODELS + EXTRA_MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS + EXTRA_MODELS}")
    return _WORKLOADS.get(name, Workload(name))

"""Small models and a synthetic probe set, built in code (nothing is downloaded).

Holds the model factories that configs, tests and benchmarks name by import path
(``classgrad.workers.zoo:mlp`` ...) and ``synthetic_probe``, a seeded probe set for any number of classes.

Models (every one maps a batch to ``[batch, num_classes]`` logits):
- ``mlp``: Linear/ReLU stack on vectors.
- ``small_cnn``: two Conv2d blocks, pooling and a Linear head on images.
- ``bn_cnn``: the same with BatchNorm2d (eval or train mode changes the engine).
- ``tiny_transformer``: Embedding, a TransformerEncoder layer (attention, LayerNorm), mean
  pooling and a Linear head on token sequences.
- ``resnet18``: a ResNet-18-size image classifier (11M parameters plus the head), for the GPU
  examples and benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def mlp(num_classes: int = 10, in_features: int = 32, hidden: int = 64, depth: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, width: int, batch_norm: bool):
        super().__init__()
        norm = (lambda c: nn.BatchNorm2d(c)) if batch_norm else (lambda c: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            norm(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            norm(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(8 * width, 4 * width), nn.ReLU(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def small_cnn(num_classes: int = 10, in_channels: int = 3, width: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN(num_classes, in_channels, width, batch_norm=False)


def bn_cnn(num_classes: int = 10, in_channels: int = 3, width: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = SmallCNN(num_classes, in_channels, width, batch_norm=True)
    # Non-trivial running statistics, so eval mode differs from train mode.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                # SmallCNN's BatchNorm2d layers track running statistics: both are tensors.
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    return model


class TinyTransformer(nn.Module):
    def __init__(self, num_classes: int, vocab: int, dim: int, heads: int, layers: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        return self.head(self.norm(self.encoder(h)).mean(dim=-2))


def tiny_transformer(
    num_classes: int = 10,
    vocab: int = 64,
    dim: int = 16,
    heads: int = 2,
    layers: int = 1,
    max_len: int = 16,
    seed: int = 0,
) -> nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer(num_classes, vocab, dim, heads, layers, max_len)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """The ResNet-18 layout (2-2-2-2 basic blocks, 64-512 channels)."""

    def __init__(self, num_classes: int, in_channels: int = 3, small_inputs: bool = False):
        super().__init__()
        if small_inputs:  # 32x32 inputs: a 3x3 stem without the max-pool
            self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
            )
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def resnet18(num_classes: int = 1000, in_channels: int = 3, small_inputs: bool = True, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ResNet18(num_classes, in_channels, small_inputs)


def class_sizes(
    num_classes: int, samples_per_class: int, imbalance: float, empty_classes: Sequence[int], generator: torch.Generator
) -> torch.Tensor:
    """Samples per class: equal, or Zipf-like with exponent ``imbalance`` (mean kept near
    ``samples_per_class``, at least one each), classes shuffled; ``empty_classes`` get none."""
    if imbalance > 0:
        ranks = torch.arange(1, num_classes + 1, dtype=torch.float64)
        weights = ranks ** (-imbalance)
        weights = weights / weights.mean()
        sizes = torch.clamp(torch.round(weights * samples_per_class), min=1).long()
        sizes = sizes[torch.randperm(num_classes, generator=generator)]
    else:
        sizes = torch.full((num_classes,), samples_per_class, dtype=torch.long)
    sizes[list(empty_classes)] = 0
    return sizes


def synthetic_probe(
    num_classes: int = 10,
    samples_per_class: int = 4,
    kind: str = "image",
    input_shape: Sequence[int] = (3, 16, 16),
    vocab: int = 64,
    seq_len: int = 12,
    imbalance: float = 0.0,
    empty_classes: Sequence[int] = (),
    multilabel: bool = False,
    labels_per_sample: int = 3,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic probe set ``(inputs, targets)`` with class-dependent inputs.

    ``kind``: ``image`` (float ``[N, *input_shape]``), ``vector`` (float ``[N, input_shape[0]]``)
    or ``tokens`` (int64 ``[N, seq_len]`` in ``[0, vocab)``). Targets are int64 labels ``[N]``,
    or multi-hot float ``[N, C]`` with ``multilabel`` (the sample's class plus
    ``labels_per_sample - 1`` random others). Samples are grouped by class in class order.
    """
    if kind not in ("image", "vector", "tokens"):
        raise ValueError(f"synthetic_probe kind must be image, vector or tokens, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    sizes = class_sizes(num_classes, samples_per_class, imbalance, empty_classes, g)
    labels = torch.repeat_interleave(torch.arange(num_classes), sizes)
    n = len(labels)
    if kind == "tokens":
        # Each class prefers its own slice of the vocabulary, so classes differ.
        base = torch.randint(0, vocab, (n, seq_len), generator=g)
        preferred = (labels.unsqueeze(1) * 7 + torch.randint(0, 5, (n, seq_len), generator=g)) % vocab
        use = torch.rand(n, seq_len, generator=g) < 0.5
        inputs = torch.where(use, preferred, base)
    else:
        shape = tuple(input_shape) if kind == "image" else (int(input_shape[0]),)
        # A random prototype per class when C x input size fits in 256 MiB; otherwise a cheap
        # deterministic pattern of the label, so huge C does not need huge memory.
        size = math.prod(shape)
        protos = torch.randn(num_classes, size, generator=g) if num_classes * size <= 2**26 else None
        noise = torch.randn(n, *shape, generator=g)
        if protos is not None:
            inputs = noise + 0.5 * protos[labels].reshape(n, *shape)
        else:
            inputs = noise + 0.5 * torch.sin(
                labels.view(-1, *[1] * len(shape)).float() * torch.linspace(1, 2, size).reshape(shape)
            )
    if not multilabel:
        return inputs, labels
    targets = torch.zeros(n, num_classes)
    targets[torch.arange(n), labels] = 1.0
    if labels_per_sample > 1:
        extra = torch.randint(0, num_classes, (n, labels_per_sample - 1), generator=g)
        targets.scatter_(1, extra, 1.0)
    return inputs, targets

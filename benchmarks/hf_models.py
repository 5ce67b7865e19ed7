"""Small Hugging Face models built from configs (no weights downloaded), for the projection benchmarks.

Holds ``vit`` and ``bert``: model factories usable as ``model.factory`` in a job file, returning
the models as transformers defines them (the engines take ``.logits`` of their outputs).
"""

from __future__ import annotations

import torch
from torch import nn


def vit(
    num_classes: int = 1000,
    hidden: int = 192,
    layers: int = 6,
    heads: int = 3,
    intermediate: int = 768,
    image: int = 32,
    patch: int = 4,
    seed: int = 0,
) -> nn.Module:
    """A ViT for ``[N, 3, image, image]`` images (hidden 192, 6 layers: D = 2.71M + 193 C)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        image_size=image,
        patch_size=patch,
        num_labels=num_classes,
    )
    return ViTForImageClassification(config).eval()


def bert(
    num_classes: int = 100,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    intermediate: int = 512,
    vocab: int = 64,
    seed: int = 0,
) -> nn.Module:
    """A small BERT classifier for ``[N, seq]`` token ids."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=64,
        num_labels=num_classes,
    )
    return BertForSequenceClassification(config).eval()

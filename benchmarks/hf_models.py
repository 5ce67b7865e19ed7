"""Small Hugging Face models built from configs (no weights downloaded), for the projection benchmarks.

Holds ``Logits`` (a wrapper returning ``.logits``: wrapper-free HF support is separate work),
``vit`` and ``bert`` (model factories usable as ``model.factory`` in a job file), and
``OUTSIDE_RULES`` (name patterns of the parameters the hook path has no layer rule for yet:
LayerNorm, position and token embeddings, the class token; a job that projects with
``structure: kronecker`` excludes them until those rules exist).
"""

from __future__ import annotations

import torch
from torch import nn

OUTSIDE_RULES = [
    "*embeddings.cls_token",
    "*position_embeddings*",
    "*word_embeddings*",
    "*token_type_embeddings*",
    "*LayerNorm*",
    "*layernorm*",
]


class Logits(nn.Module):
    """``model(x).logits`` as a plain tensor (``pixel_values`` or ``input_ids``)."""

    def __init__(self, model: nn.Module, key: str):
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: x}).logits


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
    return Logits(ViTForImageClassification(config), "pixel_values").eval()


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
    return Logits(BertForSequenceClassification(config), "input_ids").eval()

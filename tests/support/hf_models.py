"""Tiny Hugging Face models for tests and benchmarks: built from small configs, seeded, no downloads.

Holds ``LogitsOf`` (a test-only wrapper: a dict of keyword inputs or a pixel tensor in, the
output's ``.logits`` out), the builders ``tiny_bert``, ``tiny_gpt2``, ``tiny_llama`` and
``tiny_vit`` (eval mode, wrapped), ``HF_BUILDERS`` (name -> builder) and ``hf_probe`` (a
seeded probe set for one of them: padded token ids with an attention mask, or images).
Parameter names carry the wrapper's ``hf.`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 48
SEQ_LEN = 7
PAD = 0


class LogitsOf(nn.Module):
    """``hf(**x).logits`` for a dict ``x`` (token models), ``hf(pixel_values=x).logits`` otherwise."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, x: Any) -> torch.Tensor:
        if isinstance(x, dict):
            return self.hf(**x).logits
        return self.hf(pixel_values=x).logits


def _randomised(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter away from its initial value (LayerNorm/RMSNorm weights not all ones,
    biases not zero), so every parameter's gradient is exercised."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_bert(num_classes: int, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=num_classes,
        pad_token_id=PAD,
    )
    return LogitsOf(_randomised(BertForSequenceClassification(config), seed)).eval()


def tiny_gpt2(num_classes: int, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        num_labels=num_classes,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=1,
    )
    return LogitsOf(_randomised(GPT2ForSequenceClassification(config), seed)).eval()


def tiny_llama(num_classes: int, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        num_labels=num_classes,
        pad_token_id=PAD,
    )
    return LogitsOf(_randomised(LlamaForSequenceClassification(config), seed)).eval()


def tiny_vit(num_classes: int, seed: int = 0) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        num_labels=num_classes,
    )
    return LogitsOf(_randomised(ViTForImageClassification(config), seed)).eval()


HF_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "bert": tiny_bert,
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "vit": tiny_vit,
}


def hf_probe(
    name: str, num_classes: int, per_class: int, seed: int = 0, seq_len: int = SEQ_LEN
) -> tuple[Any, torch.Tensor]:
    """``(inputs, labels)`` with ``per_class`` samples of each class (class after class, then
    shuffled). Token models get right-padded ids (1 to ``seq_len`` real tokens, pad id 0) and
    an attention mask; ViT gets 3x8x8 images."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    n = len(labels)
    if name == "vit":
        return torch.randn(n, 3, 8, 8, generator=g), labels
    lengths = torch.randint(1, seq_len + 1, (n,), generator=g)
    mask = (torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = torch.randint(1, VOCAB, (n, seq_len), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask}, labels

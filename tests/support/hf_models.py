"""The models users bring, tiny: built from small configs, seeded, no downloads, no wrappers.

Holds the builders ``tiny_bert``, ``tiny_gpt2``, ``tiny_llama``, ``tiny_opt``, ``tiny_vit``,
``tiny_resnet`` (Hugging Face classes as their library defines them, eval mode: the engines pass dict batches
as keyword arguments and take ``.logits``), ``lstm_classifier`` (``nn.Embedding`` +
``nn.LSTM`` + ``nn.Linear``) and ``layernorm_mlp``; ``HF_BUILDERS`` (the Hugging Face
transformers by name), ``REAL_MODELS`` (all of them) and ``hf_probe`` (a seeded probe set for
one of them: right-padded token ids with an attention mask, or images, or vectors). Builders
take config overrides (``**sizes``), so tests can try other small configs of an architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 48
SEQ_LEN = 7
PAD = 0
VECTOR = 10  # the MLP's input features


def _randomised(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter away from its initial value (LayerNorm/RMSNorm weights not all ones,
    biases not zero), so every parameter's gradient is exercised."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _seeded(model_cls: Any, config_cls: Any, seed: int, defaults: dict[str, Any], sizes: dict[str, Any]) -> nn.Module:
    """``model_cls(config_cls(defaults | sizes))`` built under ``seed``, every parameter moved
    (``_randomised``), in eval mode."""
    torch.manual_seed(seed)
    return _randomised(model_cls(config_cls(**defaults | sizes)), seed).eval()


def tiny_bert(num_classes: int, seed: int = 0, **sizes: Any) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    defaults = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=num_classes,
        pad_token_id=PAD,
    )
    return _seeded(BertForSequenceClassification, BertConfig, seed, defaults, sizes)


def tiny_gpt2(num_classes: int, seed: int = 0, **sizes: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    defaults = dict(
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
    return _seeded(GPT2ForSequenceClassification, GPT2Config, seed, defaults, sizes)


def tiny_llama(num_classes: int, seed: int = 0, **sizes: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    defaults = dict(
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
    return _seeded(LlamaForSequenceClassification, LlamaConfig, seed, defaults, sizes)


def tiny_opt(num_classes: int, seed: int = 0, **sizes: Any) -> nn.Module:
    """OPT: a decoder whose layers take a key/value cache object (state) and whose feed-forward
    block runs on ``[samples * tokens, hidden]``."""
    from transformers import OPTConfig, OPTForSequenceClassification

    defaults = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        ffn_dim=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        word_embed_proj_dim=16,
        max_position_embeddings=16,
        num_labels=num_classes,
        pad_token_id=PAD,
    )
    return _seeded(OPTForSequenceClassification, OPTConfig, seed, defaults, sizes)


def tiny_vit(num_classes: int, seed: int = 0, **sizes: Any) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    defaults = dict(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        num_labels=num_classes,
    )
    return _seeded(ViTForImageClassification, ViTConfig, seed, defaults, sizes)


def tiny_resnet(num_classes: int, seed: int = 0, **sizes: Any) -> nn.Module:
    """Hugging Face's ResNet (BatchNorm in eval mode, with running statistics away from 0 and 1)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    defaults = dict(embedding_size=8, hidden_sizes=[8, 12], depths=[1, 1], layer_type="basic", num_labels=num_classes)
    model = _seeded(ResNetForImageClassification, ResNetConfig, seed, defaults, sizes)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


class LSTMClassifier(nn.Module):
    """``nn.Embedding`` + ``nn.LSTM`` + ``nn.Linear`` on the last real token's state; keyword
    inputs as a tokenizer gives them."""

    def __init__(self, num_classes: int, hidden: int = 12, layers: int = 1, bidirectional: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden, padding_idx=PAD)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embed(input_ids))
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        return self.head(states[torch.arange(len(last), device=last.device), last])


def lstm_classifier(num_classes: int, seed: int = 0, **sizes: Any) -> nn.Module:
    torch.manual_seed(seed)
    return _randomised(LSTMClassifier(num_classes, **sizes), seed).eval()


def layernorm_mlp(num_classes: int, seed: int = 0, hidden: int = 24) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(VECTOR, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.LayerNorm(hidden),
        nn.GELU(), nn.Linear(hidden, num_classes),
    )  # fmt: skip
    return _randomised(model, seed).eval()


HF_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "bert": tiny_bert,
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "vit": tiny_vit,
}
# Every model of issue 16's table, as users bring them.
REAL_MODELS: dict[str, Callable[..., nn.Module]] = {
    **HF_BUILDERS,
    "opt": tiny_opt,
    "resnet": tiny_resnet,
    "lstm": lstm_classifier,
    "ln_mlp": layernorm_mlp,
}
IMAGE_MODELS = ("vit", "resnet")


def hf_probe(
    name: str, num_classes: int, per_class: int, seed: int = 0, seq_len: int = SEQ_LEN
) -> tuple[Any, torch.Tensor]:
    """``(inputs, labels)`` with ``per_class`` samples of each class (class after class, then
    shuffled). Token models get right-padded ids (1 to ``seq_len`` real tokens, pad id 0) and
    an attention mask; ViT and ResNet get 3x8x8 images, the MLP vectors."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    n = len(labels)
    if name in IMAGE_MODELS:
        return torch.randn(n, 3, 8, 8, generator=g), labels
    if name == "ln_mlp":
        return torch.randn(n, VECTOR, generator=g), labels
    lengths = torch.randint(1, seq_len + 1, (n,), generator=g)
    mask = (torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = torch.randint(1, VOCAB, (n, seq_len), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask}, labels

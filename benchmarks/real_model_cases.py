"""The models users bring, built from tiny configs (no downloads), with probe data for each.

Holds ``RealCase`` (a model as its library defines it, its probe set as a list of dict samples
or ``(input, label)`` pairs, and how to call the model on a batch) and ``build_case(name, C,
...)`` for the names in ``CASES``: Hugging Face ``bert``, ``gpt2`` (right padding), ``llama``
(RMSNorm, rotary), ``vit``, ``resnet`` (BatchNorm in eval mode), plus an ``lstm`` text
classifier and an ``ln_mlp`` (``nn.LayerNorm``). Token models get padded inputs with an
attention mask; every class has 1 to 4 samples (seeded). ``width`` (``WIDTH`` by default) sets
each model's hidden size, the others in proportion: a wider model shows how a cost per sample
that does not grow with the layers (the default projection's FFTs) compares with the floor.

Dropout probabilities are 0, so that train mode (which Opacus needs to capture activations)
computes what eval mode does. The models are used exactly as their libraries define them: no
wrapper, parameter names are the library's own. The alternatives in ``real_models`` call them
as a user would (``model(**inputs).logits``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

CASES = ("bert", "gpt2", "lstm", "ln_mlp", "resnet", "vit", "llama")
SEQ_LEN = 16
WIDTH = 64  # hidden size; feed-forward layers 2x, the LayerNorm MLP's 4x, the LSTM's 1/2
VOCAB = 512
IMAGE = 32


@dataclass
class RealCase:
    """One model and its probe set: ``samples`` (dicts with a ``labels`` key, or ``(x, y)``)."""

    name: str
    model: nn.Module
    samples: list[Any]
    labels: torch.Tensor
    device: torch.device = torch.device("cpu")  # where ``batch`` puts inputs and labels

    def to(self, device: str | torch.device) -> RealCase:
        """The model moved to ``device``, and batches put there from now on."""
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    @property
    def dict_inputs(self) -> bool:
        return isinstance(self.samples[0], dict)

    def batch(self, idx: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Inputs (a dict of stacked tensors without labels, or a tensor) and labels of ``idx``."""
        items = [self.samples[i] for i in idx.tolist()]
        if self.dict_inputs:
            keys = [k for k in items[0] if k != "labels"]
            return {k: torch.stack([it[k] for it in items]).to(self.device) for k in keys}, self.labels[idx].to(
                self.device
            )
        return torch.stack([it[0] for it in items]).to(self.device), self.labels[idx].to(self.device)

    def logits(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """How a user calls the model: keyword arguments for dicts, ``.logits`` of a ModelOutput."""
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        return out.logits if hasattr(out, "logits") else out


def class_sizes(num_classes: int, low: int, high: int, seed: int) -> torch.Tensor:
    """``low`` to ``high`` samples per class, seeded."""
    return torch.randint(low, high + 1, (num_classes,), generator=torch.Generator().manual_seed(seed))


def _labels(num_classes: int, low: int, high: int, seed: int) -> torch.Tensor:
    sizes = class_sizes(num_classes, low, high, seed)
    return torch.repeat_interleave(torch.arange(num_classes), sizes)


def _token_samples(labels: torch.Tensor, seed: int, first_token: int = 1) -> list[dict[str, torch.Tensor]]:
    """Right-padded token sequences of 4..SEQ_LEN real tokens (ids >= 1; 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, SEQ_LEN + 1, (len(labels),), generator=g)
    ids = torch.randint(first_token, VOCAB, (len(labels), SEQ_LEN), generator=g)
    mask = (torch.arange(SEQ_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = ids * mask
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(len(labels))]


def _image_samples(labels: torch.Tensor, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(len(labels), 3, IMAGE, IMAGE, generator=g)
    return [{"pixel_values": images[i], "labels": labels[i]} for i in range(len(labels))]


class LSTMClassifier(nn.Module):
    """``nn.Embedding`` + ``nn.LSTM`` + ``nn.Linear`` on the last real token's state."""

    def __init__(self, num_classes: int, hidden: int = WIDTH // 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden, padding_idx=0)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embed(input_ids))
        last = attention_mask.sum(dim=1) - 1
        return self.head(states[torch.arange(len(last)), last])


def _ln_mlp(num_classes: int, width: int = WIDTH) -> nn.Module:
    h = 4 * width
    return nn.Sequential(
        nn.Linear(64, h), nn.LayerNorm(h), nn.GELU(), nn.Linear(h, h), nn.LayerNorm(h), nn.GELU(),
        nn.Linear(h, num_classes),
    )  # fmt: skip


def _hf(name: str, num_classes: int, width: int = WIDTH) -> nn.Module:
    import transformers as tf

    small = {"num_labels": num_classes}
    w, ff = width, 2 * width
    if name == "bert":
        return tf.BertForSequenceClassification(
            tf.BertConfig(vocab_size=VOCAB, hidden_size=w, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=ff, max_position_embeddings=SEQ_LEN, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, **small)
        )  # fmt: skip
    if name == "gpt2":
        return tf.GPT2ForSequenceClassification(
            tf.GPT2Config(vocab_size=VOCAB, n_embd=w, n_layer=2, n_head=2, n_positions=SEQ_LEN, pad_token_id=0,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **small)
        )  # fmt: skip
    if name == "llama":
        return tf.LlamaForSequenceClassification(
            tf.LlamaConfig(vocab_size=VOCAB, hidden_size=w, intermediate_size=ff, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                           pad_token_id=0, **small)
        )  # fmt: skip
    if name == "vit":
        return tf.ViTForImageClassification(
            tf.ViTConfig(hidden_size=w, num_hidden_layers=2, num_attention_heads=2, intermediate_size=ff,
                         image_size=IMAGE, patch_size=8, **small)
        )  # fmt: skip
    if name == "resnet":
        return tf.ResNetForImageClassification(
            tf.ResNetConfig(
                embedding_size=w // 4, hidden_sizes=[w // 4, w // 2], depths=[1, 1], layer_type="basic", **small
            )
        )
    raise ValueError(name)


BUILDERS: dict[str, Callable[[int, int], nn.Module]] = {
    "lstm": lambda c, w: LSTMClassifier(c, hidden=w // 2),
    "ln_mlp": _ln_mlp,
    **{n: (lambda c, w, n=n: _hf(n, c, w)) for n in ("bert", "gpt2", "llama", "vit", "resnet")},
}


def build_case(name: str, num_classes: int, low: int = 1, high: int = 4, seed: int = 0, width: int = WIDTH) -> RealCase:
    """The model ``name`` (seeded weights, eval mode) with 1 to 4 samples in each of ``num_classes``."""
    torch.manual_seed(seed)
    model = BUILDERS[name](num_classes, width).eval()
    labels = _labels(num_classes, low, high, seed + 1)
    samples: list[Any]
    if name in ("vit", "resnet"):
        samples = _image_samples(labels, seed + 2)
    elif name == "ln_mlp":
        x = torch.randn(len(labels), 64, generator=torch.Generator().manual_seed(seed + 2))
        samples = [(x[i], labels[i]) for i in range(len(labels))]
    else:
        samples = _token_samples(labels, seed + 2)
    return RealCase(name, model, samples, labels)

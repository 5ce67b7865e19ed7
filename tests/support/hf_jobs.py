"""Tiny Hugging Face models and dict datasets that job configs and tests name (no downloads).

Holds model factories (``job_bert``: ``BertForSequenceClassification`` from a tiny config;
``job_gpt2``: ``GPT2ForSequenceClassification``, with or without a pad token; ``job_tuple_mlp``
and ``job_output_mlp``: plain modules returning a tuple or a ``ModelOutput``), data factories
(``job_text_rows``: a ``Dataset`` of dicts with variable-length ``input_ids``, an
``attention_mask``, a label and raw text; ``job_text_loader``: the same behind a ``DataLoader``
with its own collate function; ``job_hf_rows``: ``RowsLikeHFDataset``, a stand-in for
``datasets.Dataset.with_format("torch")``, which is not installed; ``job_vector_rows``: dict
samples of fixed-size vectors), ``pad_collate``, the collate function the loader uses, and
bad inputs (``job_no_tensor_output``, ``job_off_device``, ``job_rows_missing_label``).

Every factory is seeded, so that the driver and each actor build the same job.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 40


def job_bert(num_classes: int = 6, seed: int = 0, names: bool = False) -> nn.Module:
    """A one-layer BERT classifier (hidden 16); ``names`` gives its config real class names."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    extra = {"id2label": {i: f"class-{i}" for i in range(num_classes)}} if names else {}
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=num_classes,
        **extra,
    )
    return BertForSequenceClassification(config)


def job_gpt2(num_classes: int = 6, seed: int = 0, pad_token: bool = False) -> nn.Module:
    """A one-layer GPT-2 classifier; without ``pad_token`` its config has none (as GPT-2's own)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32, num_labels=num_classes, pad_token_id=None
    )
    if pad_token:
        config.pad_token_id = 0
    return GPT2ForSequenceClassification(config)


class _TupleMLP(nn.Module):
    def __init__(self, num_classes: int, in_features: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, 12), nn.Tanh())
        self.head = nn.Linear(12, num_classes)

    def forward(self, features: torch.Tensor, scale: torch.Tensor | None = None):
        h = self.body(features if scale is None else features * scale)
        return h, self.head(h)  # the logits second: model.output=1 picks them


def job_tuple_mlp(num_classes: int = 6, in_features: int = 5, seed: int = 0) -> nn.Module:
    """An MLP taking keyword ``features`` (and an optional ``scale``) and returning ``(hidden, logits)``."""
    torch.manual_seed(seed)
    return _TupleMLP(num_classes, in_features)


class _OutputMLP(_TupleMLP):
    def forward(self, features: torch.Tensor, scale: torch.Tensor | None = None):  # type: ignore[override]
        from transformers.modeling_outputs import SequenceClassifierOutput

        h, logits = super().forward(features, scale)
        return SequenceClassifierOutput(logits=logits, hidden_states=(h,))


def job_output_mlp(num_classes: int = 6, in_features: int = 5, seed: int = 0) -> nn.Module:
    """The same MLP, returning a ``SequenceClassifierOutput`` (``.logits``)."""
    torch.manual_seed(seed)
    return _OutputMLP(num_classes, in_features)


def _texts(num_classes: int, per_class: int, seed: int, min_len: int, max_len: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for c in range(num_classes):
        for _ in range(per_class):
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            ids = torch.randint(1, VOCAB, (n,), generator=g)
            rows.append(
                {
                    "input_ids": ids,
                    "attention_mask": torch.ones(n, dtype=torch.int64),
                    "label": torch.tensor(c),
                    "text": " ".join(f"w{int(i)}" for i in ids),
                }
            )
    return rows


class TextRows(Dataset):
    """Dict samples: ``input_ids`` and ``attention_mask`` of 3 to 9 tokens, ``labels``, ``text``."""

    def __init__(self, num_classes: int, per_class: int, seed: int, label_field: str = "labels"):
        self.rows = [
            {**{k: v for k, v in r.items() if k != "label"}, label_field: r["label"]}
            for r in _texts(num_classes, per_class, seed, 3, 9)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def job_text_rows(num_classes: int = 6, per_class: int = 2, seed: int = 1, label_field: str = "labels") -> Dataset:
    return TextRows(num_classes, per_class, seed, label_field)


def pad_collate(items: list[dict]) -> dict:
    """Pads ``input_ids`` and ``attention_mask`` to the longest sample, as a tokenizer would."""
    n = max(len(it["input_ids"]) for it in items)
    out = {
        "input_ids": torch.zeros(len(items), n, dtype=torch.int64),
        "attention_mask": torch.zeros(len(items), n, dtype=torch.int64),
        "labels": torch.stack([it["labels"] for it in items]),
    }
    for i, it in enumerate(items):
        out["input_ids"][i, : len(it["input_ids"])] = it["input_ids"]
        out["attention_mask"][i, : len(it["attention_mask"])] = it["attention_mask"]
    return out


def job_text_loader(num_classes: int = 6, per_class: int = 2, seed: int = 1) -> DataLoader:
    """The text rows behind a shuffling DataLoader with its own collate function."""
    return DataLoader(TextRows(num_classes, per_class, seed), batch_size=3, shuffle=True, collate_fn=pad_collate)


class RowsLikeHFDataset:
    """What ``datasets.Dataset.with_format("torch")`` gives, duck-typed: ``len`` and ``[i]``
    returning a dict of tensors (strings stay strings), the label under ``label``. Not a
    ``torch.utils.data.Dataset``."""

    def __init__(self, rows: list[dict]):
        self._rows = rows
        self.column_names = list(rows[0])

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, key: int | str) -> dict | list:
        if isinstance(key, str):  # a column, as datasets gives it
            return [r[key] for r in self._rows]
        return dict(self._rows[key])


def job_hf_rows(num_classes: int = 6, per_class: int = 2, seed: int = 1) -> RowsLikeHFDataset:
    return RowsLikeHFDataset(_texts(num_classes, per_class, seed, 3, 9))


class VectorRows(Dataset):
    """Dict samples ``{"features": [in_features], "labels": c, "note": str}``."""

    def __init__(self, num_classes: int, per_class: int, in_features: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_classes * per_class, in_features, generator=g)
        self.y = torch.arange(num_classes).repeat_interleave(per_class)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.x[i], "labels": self.y[i], "note": f"sample {i}"}


def job_vector_rows(num_classes: int = 6, per_class: int = 3, in_features: int = 5, seed: int = 1) -> Dataset:
    return VectorRows(num_classes, per_class, in_features, seed)


# --- bad inputs --------------------------------------------------------------------------------


class _NoTensorOut(_TupleMLP):
    def forward(self, features: torch.Tensor, scale: torch.Tensor | None = None):  # type: ignore[override]
        return {"loss": None, "note": "no logits here"}


def job_no_tensor_output(num_classes: int = 6, in_features: int = 5, seed: int = 0) -> nn.Module:
    """A model whose output (a dict) holds no tensor to take as the logits."""
    torch.manual_seed(seed)
    return _NoTensorOut(num_classes, in_features)


class _OffDevice(_TupleMLP):
    def __init__(self, num_classes: int, in_features: int):
        super().__init__(num_classes, in_features)
        self.scale = torch.ones(in_features, device="meta")  # not a buffer: model.to leaves it there

    def forward(self, features: torch.Tensor, scale: torch.Tensor | None = None):  # type: ignore[override]
        return super().forward(features, self.scale)[1]


def job_off_device(num_classes: int = 6, in_features: int = 5, seed: int = 0) -> nn.Module:
    """A model that uses a tensor on another device than the engine's (``meta``, on any machine)."""
    torch.manual_seed(seed)
    return _OffDevice(num_classes, in_features)


def job_rows_missing_label(num_classes: int = 6, per_class: int = 3, in_features: int = 5, seed: int = 1) -> list:
    """Dict samples of which one lacks its label."""
    rows = [VectorRows(num_classes, per_class, in_features, seed)[i] for i in range(num_classes * per_class)]
    del rows[4]["labels"]
    return rows

"""The attention rule (``layer_rules.attention``): ``nn.MultiheadAttention`` as a class-batched unit.

Each model's rows from the partitioned engine's hook path, against the float64 reference
engine's (the shared harness of the layer-rule tests), with the rule itself counted as used:
self-attention with a packed ``in_proj_weight``, a boolean key padding mask and a causal float
mask with ``is_causal``; cross-attention with separate q/k/v weights (``kdim``, ``vdim``),
sequence-first, without biases, with a float key padding mask; a ``TransformerEncoderLayer``.
Calls the rule refuses (``add_bias_kv``, the attention weights used) take the generic module VJP,
with the same rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from classgrad.workers.engines.layer_rules import attention
from tests.support.engine_cases import NUM_CLASSES, max_relative_error
from tests.support.rule_cases import rows_and_reference

L = 5  # tokens per sample
TOL = 1e-5  # float32 products and sums against float64: the engine tests' row tolerance


class SelfAttention(nn.Module):
    def __init__(self, causal: bool = False, use_weights: bool = False, **options):
        super().__init__()
        self.causal, self.use_weights = causal, use_weights
        self.inp = nn.Linear(3, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, **options)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, batch: dict) -> torch.Tensor:
        h, mask = self.inp(batch["x"]), batch["mask"]
        causal = nn.Transformer.generate_square_subsequent_mask(L) if self.causal else None
        a, w = self.attn(h, h, h, key_padding_mask=~mask, attn_mask=causal, is_causal=self.causal)
        out = (a * mask.unsqueeze(-1)).sum(1)
        return self.head(out + w.sum((1, 2)).unsqueeze(1) if self.use_weights else out)


class CrossAttention(nn.Module):
    """Sequence-first, separate q/k/v weights, no biases, a float key padding mask."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(3, 8), nn.Linear(3, 4), nn.Linear(3, 6)
        self.attn = nn.MultiheadAttention(8, 2, kdim=4, vdim=6, bias=False)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, batch: dict) -> torch.Tensor:
        x, mask = batch["x"].transpose(0, 1), batch["mask"]
        pad = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        a, _ = self.attn(self.q(x), self.k(x), self.v(x), key_padding_mask=pad, need_weights=False)
        return self.head(a.mean(0))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.head(self.layer(self.inp(batch["x"]), src_key_padding_mask=~batch["mask"]).mean(1))


def probe(n: int = 3 * NUM_CLASSES, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (n,), generator=g)
    x = {"x": torch.randn(n, L, 3, generator=g), "mask": torch.arange(L) < lengths.unsqueeze(1)}
    return x, torch.randint(0, NUM_CLASSES - 1, (n,), generator=g)  # the last class: no samples


MODELS = {
    "self": lambda: SelfAttention(),
    "self-causal": lambda: SelfAttention(causal=True),
    "cross": CrossAttention,
    "encoder": Encoder,
}


def _rows(model: nn.Module, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    calls = []
    rule = attention._class_grads  # what the unit computer runs once the call is taken
    monkeypatch.setattr(attention, "_class_grads", lambda *a, **k: calls.append(1) or rule(*a, **k))
    torch.manual_seed(0)
    _, got, ref = rows_and_reference(model.eval(), probe())
    return got, ref, len(calls)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rows_from_the_rule_equal_the_reference(name, monkeypatch):
    torch.manual_seed(1)
    got, ref, calls = _rows(MODELS[name](), monkeypatch)
    assert calls > 0  # the class-batched rule made them, not the generic VJP
    assert max_relative_error(got, ref) <= TOL


@pytest.mark.parametrize("refused", ["add_bias_kv", "weights used"])
def test_refused_calls_take_the_generic_unit_with_the_same_rows(refused, monkeypatch):
    torch.manual_seed(1)
    model = SelfAttention(add_bias_kv=True) if refused == "add_bias_kv" else SelfAttention(use_weights=True)
    got, ref, calls = _rows(model, monkeypatch)
    assert calls == 0
    assert max_relative_error(got, ref) <= TOL
    h = model.inp(probe()[0]["x"])
    layer_refused = attention.attention_refusal(model.attn, (h, h, h), {}, (h, None))
    call_refused = attention.attention_refusal(model.attn, (h, h, h), {}, (h, h))  # a gradient at the weights
    if refused == "add_bias_kv":
        assert layer_refused == call_refused == "add_bias_kv or add_zero_attn"
    else:
        assert layer_refused is None and "gradient at the attention weights" in str(call_refused)

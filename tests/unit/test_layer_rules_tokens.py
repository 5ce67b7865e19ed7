"""The token layers' rules against the float64 reference engine: ``nn.Embedding``,
``nn.EmbeddingBag`` and transformers' ``Conv1D`` (GPT-2), and what each refuses.

A tiny classifier is built around the layer under test; the partitioned engine must take the
hook path with the layer's rule and give the reference engine's rows (float64 copy). A refused
configuration must still give exact rows, by another path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gpt2.configuration_gpt2 import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.pytorch_utils import Conv1D

from classgrad.workers import zoo
from classgrad.workers.engines.layer_rules import RULES, rule_for
from tests.support.engine_cases import (
    EMPTY_CLASS,
    LOW_PRECISION_TOLERANCE,
    NUM_CLASSES,
    fell_back,
    max_relative_error,
    zero_rows,
)
from tests.support.rule_cases import Tokens, assert_hook_path, rows_and_reference, token_probe

VOCAB, SEQ = 23, 7
PAD = 0

# float32 has a unit roundoff of 6e-8; these tiny models sum at most a few hundred terms per entry,
# so rows stay within a few roundoffs of the float64 reference (the engines' contract).
FP32_TOLERANCE = 1e-5


# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


class EmbedClassifier(nn.Module):
    """Token ids -> an embedding (``layer``) -> tanh -> mean over positions -> Linear. With
    ``twice``, the same embedding also embeds every other token (one parameter, two calls)."""

    def __init__(self, layer: nn.Module, twice: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = layer
        self.twice = twice
        self.head = nn.Linear(layer.weight.shape[1], NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(tokens))
        h = h.mean(dim=1) if h.dim() == 3 else h
        if self.twice:
            h = h + torch.sigmoid(self.embed(tokens[:, ::2])).flatten(1)[:, : h.shape[1]]
        return self.head(h)


def _embedding(**kwargs) -> nn.Embedding:
    torch.manual_seed(0)
    return nn.Embedding(VOCAB, 5, **kwargs)


def _bag(**kwargs) -> nn.EmbeddingBag:
    torch.manual_seed(0)
    return nn.EmbeddingBag(VOCAB, 5, **kwargs)


def assert_not_by_its_rule(eng, layer: nn.Module) -> None:
    """``layer``'s parameters were not computed by its rule: the hook path gave them to the
    layer's own module VJP, or was abandoned for another path (either way, a note says so)."""
    assert eng._hooked is None or layer not in eng._hooked.plan.rules, eng.stats.notes
    assert eng.stats.notes


def _check_exact(model: nn.Module, data, types, params=None) -> None:
    eng, got, ref = rows_and_reference(model.eval(), data, params=params)
    assert_hook_path(eng, types)
    assert max_relative_error(got, ref) <= FP32_TOLERANCE
    assert torch.equal(zero_rows(got), zero_rows(ref))  # the empty class, and only it


EMBEDDING_CASES = {
    "plain": (lambda: EmbedClassifier(_embedding()), None),
    "padding_idx": (lambda: EmbedClassifier(_embedding(padding_idx=PAD)), PAD),
    "called_twice": (lambda: EmbedClassifier(_embedding(padding_idx=PAD), twice=True), PAD),
}


@pytest.mark.parametrize("case", sorted(EMBEDDING_CASES))
def test_embedding_rule_matches_the_float64_reference(case):
    build, pad = EMBEDDING_CASES[case]
    _check_exact(build(), token_probe(VOCAB, SEQ, pad=pad), {nn.Embedding, nn.Linear})


def test_embedding_padding_row_is_zero_and_frozen_or_unselected_tables_are_skipped():
    model = EmbedClassifier(_embedding(padding_idx=PAD))
    data = token_probe(VOCAB, SEQ, pad=PAD)
    eng, got, _ = rows_and_reference(model.eval(), data, params=["embed.weight"])
    assert_hook_path(eng, {nn.Embedding})
    assert bool((got.view(NUM_CLASSES, VOCAB, 5)[:, PAD] == 0).all())
    # Not selected: the Linear alone is hooked.
    _check_exact(model, data, {nn.Linear}, params=["head.weight", "head.bias"])
    # Frozen (requires_grad False): the same.
    model.embed.weight.requires_grad_(False)
    _check_exact(model, data, {nn.Linear})


BAG_CASES = {
    "mean": dict(mode="mean"),
    "mean_padding_idx": dict(mode="mean", padding_idx=PAD),
    "max": dict(mode="max"),
    "max_padding_idx": dict(mode="max", padding_idx=PAD),
}


@pytest.mark.parametrize("case", sorted(BAG_CASES))
def test_embedding_bag_rule_matches_the_float64_reference(case):
    kwargs = BAG_CASES[case]
    pad = kwargs.get("padding_idx")
    _check_exact(EmbedClassifier(_bag(**kwargs)), token_probe(VOCAB, SEQ, pad=pad), {nn.EmbeddingBag, nn.Linear})


def test_embedding_bag_called_twice_adds_both_calls():
    _check_exact(EmbedClassifier(_bag(mode="max"), twice=True), token_probe(VOCAB, SEQ), {nn.EmbeddingBag, nn.Linear})


REFUSED = {
    "embedding max_norm": (lambda: _embedding(max_norm=1.0), "max_norm"),
    "bag max_norm": (lambda: _bag(mode="mean", max_norm=1.0), "max_norm"),
    "bag sum": (lambda: _bag(mode="sum"), "per_sample_weights"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_embedding_configurations_say_why_and_stay_exact(case):
    build, reason = REFUSED[case]
    layer = build()
    assert reason in (rule_for(layer).applies(layer) or "")
    eng, got, ref = rows_and_reference(EmbedClassifier(layer).eval(), token_probe(VOCAB, SEQ))
    assert_not_by_its_rule(eng, layer)  # another path computed its rows
    # max_norm renormalises the table in place in each forward, in both engines' copies; once
    # renormalised, a row changes by about 1e-7 relative per forward, far inside the float32 contract.
    assert max_relative_error(got, ref) <= FP32_TOLERANCE


@pytest.mark.parametrize("layer", [_embedding(scale_grad_by_freq=True), _bag(mode="mean", scale_grad_by_freq=True)])
def test_scale_grad_by_freq_is_refused(layer):
    """Its gradient is divided by how often each id occurs in the whole micro-batch, whichever
    classes share it (the reference engine's rows depend on how the probe set is batched), so
    no per-class sum from hooks is right: refused, and the model takes another path."""
    assert "scale_grad_by_freq" in (rule_for(layer).applies(layer) or "")
    eng, got, _ = rows_and_reference(EmbedClassifier(layer).eval(), token_probe(VOCAB, SEQ))
    assert_not_by_its_rule(eng, layer)
    assert bool(torch.isfinite(got).all())


def test_sparse_embeddings_are_refused():
    """sparse=True: every engine's plain path reshapes the (sparse) gradient and fails today, so the
    rule, which would be the only working path but cannot pass the first-run check, refuses too."""
    for layer in (_embedding(sparse=True), _bag(mode="mean", sparse=True)):
        assert "sparse" in (rule_for(layer).applies(layer) or "")


class BagWithOffsets(nn.Module):
    """An EmbeddingBag called with a flat 1-D input and offsets: its bags are not the samples."""

    def __init__(self):
        super().__init__()
        self.embed = _bag(mode="mean")
        self.head = nn.Linear(5, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n, length = tokens.shape
        offsets = torch.arange(0, n * length, length, device=tokens.device)
        return self.head(torch.tanh(self.embed(tokens.reshape(-1), offsets)))


def test_embedding_bag_with_offsets_falls_back_with_a_note_and_stays_exact():
    model = BagWithOffsets().eval()
    eng, got, ref = rows_and_reference(model, token_probe(VOCAB, SEQ))
    assert_not_by_its_rule(eng, model.embed)
    assert max_relative_error(got, ref) <= FP32_TOLERANCE  # the fallback's rows: same contract


class BroadcastPositions(nn.Module):
    """Position ids ``[1, L]`` shared by every sample (as Hugging Face models pass them): the
    embedding's batch dimension is not the samples, so hooks cannot split it by class."""

    def __init__(self):
        super().__init__()
        self.embed = _embedding()
        self.head = nn.Linear(5, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.head(torch.tanh(x.unsqueeze(-1) + self.embed(positions)).mean(dim=1))


def test_an_embedding_broadcast_across_the_batch_is_split_by_class_once_expanded():
    """The hook path hands the broadcast ``[1, L, H]`` output on expanded to the run's samples, so
    the gradient at it is per sample and the rule splits it by class exactly."""
    data = zoo.synthetic_probe(
        NUM_CLASSES, 3, kind="vector", input_shape=(SEQ,), imbalance=1.0, empty_classes=[EMPTY_CLASS], seed=3
    )
    eng, got, ref = rows_and_reference(BroadcastPositions().eval(), data)
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    assert max_relative_error(got, ref) <= FP32_TOLERANCE


class Conv1DClassifier(nn.Module):
    """[N, 12] -> 3 positions of 4 features -> transformers' Conv1D (twice with ``twice``) -> Linear."""

    def __init__(self, twice: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.tokens = Tokens(3, 4)
        self.proj = Conv1D(nf=4, nx=4)
        nn.init.normal_(self.proj.bias)
        self.twice = twice
        self.head = nn.Linear(12, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.tokens(x)))
        if self.twice:
            h = torch.tanh(self.proj(h))
        return self.head(h.flatten(1))


def _vector_probe(features: int):
    return zoo.synthetic_probe(
        NUM_CLASSES, 3, kind="vector", input_shape=(features,), imbalance=1.0, empty_classes=[EMPTY_CLASS], seed=3
    )


@pytest.mark.parametrize("twice", [False, True], ids=["once", "called_twice"])
def test_hf_conv1d_rule_matches_the_float64_reference(twice):
    # Registered on first sight (so that importing the engines does not import transformers).
    assert rule_for(Conv1D(4, 3)) is RULES[Conv1D]
    _check_exact(Conv1DClassifier(twice=twice), _vector_probe(12), {Conv1D, nn.Linear})


@pytest.mark.parametrize("params", [["proj.weight"], ["proj.bias"]])
def test_hf_conv1d_rule_computes_only_the_selected_parameters(params):
    _check_exact(Conv1DClassifier(), _vector_probe(12), {Conv1D}, params=params)


class GPT2MLPClassifier(nn.Module):
    """GPT-2's own MLP block (two Conv1D, new GELU) on 3 positions of 8 features."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0)
        self.tokens = Tokens(3, 8)
        self.mlp = GPT2MLP(16, config)
        self.head = nn.Linear(24, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.tokens(x)).flatten(1))


def test_gpt2_mlp_takes_the_hook_path():
    _check_exact(GPT2MLPClassifier(), _vector_probe(24), {Conv1D, nn.Linear})


# The engines' LOW_PRECISION_TOLERANCE (engine_cases: about 20-25 unit roundoffs of the half type):
# inputs, activations and their gradients are rounded once per layer in these few-layer models.
LOW_PRECISION_CASES = {
    "embedding_padding_idx": (
        lambda: EmbedClassifier(_embedding(padding_idx=PAD)),
        lambda: token_probe(VOCAB, SEQ, pad=PAD),
    ),
    "bag_max": (lambda: EmbedClassifier(_bag(mode="max")), lambda: token_probe(VOCAB, SEQ)),
    "hf_conv1d": (lambda: Conv1DClassifier(twice=True), lambda: _vector_probe(12)),
}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("case", sorted(LOW_PRECISION_CASES))
def test_token_rules_under_autocast(case, precision):
    build, data = LOW_PRECISION_CASES[case]
    eng, got, ref = rows_and_reference(build().eval(), data(), precision=precision)
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert max_relative_error(got, ref) <= LOW_PRECISION_TOLERANCE[precision]

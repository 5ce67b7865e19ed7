"""The models and probe sets the reads from the device are counted on (``tests/unit/test_host_reads.py``,
``benchmarks/host_reads.py``, ``benchmarks/gpu_proof.py``'s ``syncs``): no pytest needed.

Holds ``MODELS`` (name -> builder of ``num_classes``: the zoo's MLP and small CNN, the tiny
Hugging Face configs, the LSTM) and ``probe`` (classes of 1 to 4 samples, shuffled).
"""

from __future__ import annotations

import torch

from classgrad.workers import zoo
from tests.support.hf_models import hf_probe, lstm_classifier, tiny_bert, tiny_gpt2, tiny_resnet, tiny_vit

MODELS = {
    "mlp": lambda c: zoo.mlp(c, in_features=10),
    "cnn": lambda c: zoo.small_cnn(c, width=4),
    "bert": tiny_bert,
    "gpt2": tiny_gpt2,
    "vit": tiny_vit,
    "resnet": tiny_resnet,
    "lstm": lstm_classifier,
}
# The probe's inputs for each model (hf_probe's kinds: vectors of 10 features, 3x8x8 images, tokens).
INPUTS = {"mlp": "ln_mlp", "cnn": "vit", **{name: name for name in ("bert", "gpt2", "vit", "resnet", "lstm")}}


def probe(name: str, num_classes: int, seed: int = 0):
    """Classes of 1 to 4 samples (class c has 1 + c % 4), shuffled."""
    sizes = 1 + torch.arange(num_classes) % 4
    labels = torch.arange(num_classes).repeat_interleave(sizes)
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]
    inputs, _ = hf_probe(INPUTS[name], 1, per_class=len(labels), seed=seed)
    return inputs, labels

"""Layer rules: per-class parameter gradients of one layer type from its hooked input and output
gradient (the partitioned engine's hook path). See ``registry`` for the interface.

Holds the public names (``register_rule``, ``rule_for``, ``RULES``, ``LayerRule``, the types a
rule reads and writes, ``OuterFactors``/``class_outer_sums``, and ``module_vjp``'s
``register_unit_computer``/``unit_computer_for``/``module_class_grads`` for modules no rule
covers) and registers the built-in rules: ``linear`` (nn.Linear), ``conv`` (nn.Conv1d/2d/3d),
``batchnorm`` (eval-mode nn.BatchNorm1d/2d/3d), ``embedding`` (nn.Embedding, nn.EmbeddingBag),
``norms`` (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm) and ``hf_conv1d`` (transformers' Conv1D,
registered on first sight). docs/layers.md lists what each supports and refuses. Recurrent
layers (nn.LSTM/GRU/RNN) and nn.MultiheadAttention are units computed class-batched by
``recurrent_class_grads`` and ``attention_class_grads``.
"""

from __future__ import annotations

from classgrad.workers.engines.layer_rules import batchnorm, conv, embedding, linear, norms  # noqa: F401 - registers the rules
from classgrad.workers.engines.layer_rules.attention import attention_class_grads, attention_refusal
from classgrad.workers.engines.layer_rules.hf_conv1d import register_hf_conv1d
from classgrad.workers.engines.layer_rules.module_vjp import (
    UNIT_COMPUTERS,
    module_class_grads,
    register_unit_computer,
    unit_computer_for,
)
from classgrad.workers.engines.layer_rules.outer import OuterFactors, class_outer_sums
from classgrad.workers.engines.layer_rules.recurrent import recurrent_class_grads, recurrent_refusal
from classgrad.workers.engines.layer_rules.registry import RULES, LayerRule, register_lazy_rule, register_rule, rule_for
from classgrad.workers.engines.layer_rules.rule_io import ClassGrid, ClassRows, LayerCapture, LayerRows

# Registered when the first Conv1D is met (transformers is then imported already).
register_lazy_rule("transformers.pytorch_utils", "Conv1D", register_hf_conv1d)

__all__ = [
    "RULES",
    "UNIT_COMPUTERS",
    "ClassGrid",
    "ClassRows",
    "LayerCapture",
    "LayerRows",
    "LayerRule",
    "OuterFactors",
    "attention_class_grads",
    "attention_refusal",
    "class_outer_sums",
    "recurrent_class_grads",
    "recurrent_refusal",
    "module_class_grads",
    "register_rule",
    "register_unit_computer",
    "rule_for",
    "unit_computer_for",
]

"""Layer rules: per-class parameter gradients of one layer type from its hooked input and output
gradient (the partitioned engine's hook path). See ``registry`` for the interface.

Holds the public names (``register_rule``, ``rule_for``, ``RULES``, ``LayerRule``, the types a
rule reads and writes, ``OuterFactors``/``class_outer_sums``, and ``module_vjp``'s
``register_unit_computer``/``unit_computer_for``/``module_class_grads`` for modules no rule
covers) and registers the built-in rules: ``linear`` (nn.Linear), ``conv`` (nn.Conv2d),
``batchnorm`` (eval-mode nn.BatchNorm1d/2d).
"""

from __future__ import annotations

from classgrad.workers.engines.layer_rules import batchnorm, conv, linear  # noqa: F401 - registers the rules
from classgrad.workers.engines.layer_rules.module_vjp import (
    UNIT_COMPUTERS,
    module_class_grads,
    register_unit_computer,
    unit_computer_for,
)
from classgrad.workers.engines.layer_rules.outer import OuterFactors, class_outer_sums
from classgrad.workers.engines.layer_rules.registry import RULES, LayerRule, register_rule, rule_for
from classgrad.workers.engines.layer_rules.rule_io import ClassGrid, ClassRows, LayerCapture, LayerRows

__all__ = [
    "RULES",
    "UNIT_COMPUTERS",
    "ClassGrid",
    "ClassRows",
    "LayerCapture",
    "LayerRows",
    "LayerRule",
    "OuterFactors",
    "class_outer_sums",
    "module_class_grads",
    "register_rule",
    "register_unit_computer",
    "rule_for",
    "unit_computer_for",
]

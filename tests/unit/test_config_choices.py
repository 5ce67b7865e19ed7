"""The config's registry-backed keys take exactly the registries' names: the registries publish
each name they register into ``classgrad.config.choices`` (the config is the bottom layer and
cannot import them), so a name registered from outside the package is valid in a job file."""

from __future__ import annotations

import typing

from classgrad.config import BUILTIN_LOSS_KINDS, DENSE_LOSS_KINDS, EngineConfig
from classgrad.config.choices import Choices
from classgrad.workers.gradients import ENGINES
from classgrad.workers.losses import LOSSES, DenseLoss, create_loss
from classgrad.workers.projection import PROJECTIONS
from classgrad.workers.projection.dense.dense_structure import DenseOptions


def _choices(section: type, key: str) -> set[str]:
    """The names the key's ``Choices`` (in its annotation, maybe under ``| None``) holds."""
    stack = [section.model_fields[key].annotation, *section.model_fields[key].metadata]
    while stack:
        item = stack.pop()
        if isinstance(item, Choices):
            return set(item)
        stack.extend(typing.get_args(item))
    raise AssertionError(f"{section.__name__}.{key} names no registry")


def test_engine_kinds_are_the_engine_registry_and_auto() -> None:
    assert _choices(EngineConfig, "kind") == set(ENGINES) | {"auto"}


def test_projection_kinds_are_the_projection_registry() -> None:
    assert _choices(DenseOptions, "kind") == set(PROJECTIONS)


def test_loss_kinds_are_the_loss_registry() -> None:
    assert set(BUILTIN_LOSS_KINDS) == set(LOSSES)


def test_dense_loss_kinds_are_the_registry_losses_that_are_dense() -> None:
    # num_classes only sizes the loss; any positive value builds the same kind.
    dense = {name for name in LOSSES if isinstance(create_loss(name, 3), DenseLoss)}
    assert set(DENSE_LOSS_KINDS) == dense

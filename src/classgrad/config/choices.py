"""The names a job config's registry-backed keys take: what the compute side registered.

Holds ``Choices`` and one instance per key: ``ENGINE_KINDS`` (``engine.kind``, plus ``auto``),
``LOSS_KINDS`` (``loss.kind``'s names), ``STRUCTURES`` (``projection.structure``) and
``PROJECTION_KINDS`` (``projection.kind``). The registries of ``classgrad.workers``
(``register_engine``, ``register_loss``, ``register_structure``, ``register_projection``) add
each name here when they register it, with its traits (a loss that is ``dense``, a structure
that projects ``in_backward``, an engine that is ``partitioned``); so a name registered from
outside the package is valid in a job file, and no list of names is kept twice.

The config is the bottom layer and does not import the registries. The first check of a name
asks the loader that ``classgrad``'s top (``src/classgrad/__init__.py``) installs with
``set_loader`` to import the compute side's built-in registrations; a name registered by a user's
module is valid once that module is imported (a job file's ``plugins`` list does it first).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from pydantic_core import PydanticCustomError

_LOADER: list[Callable[[], object]] = []
_LOADING = threading.RLock()  # a second thread waits for the first one's import


def set_loader(load: Callable[[], object]) -> None:
    """``load()`` registers the built-in names (called once, at the first check of any name)."""
    _LOADER[:] = [load]


def _load() -> None:
    """Run the loader once; it stays installed until it has succeeded (a failed import is raised
    again at the next check, never a short list of names)."""
    if not _LOADER:
        return
    with _LOADING:
        if _LOADER:
            _LOADER[0]()
            _LOADER.clear()


class Choices:
    """The names one config key takes, in registration order, each with its traits."""

    def __init__(self, key: str, *, fixed: tuple[str, ...] = ()):
        self.key = key
        self.fixed = fixed  # names the config itself gives a meaning (``auto``), listed first
        self._traits: dict[str, frozenset[str]] = {}

    def add(self, name: str, *traits: str) -> None:
        """Called by the registry that gives ``name`` its meaning."""
        self._traits[name] = frozenset(traits)

    def discard(self, name: str) -> None:
        self._traits.pop(name, None)

    def names(self) -> tuple[str, ...]:
        _load()
        return (*self.fixed, *self._traits)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def has(self, name: str, trait: str) -> bool:
        """Whether ``name`` was registered with ``trait``."""
        _load()
        return trait in self._traits.get(name, frozenset())

    def with_trait(self, trait: str) -> frozenset[str]:
        _load()
        return frozenset(n for n, traits in self._traits.items() if trait in traits)

    def check(self, value: str) -> str:
        """``value`` when it is one of the names, else the error a ``Literal`` of them gives."""
        names = self.names()
        if value not in names:
            quoted = [repr(n) for n in names]
            expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        return value


class WithTrait:
    """The names of ``choices`` registered with ``trait``, looked up when asked (a set-like view)."""

    def __init__(self, choices: Choices, trait: str):
        self.choices = choices
        self.trait = trait

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.choices.with_trait(self.trait)))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.choices.has(name, self.trait)


ENGINE_KINDS = Choices("engine.kind", fixed=("auto",))
LOSS_KINDS = Choices("loss.kind")
STRUCTURES = Choices("projection.structure")
PROJECTION_KINDS = Choices("projection.kind")
DENSE_LOSS_KINDS = WithTrait(LOSS_KINDS, "dense")  # every sample contributes to every class
IN_BACKWARD_STRUCTURES = WithTrait(STRUCTURES, "in_backward")  # projected by the partitioned engine's hooks
PARTITIONED_ENGINES = WithTrait(ENGINE_KINDS, "partitioned")  # engines whose hook path projects in the backward

"""The one shape of a name-keyed registry of plugins (engines, loss kinds, structures, ...).

Holds ``Registry[T]``: names to values in registration order, with ``register`` (a taken name is
refused unless ``replace``; a registry that backs a job config's key publishes each name, with its
traits, in that key's ``config.choices.Choices``, and takes it back in ``unregister``), ``get``
(an unknown name is the registry's own one-line error, listing the choices), ``find`` (None for an
unknown name), ``names``, ``unregister``, ``in``, iteration and ``len``. The registries themselves
live beside what they hold, in ``classgrad.workers``; each keeps its ``register_*``/``create_*``
functions, which check what only they know and call these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from classgrad.errors import ConfigError

if TYPE_CHECKING:
    from classgrad.config.choices import Choices

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to values of one kind of plugin.

    ``what`` names a value in the refusal of a taken name (``"loss kind"``: "loss kind 'x' is
    already registered"); ``unknown`` is the message of ``get``'s ``error`` for an unknown name,
    formatted with ``name`` and ``choices`` (the sorted names, comma separated); ``choices``: the
    config key's names, where a job file may name the values.
    """

    def __init__(
        self,
        what: str,
        *,
        unknown: str = "{name!r} is unknown (choices: {choices})",
        error: type[Exception] = ConfigError,
        choices: Choices | None = None,
    ):
        self.what = what
        self.unknown = unknown
        self.error = error
        self.choices = choices
        self._items: dict[str, T] = {}

    def register(self, name: str, value: T, *, replace: bool = False, traits: tuple[str, ...] = ()) -> T:
        """Add ``value`` under ``name`` (a taken name needs ``replace``), published with ``traits``."""
        if name in self._items and not replace:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._items[name] = value
        if self.choices is not None:
            self.choices.add(name, *traits)  # a job file may name it
        return value

    def unregister(self, name: str) -> T | None:
        """Take ``name`` back (and its config choice); its value, or None if it was not there."""
        if self.choices is not None:
            self.choices.discard(name)
        return self._items.pop(name, None)

    def get(self, name: str) -> T:
        """The value of ``name``; an unknown (or unhashable) name raises the registry's error."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            choices = ", ".join(sorted(self._items))
            raise self.error(self.unknown.format(name=name, choices=choices)) from None

    __getitem__ = get

    def find(self, name: str) -> T | None:
        """The value of ``name``, or None."""
        return self._items.get(name)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._items)})"

"""The parameter layout's one entry type, shared by the store and the engines.

Holds ``ParamSlot``: one selected parameter (name, shape, offset, size) in row order, its
columns ``[offset, offset + size)`` of every row. The store writes a tuple of them into its
attributes (``layout``); ``classgrad.workers.layout.ParamLayout`` builds them from a model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSlot:
    """One selected parameter: its columns in a row are ``[offset, offset + size)``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    size: int

    @classmethod
    def of(cls, entry: ParamSlot | dict) -> ParamSlot:
        """A slot with plain Python types from a slot or its dict form (as stored)."""
        if isinstance(entry, dict):
            entry = cls(**entry)
        return cls(str(entry.name), tuple(int(s) for s in entry.shape), int(entry.offset), int(entry.size))

    def to_dict(self) -> dict:
        """The JSON form stored in the store's attributes (keys in this order)."""
        return {"name": self.name, "shape": list(self.shape), "offset": self.offset, "size": self.size}

"""How probe samples become batches: samples as tuples or dicts, stacked or padded, split again.

Holds:
- ``Samples``: what the probe set needs to know about its samples: where the label is (the
  second element of a tuple, or the key ``label_field`` of a dict: by default the first of
  ``labels``, ``label`` that the first sample has), ``label_of`` / ``inputs_of`` for one sample,
  ``collate`` (a list of samples -> a batch) and ``inputs_of_batch`` (a collated batch -> the
  model's inputs, the label key taken out).
- ``stack`` and ``pad_stack``: the built-in ways to collate (``data.collate``: ``stack`` needs
  every sample's tensors of one shape; ``pad`` pads variable-length tensors of a batch to the
  longest, at the end of each dimension, with ``data.pad_values`` per dict key, default 0, the
  mask's "hidden"; the engines pad ``input_ids`` with the model's pad id, which a GPT-2-style
  model reads to find each sample's last token: ``model_io.input_pad_values``). Strings (raw
  text) are kept as lists and numbers become tensors.
- ``resolve_collate``: a collate setting (``stack``, ``pad``, a callable or an import path
  ``module:function`` taking a list of samples) as a function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from classgrad.errors import InputError, first_line

__all__ = ["DEFAULT_LABEL_KEYS", "Samples", "pad_stack", "resolve_collate", "stack"]

# The label keys looked for in dict samples when none is configured, in this order.
DEFAULT_LABEL_KEYS: tuple[str, ...] = ("labels", "label")

Collate = Callable[[list[Any]], Any]


def _stack_tensors(items: Sequence[torch.Tensor], pad: float | None) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in items}
    if len(shapes) == 1:
        return torch.stack(list(items))
    if pad is None or len({t.dim() for t in items}) != 1:
        raise InputError(
            f"data: samples of one batch have tensors of different shapes {sorted(shapes)[:3]}: "
            "set data.collate=pad (padded to the longest per batch) or give a collate function"
        )
    longest = [max(t.shape[d] for t in items) for d in range(items[0].dim())]
    out = torch.full((len(items), *longest), pad, dtype=items[0].dtype)
    for i, t in enumerate(items):
        view = out[i]
        for d, n in enumerate(t.shape):
            view = view.narrow(d, 0, n)
        view.copy_(t)
    return out


def _collate(items: Sequence[Any], pads: Mapping[str, float] | None, pad: float | None) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        return _stack_tensors(items, pad)
    if isinstance(first, str):
        return list(items)
    if isinstance(first, (tuple, list)):
        return type(first)(_collate([it[i] for it in items], pads, pad) for i in range(len(first)))
    if isinstance(first, Mapping):
        missing = [k for k in first if any(k not in it for it in items)]
        if missing:
            raise InputError(f"data: some samples of a batch lack the key {missing[0]!r} that others have")
        return {k: _collate([it[k] for it in items], pads, None if pads is None else pads.get(k, 0)) for k in first}
    if isinstance(first, Sequence):  # a list of numbers or strings, as a datasets row without format gives
        return _collate([torch.as_tensor(it) for it in items], pads, pad)
    return torch.as_tensor(items)


def stack(items: list[Any]) -> Any:
    """Samples (tensors, numbers, strings, or tuples/dicts of them) stacked into a batch; tensors of
    different shapes are an ``InputError`` that points to ``data.collate=pad``."""
    return _collate(items, None, None)


def pad_stack(items: list[Any], pad_values: Mapping[str, float] | None = None) -> Any:
    """Like ``stack``, variable-length tensors padded at the end to the longest of the batch, with
    ``pad_values[key]`` for a dict key (default 0)."""
    return _collate(items, dict(pad_values or {}), 0)


def resolve_collate(collate: str | Collate | None, pad_values: Mapping[str, float] | None = None) -> Collate:
    """The collate function a setting stands for (see the module docstring)."""
    if collate is None or collate == "stack":
        return stack
    if collate == "pad":
        pads = dict(pad_values or {})
        return lambda items: pad_stack(items, pads)
    if callable(collate):
        return collate
    if isinstance(collate, str) and ":" in collate:
        from classgrad.workers.imports import import_object

        return import_object(collate, what="data.collate")
    raise InputError(f"data.collate {collate!r}: expected stack, pad or an import path 'module:function'")


class Samples:
    """Where a probe set's samples keep their label, and how they are batched."""

    def __init__(self, first: Any, label_field: str | None, collate: Collate):
        self.collate_fn = collate
        self.label_field: str | None = None
        if isinstance(first, Mapping):
            if label_field is None:
                label_field = next((k for k in DEFAULT_LABEL_KEYS if k in first), None)
                if label_field is None:
                    raise InputError(
                        f"data: dict samples without a label key ({' or '.join(DEFAULT_LABEL_KEYS)}; "
                        f"keys: {', '.join(map(str, first))}): set data.label_field"
                    )
            self.label_field = label_field
        elif not (isinstance(first, (tuple, list)) and len(first) == 2):
            raise InputError(
                f"data: a sample is a {type(first).__name__}; "
                "expected (input, target) or a dict of inputs with a label key"
            )
        elif label_field is not None:
            raise InputError(f"data.label_field {label_field!r}: the samples are (input, target) pairs, not dicts")

    def label_of(self, item: Any, index: int) -> Any:
        if self.label_field is None:
            return item[1]
        if not isinstance(item, Mapping) or self.label_field not in item:
            keys = ", ".join(map(str, item)) if isinstance(item, Mapping) else type(item).__name__
            raise InputError(f"data: item {index} has no label key {self.label_field!r} (it has: {keys})")
        return item[self.label_field]

    def inputs_of(self, item: Any) -> Any:
        if self.label_field is None:
            return item[0]
        return {k: v for k, v in item.items() if k != self.label_field}

    def collate(self, items: list[Any]) -> Any:
        try:
            return self.collate_fn(items)
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's collate function failed: one line
            raise InputError(f"data: collating a batch raised {first_line(exc, with_type=True)}") from exc

    def inputs_of_batch(self, batch: Any) -> Any:
        """The model's inputs in a collated batch (the label key or the target taken out)."""
        if isinstance(batch, Mapping):
            return {k: v for k, v in batch.items() if k != self.label_field}
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0]
        raise InputError(
            f"data: the collate function returned a {type(batch).__name__}; expected (inputs, targets) or a dict"
        )

"""Parameter layout: which parameters make up a gradient row, and where each one sits.

Holds ``ParamLayout``: the ordered selection for a model (include/exclude name patterns, default
every parameter with ``requires_grad``), with ``flatten``/``unflatten`` between per-parameter
gradients and rows, and a JSON form for the store's attributes. Its entries are ``ParamSlot``s
(name, shape, offset, size), the one layout type the store and the engines share, defined with
the store in ``classgrad.store.core.params``.

Order is ``model.named_parameters()`` order, which is deterministic for a given model class, so
every worker and every reader agree on the column of each parameter entry.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from classgrad.errors import InputError
from classgrad.store.core.params import ParamSlot


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class ParamLayout:
    """The selected parameters of a model, flattened and concatenated in row order."""

    def __init__(self, slots: Sequence[ParamSlot]):
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        # Columns up to the last slot's end. A projected engine's work row may give several slots
        # the same columns (``TensorSketchMap.work_slots``: every unit adds into one sketch), so
        # this can be less than the sizes' sum; ``flatten`` refuses such a layout.
        self.dim: int = max((s.offset + s.size for s in self.slots), default=0)
        self.shares_columns = self.dim != sum(s.size for s in self.slots)
        self._by_name = {s.name: s for s in self.slots}

    @classmethod
    def from_model(cls, model: nn.Module, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> ParamLayout:
        """Select parameters by fnmatch patterns on their names.

        An empty ``include`` means every parameter with ``requires_grad``; an explicit include may
        also select frozen parameters (the user asked for them by name). ``exclude`` wins over
        ``include``. Selecting nothing is an error that lists the available names.
        """
        slots: list[ParamSlot] = []
        offset = 0
        names = []
        for name, param in model.named_parameters():
            names.append(name)
            chosen = _matches(name, include) if include else param.requires_grad
            if not chosen or _matches(name, exclude):
                continue
            slots.append(ParamSlot(name, tuple(param.shape), offset, param.numel()))
            offset += param.numel()
        if not slots:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise InputError(
                f"params: include={list(include)} exclude={list(exclude)} select no parameters "
                f"(model has: {shown or 'no parameters'})"
            )
        unmatched = [p for p in include if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unmatched:
            raise InputError(f"params.include: pattern(s) {unmatched} match no parameter name")
        return cls(slots)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def slot(self, name: str) -> ParamSlot:
        try:
            return self._by_name[name]
        except KeyError:
            raise InputError(f"unknown parameter {name!r} (layout has: {', '.join(self.names)})") from None

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The model's selected parameter tensors, in row order."""
        named = dict(model.named_parameters())
        return [named[s.name] for s in self.slots]

    def flatten(
        self,
        grads: Sequence[torch.Tensor | None],
        batch_dims: int = 0,
        *,
        out: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Concatenate per-parameter gradients into rows.

        ``grads[i]`` has shape ``(*batch, *slots[i].shape)`` or is ``None`` (no path to the loss:
        zero columns). Returns ``(*batch, dim)`` in float32 (float64 when the gradients are).

        With ``out`` the rows are written straight into it (no new buffer, one copy per
        parameter) and ``out`` is returned: ``out`` has shape ``(*batch, dim)``, or, with
        ``index`` (int64 ``[k]``, ``batch_dims == 1``), rows ``out[index]`` receive the ``k``
        rows in place.
        """
        if self.shares_columns:
            raise ValueError("flatten: this layout's slots share columns (a projected work row)")
        ref = next((g for g in grads if g is not None), None)
        if ref is None:
            raise ValueError("flatten needs at least one gradient that is not None")
        batch = tuple(ref.shape[:batch_dims])
        if out is None:
            dtype = torch.promote_types(ref.dtype, torch.float32)
            # Every column is written below (missing gradients as zeros): no need to zero first.
            out = torch.empty(*batch, self.dim, dtype=dtype, device=ref.device)
            index = None
        elif index is not None and batch_dims != 1:
            raise ValueError("flatten: index needs batch_dims == 1")
        for slot, g in zip(self.slots, grads, strict=True):
            cols = out[..., slot.offset : slot.offset + slot.size]
            if index is None:
                if g is None:
                    cols.zero_()
                else:
                    cols.copy_(g.reshape(*batch, slot.size))
            else:
                value = (
                    torch.zeros((len(index), slot.size), dtype=out.dtype, device=out.device)
                    if g is None
                    else g.reshape(len(index), slot.size).to(out.dtype)
                )
                cols.index_copy_(0, index, value)
        return out

    def unflatten(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split rows ``(*batch, dim)`` into views shaped like each parameter."""
        batch = rows.shape[:-1]
        return {s.name: rows[..., s.offset : s.offset + s.size].reshape(*batch, *s.shape) for s in self.slots}

    def to_list(self) -> list[dict]:
        return [s.to_dict() for s in self.slots]

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        return f"ParamLayout({len(self.slots)} params, dim={self.dim})"

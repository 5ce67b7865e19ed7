"""A unit's matrix: the part of a gradient row that one layer's weight and bias make.

Holds ``OuterMatrix`` — a unit's matrix ``M`` (weight and bias) from full rows, from one part's
per-class gradients (``part_matrix``) or both (``joined``), and its projection (``map_matrix``,
``map_part``), shared by every structure's units (``kronecker.KroneckerUnit``, the sketch
units); and ``SketchedMatrix`` — what ``layer_rules.sketch_sums`` applies of a TensorSketch unit
(``chunked_sketch.ChunkedSketchUnit``, ``tensor_sketch.SketchUnit``), whatever its placement;
and ``work_slots`` — where the hook path writes the parameters of a map with units, the layout
every such map shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from classgrad.store.core.params import ParamSlot


def work_slots(
    slots: Sequence[ParamSlot], units: Sequence[Any], rest: Sequence[ParamSlot], units_width: int
) -> list[ParamSlot]:
    """Where the hook path writes each of ``slots`` for a map with ``units`` (each with
    ``weight``, ``bias``, ``offset`` and ``width``: a ``layer_rules.rule_io.ProjectionUnit``): a
    unit's weight its ``width`` columns at its ``offset`` (a TensorSketch's units all the same
    columns, into which each adds), its bias none (it joined the weight), every other parameter
    (``rest``) its full columns after the units' ``units_width``."""
    place: dict[str, ParamSlot] = {}
    for u in units:
        place[u.weight.name] = ParamSlot(u.weight.name, (u.width,), u.offset, u.width)
        if u.bias is not None:
            place[u.bias.name] = ParamSlot(u.bias.name, (0,), u.offset + u.width, 0)
    offset = units_width
    for s in rest:
        place[s.name] = ParamSlot(s.name, s.shape, offset, s.size)
        offset += s.size
    return [place[s.name] for s in slots]


class OuterMatrix:
    """A unit's matrix ``M``: its weight, with the bias as a constant-1 input feature (a column of
    ``[W | b]``, or a row of ``[W; b^T]`` where the stored matrix's first axis is the input); what
    every structure's unit shares (``KroneckerUnit``, ``tensor_sketch.SketchUnit``)."""

    weight: ParamSlot
    bias: ParamSlot | None
    a: int
    b: int
    input_first: bool

    @property
    def rows(self) -> int:
        """Rows of ``M``: ``a``, plus the bias row of an ``input_first`` unit."""
        return self.a + (self.bias is not None and self.input_first)

    @property
    def cols_in(self) -> int:
        """Columns of ``M``: ``b``, plus the bias column of the others."""
        return self.b + (self.bias is not None and not self.input_first)

    @property
    def full(self) -> int:
        return self.rows * self.cols_in

    def matrices(self, full: torch.Tensor) -> torch.Tensor:
        """``[n, rows, cols_in]``: the unit's ``M`` from full rows ``[n, D]`` (layout order)."""
        n = full.shape[0]
        w = self.weight
        m = full[:, w.offset : w.offset + w.size].reshape(n, self.a, self.b)
        if self.bias is not None and self.input_first:  # [W; b^T]
            bias = full[:, self.bias.offset : self.bias.offset + self.bias.size].reshape(n, 1, self.b)
            m = torch.cat([m, bias], dim=1)
        elif self.bias is not None:  # [W | b]
            bias = full[:, self.bias.offset : self.bias.offset + self.bias.size].reshape(n, self.a, 1)
            m = torch.cat([m, bias], dim=2)
        return m

    def column_order(self, channels: int) -> torch.Tensor:
        """int64 ``[cols_in]``: the column of ``M`` held by each column of a matrix whose weight
        columns are kernel-offset-major with ``channels`` channels innermost (a convolution's
        ``patches_channels_inner``; ``M``'s own order is channel-major), the bias column last."""
        order = torch.arange(self.b).view(channels, self.b // channels).t().reshape(-1)
        return torch.cat([order, torch.arange(self.b, self.cols_in)])

    def matrix_record(self) -> dict[str, Any]:
        """What a store records of the unit's matrix (its structure adds its own fields)."""
        out: dict[str, Any] = {
            "param": self.weight.name,
            "bias": self.bias.name if self.bias is not None else None,
            "shape": [self.a, self.b],
            "matrix_shape": [self.rows, self.cols_in],
        }
        if self.input_first:
            out["input_first"] = True
        return out

    def map_matrix(self, m: torch.Tensor) -> torch.Tensor:
        """``[k, width]``: the unit's projection of per-class matrices ``m`` ``[k, rows, cols_in]``."""
        raise NotImplementedError

    def map_part(self, part: str, value: torch.Tensor) -> torch.Tensor:
        """``[k, width]``: the projection of per-class gradients ``value`` of the weight or the bias
        alone (the other zero), for a gradient another path formed whole."""
        return self.map_matrix(self.part_matrix(part, value))

    def joined(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``[k, rows, cols_in]``: ``M`` from per-class gradients of its weight and its bias."""
        k = weight.shape[0]
        m = weight.reshape(k, self.a, self.b)
        if self.input_first:  # [W; b^T]
            return torch.cat([m, bias.reshape(k, 1, self.b).to(m.dtype)], dim=1)
        return torch.cat([m, bias.reshape(k, self.a, 1).to(m.dtype)], dim=2)

    def part_matrix(self, part: str, value: torch.Tensor) -> torch.Tensor:
        """``[k, rows, cols_in]``: ``M`` with only its weight, or only its bias, filled from the
        per-class gradients ``value`` (for a gradient another path formed whole)."""
        k = value.shape[0]
        m = value.new_zeros(k, self.rows, self.cols_in)
        if part == "weight":
            m[:, : self.a, : self.b] = value.reshape(k, self.a, self.b)
        elif self.input_first:  # [W; b^T]
            m[:, self.a, :] = value.reshape(k, self.b)
        else:  # [W | b]
            m[:, :, self.b] = value.reshape(k, self.a)
        return m


class SketchedMatrix(OuterMatrix):
    """A unit whose matrix is sketched into ``dim`` columns, and the ways the layer rules apply it:
    per token in the frequency domain (``token_spectra``, summed per class, then
    ``from_spectra``), from per-class matrices (``sketch``), and from single entries
    (``entry_columns`` or ``entry_index``, added into ``chunk_pairs * dim`` columns, then
    ``combine``)."""

    dim: int
    nonzeros: int

    @property
    def row_chunks(self) -> int:
        """Chunks of ``dim`` rows of ``M`` (1: every row in one)."""
        return 1

    @property
    def col_chunks(self) -> int:
        """Chunks of ``dim`` columns of ``M``."""
        return 1

    @property
    def chunk_pairs(self) -> int:
        """``row_chunks * col_chunks``: the width of ``entry_columns``' space is this times ``dim``."""
        return self.row_chunks * self.col_chunks

    def token_spectra(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """Factors ``[T, rows]``, ``[T, cols_in]`` per token -> complex ``[T, dim // 2 + 1]``: the
        rfft of each token's image (the sketch of its outer product)."""
        raise NotImplementedError

    def from_spectra(self, sums: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-class sums of ``token_spectra`` -> ``[n, dim]`` (into ``out``)."""
        rows = torch.fft.irfft(sums, n=self.dim, dim=1)
        return rows if out is None else out.copy_(rows)

    def entry_columns(
        self, i: torch.Tensor, j: torch.Tensor, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(col, negative)`` of entries ``(i, j)`` (broadcast): int64 columns in ``[0,
        chunk_pairs * dim)`` and bool signs (True: -1)."""
        raise NotImplementedError

    def entry_index(self, device: torch.device | str) -> torch.Tensor | None:
        """int32 ``[1, rows, cols_in]``: every entry's column plus ``chunk_pairs * dim`` when its sign
        is negative, for tables small enough to keep; else None."""
        raise NotImplementedError

    def combine(self, pairs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, chunk_pairs * dim]`` entries added at their columns -> ``[n, dim]``: with one chunk
        pair, the columns as they are (a unit of several overrides this)."""
        if self.chunk_pairs != 1:
            raise NotImplementedError
        return pairs if out is None else out.copy_(pairs)

    def sketch(
        self, matrices: torch.Tensor, out: torch.Tensor | None = None, *, channels_inner: int | None = None
    ) -> torch.Tensor:
        """``[n, rows, cols_in]`` per-class matrices -> ``[n, dim]`` (``channels_inner``: their
        columns in ``column_order`` of it)."""
        raise NotImplementedError

    def map_matrix(self, m: torch.Tensor) -> torch.Tensor:
        """``[k, dim]``: the sketch of per-class matrices ``m`` (``sketch``)."""
        return self.sketch(m)

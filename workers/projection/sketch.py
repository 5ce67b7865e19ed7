"""Sparse sign Johnson-Lindenstrauss sketch of rows: each coordinate sent to a few columns with random signs.

Holds ``SparseSignSketch`` (projects rows ``[n, D]`` to ``[n, k]``: the ``rest: sketch`` of a
Kronecker projection and the rest of a TensorSketch one), ``RowSketch`` (the same for whole
finished rows, ``projection.structure: sketch``, with its store record), ``SKETCH_GROUP`` (its
stream group), ``sketch_blocks`` (how the ``k`` columns are split into ``s`` blocks), and the two
ways every sparse sign map of this package is applied: ``sign_matrix`` / ``sparse_apply`` (a
cached sparse CSR matrix, one sparse product) and ``signed_scatter`` (indexed adds, for maps too
large to keep).

The map (Kane and Nelson's sparse JL, "block" construction; CountSketch when ``s = 1``). The
``k`` output columns are split into ``s`` blocks, block ``b`` being columns ``[k b // s, k (b +
1) // s)``. Coordinate ``j`` of the row goes to one column of every block, with its own sign::

    w_b  = W[j, b]                               # word b of row j of the stream (seed, group)
    c_b  = start_b + ((w_b >> 1) * size_b) >> 31 # a column of block b (the top 31 bits, scaled)
    sign = -1 if w_b & 1 else +1
    out[c_b] += sign * x[j] / sqrt(s)           for b in 0 .. s - 1

``W`` is the counter-based word stream of ``classgrad.workers.projection`` (``stream_words`` on
``stream_keys(seed, group)``), integer operations that give the same bits on every device, so
the buckets and signs are reproducible from ``(seed, group, k, s)`` alone. The ``s`` columns of
one coordinate are distinct (one per block), every entry of the implied ``[D, k]`` matrix has
mean 0 and ``sum_c S[j, c]^2 = 1``, and distinct coordinates are independent: ``E[<Sx, Sy>] =
<x, y>``, with a variance that for ``s`` of a few is that of a dense projection to ``k``
columns up to a term in ``sum_j x_j^2 y_j^2`` (rows whose mass sits on a few coordinates), which
``s > 1`` spreads over more columns.

Cost: ``s`` additions per coordinate and row (``s D`` per row instead of a dense ``2 D k``
flops). On a CPU, ``index_add_`` along the first dimension of a ``[2 k, n]`` accumulator (rows
as columns: every coordinate adds one contiguous run of ``n`` values) is an order of magnitude
faster than along the column dimension of ``[n, k]`` with the signs multiplied in. So the sign
is folded into the index (negative coordinates land in the accumulator's second half, which is
subtracted at the end) and the row is transposed in chunks of ``CHUNK`` coordinates.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from classgrad.service.errors import ConfigError, InputError
from classgrad.workers.projection.dense import HASH_NAME, stream_keys, stream_words

SKETCH_GROUP = 1 << 30  # stream group of the sketch: far from a dense projection's 0, 1, ... and GROUP_BASE
CHUNK = 2048  # coordinates transposed and scattered at once (measured: 1k-4k best on a CPU)
# Indices (int32) kept per device when D * s is at most this (128 MiB), else regenerated per call:
# hashing them costs more than the sketch itself (whole ViT rows of 2.9M entries, s = 4, sketched
# 16 rows at a time with the indices regenerated: 57 ms per row; kept and gathered: 23 ms).
CACHE_ENTRIES = 1 << 25
SPARSE_DTYPES = (torch.float32, torch.float64)  # what torch's sparse product takes on every device


def sketch_blocks(k: int, s: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each of the ``s`` blocks of ``k`` columns (sizes differ by at most one)."""
    return [(k * b // s, k * (b + 1) // s - k * b // s) for b in range(s)]


IndexFn = Callable[[int, int, torch.device], torch.Tensor]


def signed_scatter(rows: torch.Tensor, index_of: IndexFn, dim: int, nonzeros: int, scale: float) -> torch.Tensor:
    """``[n, D]`` -> ``[n, dim]``: coordinate ``j`` of every row added, times ``scale``, to the
    ``nonzeros`` accumulator columns ``index_of(c0, c1, device)[j - c0]`` (int32 ``[c1 - c0, s]``;
    a column plus ``dim`` is subtracted instead). In chunks of ``CHUNK`` coordinates, transposed so
    that every coordinate adds one contiguous run of ``n`` values (see the module docstring)."""
    rows = rows.detach()
    n, width, device = rows.shape[0], rows.shape[1], rows.device
    acc = torch.zeros(2 * dim, n, dtype=rows.dtype, device=device)
    with torch.no_grad():
        for c0 in range(0, width, CHUNK):
            c1 = min(width, c0 + CHUNK)
            index = index_of(c0, c1, device)
            part = rows[:, c0:c1].t().contiguous()  # [chunk, n]: one contiguous run per coordinate
            for b in range(nonzeros):
                acc.index_add_(0, index[:, b], part)
        out = (acc[:dim] - acc[dim:]).mul_(scale)
    return out.t().contiguous()


def sign_matrix(cols: torch.Tensor, negative: torch.Tensor, dim: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The map as a sparse CSR ``[dim, D]`` matrix (``cols``, ``negative``: ``[D, s]``, distinct
    columns per coordinate): ``S @ rows^T`` is the sketch. One sparse product reads each row
    once; the scatter reads it ``s`` times (measured ~4x faster on a 2-core CPU)."""
    D, s = cols.shape
    buckets = cols.reshape(-1)
    # Rows of the CSR matrix are buckets: entries sorted by bucket (stable: coordinates ascending
    # within one), row pointers from the bucket counts. No COO coalesce (a sort of index pairs).
    order = torch.argsort(buckets, stable=True)
    crow = torch.zeros(dim + 1, dtype=torch.int64, device=cols.device)
    crow[1:] = torch.cumsum(torch.bincount(buckets, minlength=dim), 0)
    coords = torch.div(order, s, rounding_mode="floor")
    values = torch.full((D * s,), scale, dtype=dtype, device=cols.device).masked_fill_(negative.reshape(-1), -scale)
    with warnings.catch_warnings():  # torch's "CSR support is in beta": products with dense are stable
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, coords, values[order], (dim, D), check_invariants=False)


def sparse_apply(matrix: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[n, D]`` rows through a CSR ``[dim, D]`` matrix: ``[n, dim]``."""
    with torch.no_grad():
        return torch.sparse.mm(matrix, rows.detach().t().contiguous()).t().contiguous()


class SparseSignSketch:
    """Rows ``[n, dim_in]`` -> ``[n, dim]``: ``nonzeros`` signed entries ``±1/sqrt(nonzeros)`` per
    coordinate, one in each block of columns (see the module docstring). ``nonzeros`` above
    ``dim`` is lowered to ``dim`` (one column per block)."""

    def __init__(self, dim_in: int, dim: int, *, nonzeros: int = 4, seed: int = 0, group: int = SKETCH_GROUP):
        if dim_in < 1 or dim < 1 or nonzeros < 1:
            raise ConfigError(f"sketch needs positive sizes, got dim_in={dim_in}, dim={dim}, nonzeros={nonzeros}")
        self.dim_in, self.dim, self.seed, self.group = dim_in, dim, seed, group
        self.nonzeros = min(nonzeros, dim)
        self.blocks = sketch_blocks(dim, self.nonzeros)
        self.scale = 1.0 / math.sqrt(self.nonzeros)
        self._keys = stream_keys(seed, group)
        self._cache: dict[str, torch.Tensor] = {}

    def columns(self, start: int, stop: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cols, negative)`` of coordinates ``[start, stop)``: int64 ``[stop - start, s]`` columns
        and bool signs (True: -1), bit-identical on every device."""
        words = stream_words(self._keys, start, stop, self.nonzeros, torch.device(device))
        starts = torch.tensor([b[0] for b in self.blocks], dtype=torch.int64, device=words.device)
        sizes = torch.tensor([b[1] for b in self.blocks], dtype=torch.int64, device=words.device)
        # (w >> 1) < 2^31 and size < 2^31: the product stays below 2^62 (exact in int64).
        cols = ((words >> 1) * sizes >> 31) + starts
        return cols, (words & 1).bool()

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The implied dense ``[dim_in, dim]`` matrix (for checks on small sizes only)."""
        cols, neg = self.columns(0, self.dim_in)
        out = torch.zeros(self.dim_in, self.dim, dtype=dtype)
        values = torch.full(cols.shape, self.scale, dtype=dtype).masked_fill_(neg, -self.scale)
        out.scatter_(1, cols, values)  # distinct columns per coordinate: nothing overwritten
        return out

    def _indices(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Accumulator rows ``[stop - start, s]`` (int32): the column, plus ``dim`` when negative."""
        cols, neg = self.columns(start, stop, device)
        return (cols + neg.long() * self.dim).to(torch.int32)

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, dim_in]`` -> ``[n, dim]`` in ``rows``' dtype and device (not differentiable)."""
        if rows.dim() != 2 or rows.shape[1] != self.dim_in:
            raise InputError(f"rows must have shape [n, {self.dim_in}], got {list(rows.shape)}")
        if self.dim_in * self.nonzeros <= CACHE_ENTRIES and rows.dtype in SPARSE_DTYPES:
            key = f"csr:{rows.device}:{rows.dtype}"
            if key not in self._cache:
                cols, neg = self.columns(0, self.dim_in, rows.device)
                self._cache[key] = sign_matrix(cols, neg, self.dim, self.scale, rows.dtype)
            return sparse_apply(self._cache[key], rows)
        return signed_scatter(rows, self._indices, self.dim, self.nonzeros, self.scale)

    def describe(self) -> dict[str, Any]:
        """What a store records: enough to regenerate every bucket and sign."""
        return {
            "map": "sparse-sign",
            "nonzeros": self.nonzeros,
            "group": self.group,
            "seed": self.seed,
            "blocks": [list(b) for b in self.blocks],
            "scale": self.scale,
            "hash": HASH_NAME,
        }


class RowSketch(SparseSignSketch):
    """``projection.structure: sketch``: whole finished rows sketched (in place of a dense
    projection: ``s D`` additions per row instead of ``2 D k`` flops), with the store's record."""

    @property
    def out_dim(self) -> int:
        return self.dim

    def describe(self) -> dict[str, Any]:
        return {
            "structure": "sketch",
            "kind": "sparse-sign",
            "dim": self.dim,
            "out_dim": self.dim,
            "dim_in": self.dim_in,
            **super().describe(),
        }

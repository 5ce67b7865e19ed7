"""Sparse sign Johnson-Lindenstrauss sketch of rows: each coordinate sent to a few columns with random signs.

Holds ``SparseSignSketch`` (projects rows ``[n, D]`` to ``[n, k]``: the ``rest: sketch`` of a
Kronecker projection and the rest of a TensorSketch one), ``RowSketch`` (the same for whole
finished rows, ``projection.structure: sketch``, with its store record), ``SKETCH_GROUP`` (its
stream group), ``sketch_blocks`` (how the ``k`` columns are split into ``s`` blocks), and the two
way every sparse sign map of this package is applied: ``SignedMap`` (indexed adds along the
columns, on a CPU; a cached sparse CSR product, ``sign_matrix`` / ``sparse_apply``, where adds
are unordered).

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
flops). Applying the map is ``s`` indexed adds (``SignedMap``): for rows wider than
``SIGNED_VALUES_WIDTH`` times ``k`` the sign is folded into the index (negative coordinates land
in an accumulator's second half, which is subtracted at the end: no pass over the rows), for
narrower ones multiplied into a copy of the values (no ``[n, 2k]`` accumulator to zero and
subtract, which there costs more than the rows' own entries).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from classgrad.errors import ConfigError, InputError
from classgrad.workers.projection.dense.dense_projector import HASH_NAME, stream_keys, stream_words

SKETCH_GROUP = 1 << 30  # stream group of the sketch: far from a dense projection's 0, 1, ... and GROUP_BASE
# Coordinates hashed and added at once when the index is not kept (measured on a 2-core CPU: 64k
# coordinates amortise the per-call costs; the hash dominates either way).
CHUNK = 1 << 16
# Indices (int64) kept per device when D * s is at most this (256 MiB), else regenerated per call:
# hashing them costs more than the sketch itself (whole ViT rows of 2.9M entries, s = 4, sketched
# 16 rows at a time with the indices regenerated: 57 ms per row; kept: 23 ms).
CACHE_ENTRIES = 1 << 25
# Rows at most this many times ``dim`` wide are sketched with the signs multiplied into their
# values; wider ones with the signs folded into the index (``SignedMap``). Measured on a 2-core
# CPU, ``dim`` 4,096, s = 1, against the folded route: 257 columns 0.36x its time, 2,304 0.50x,
# 10,000 0.99x (``python -m benchmarks.sketch_kernels --section sign``); 16,640 1.03x and
# 36,928 1.27x in a scratch run (the benchmark times the route each width takes).
SIGNED_VALUES_WIDTH = 3
SPARSE_DTYPES = (torch.float32, torch.float64)  # what torch's sparse product takes on every device
# Devices whose ``index_add_`` adds in index order (the CPU's): same bits on every run. Elsewhere
# (CUDA: atomic adds, order not fixed) a kept index is applied as a sparse CSR product instead.
ORDERED_ADD_DEVICES = ("cpu",)


def sketch_blocks(k: int, s: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each of the ``s`` blocks of ``k`` columns (sizes differ by at most one)."""
    return [(k * b // s, k * (b + 1) // s - k * b // s) for b in range(s)]


# ``columns_of(start, stop, device)``: ``(cols, negative)`` of coordinates ``[start, stop)``,
# int64 ``[stop - start, s]`` output columns (one per block) and bool signs (True: -1).
ColumnsFn = Callable[[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]


def folded_index(cols: torch.Tensor, negative: torch.Tensor, dim: int) -> torch.Tensor:
    """int64 ``[s, c]``: each coordinate's accumulator column per block, plus ``dim`` when its
    sign is negative (that half is subtracted at the end: no product with the signs)."""
    return (cols + negative.long() * dim).t().contiguous()


def sign_matrix(cols: torch.Tensor, negative: torch.Tensor, dim: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The map as a sparse CSR ``[dim, D]`` matrix (``cols``, ``negative``: ``[D, s]``, distinct
    columns per coordinate): ``S @ rows^T`` is the sketch, in a fixed order on every device."""
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


class SignedMap:
    """A sparse sign map of ``width`` coordinates into ``dim`` columns, ``scale`` per entry,
    applied to rows ``[n, width]`` (the one place every sparse sign map of this package is applied).

    On a CPU every block is one ``index_add_`` along the columns of an ``[n, 2 dim]``
    accumulator, the index kept per device (``CACHE_ENTRIES``) or regenerated per ``CHUNK`` of
    coordinates; rows at most ``SIGNED_VALUES_WIDTH * dim`` wide are added, signed, into ``[n,
    dim]`` instead. Against one CSR product (which needs the rows transposed, then its result),
    ``python -m benchmarks.sketch_kernels --section sign`` on a 2-core CPU: 7-9x faster with
    ``s = 1`` (128 rows of 300k coordinates: 36 ms against 252 ms), 1.3-2.4x with ``s = 4``; the
    same bits at any thread count.
    """

    def __init__(self, width: int, dim: int, nonzeros: int, scale: float, columns_of: ColumnsFn):
        self.width, self.dim, self.nonzeros, self.scale = width, dim, nonzeros, scale
        self.columns_of = columns_of
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def kept(self) -> bool:
        return self.width * self.nonzeros <= CACHE_ENTRIES

    def apply(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, width]`` -> ``[n, dim]`` in ``rows``' dtype and device (not differentiable);
        written into ``out`` (``[n, dim]``, any strides: a view of the rows) when given."""
        rows = rows.detach()
        device = rows.device
        with torch.no_grad():
            if self.kept and device.type not in ORDERED_ADD_DEVICES and rows.dtype in SPARSE_DTYPES:
                key = f"csr:{device}:{rows.dtype}"
                if key not in self._cache:
                    cols, neg = self.columns_of(0, self.width, device)
                    self._cache[key] = sign_matrix(cols, neg, self.dim, self.scale, rows.dtype)
                found = sparse_apply(self._cache[key], rows)
                return found if out is None else out.copy_(found)
            if self.kept and self.width <= SIGNED_VALUES_WIDTH * self.dim:
                return self._add_signed(rows, out)
            acc = rows.new_zeros(rows.shape[0], 2 * self.dim)
            if self.kept:
                key = f"index:{device}"
                if key not in self._cache:
                    self._cache[key] = folded_index(*self.columns_of(0, self.width, device), self.dim)
                self._add(acc, self._cache[key], rows)
            else:
                for c0 in range(0, self.width, CHUNK):
                    c1 = min(self.width, c0 + CHUNK)
                    self._add(acc, folded_index(*self.columns_of(c0, c1, device), self.dim), rows[:, c0:c1])
            return torch.sub(acc[:, : self.dim], acc[:, self.dim :], out=out).mul_(self.scale)

    def _add_signed(self, rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Rows no wider than a few times ``dim``: each block's signed copy of the rows added into
        ``[n, dim]`` (no ``[n, 2 dim]`` accumulator to zero and subtract: that costs more than the
        rows' own entries there)."""
        key = f"signed:{rows.device}:{rows.dtype}"
        if key not in self._cache:
            cols, negative = self.columns_of(0, self.width, rows.device)
            signs = torch.full(cols.shape, self.scale, dtype=rows.dtype, device=rows.device)
            self._cache[key] = cols.t().contiguous()
            self._cache[f"{key}:values"] = signs.masked_fill_(negative, -self.scale).t().contiguous()
        cols, signs = self._cache[key], self._cache[f"{key}:values"]
        found = rows.new_zeros(rows.shape[0], self.dim) if out is None else out.zero_()
        for block, sign in zip(cols, signs):
            found.index_add_(1, block, rows * sign)
        return found

    @staticmethod
    def _add(acc: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
        for block in index:
            acc.index_add_(1, block, rows)


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
        self.signed = SignedMap(dim_in, dim, self.nonzeros, self.scale, self.columns)

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

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, dim_in]`` -> ``[n, dim]`` in ``rows``' dtype and device (not differentiable)."""
        if rows.dim() != 2 or rows.shape[1] != self.dim_in:
            raise InputError(f"rows must have shape [n, {self.dim_in}], got {list(rows.shape)}")
        return self.signed.apply(rows)

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

    def buffers(self) -> list[tuple[str, int, str]]:
        """Its int32 indices, cached up to ``CACHE_ENTRIES``, for the footprint."""
        return [("sketch indices", min(self.dim_in * self.nonzeros, CACHE_ENTRIES) * 4, "projection.sketch_nonzeros")]

    def describe(self) -> dict[str, Any]:
        return {
            "structure": "sketch",
            "kind": "sparse-sign",
            "dim": self.dim,
            "out_dim": self.dim,
            "dim_in": self.dim_in,
            **super().describe(),
        }

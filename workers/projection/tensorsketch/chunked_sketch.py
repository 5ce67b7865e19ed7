"""The default TensorSketch unit: each axis placed without collisions in chunks of ``dim``, the
chunks mixed by random-phase filters (``placement: chunked``).

Holds ``ChunkedSketchUnit`` — one outer-product layer's ``[W | b]`` matrix ``M`` (``rows x
cols_in``) mapped into the ``dim`` columns every unit adds into, with the three ways the layer
rules apply it (``outer_matrix.SketchedMatrix``): per token in the frequency domain
(``token_spectra``: ``layer_rules.sketch_sums``' fft route), from each class's formed matrix
(``sketch``) and from single entries (``entry_columns`` / ``entry_index`` then ``combine``: an
embedding's lookups); ``PLACEMENT`` (the name a store records), ``HASHED`` (the placement of
stores that record none), ``GROUPS_PER_UNIT``, ``ENTRY_TABLE_ENTRIES`` (the largest matrix whose
entries' columns are kept as one table) and ``SPECTRA_BYTES`` (how many row chunks a GPU's fft
route takes at once).

Why not a hash per axis (``tensor_sketch.SketchUnit``, the ``hashed`` placement of stores made
before this one): entry ``(i, j)`` went to column ``h1(i) + h2(j) mod dim``, so two rows with the
same ``h1`` sent their whole rows to the same shifted copy of one sketch. A classifier head's
per-class gradient sits almost all on its own row (``g ~ -e_c``) and penultimate features
correlate between classes, so each such collision gave two unrelated classes a cosine near their
features' cosine (0.6-0.8): at C = 10,000 and ``dim`` 4,096 most classes had a false nearest
neighbour (issue 44). A collision of whole rows or columns is what must never happen.

The map. Row ``i`` of ``M`` is in row chunk ``a = i // dim`` at place ``p = i % dim`` (in order),
sign ``s1(i)``; column ``j`` is in column chunk ``b = j // dim`` at place ``pi_a(j % dim)``, sign
``s2_a(j)``: a seeded permutation of ``[0, dim)`` and column signs drawn for each row chunk
``a``. Entry ``(i, j)`` goes to place ``(p + pi_a(q)) mod dim`` of chunk pair ``(a, b)`` with
sign ``s1(i) s2_a(j)``, and chunk pair ``(a, b)`` is filtered by ``F_ab``: the all-pass filter
whose frequency response is ``phi_a(f) psi_b(f)``, random unit phases (real +-1 at frequency 0
and ``dim / 2``), ``phi_0 = psi_0 = 1``. The unit's columns are the sum over chunk pairs. So:

- every entry's image has norm 1 and entries of one row, or of one column, of a chunk pair never
  share a column (the places are distinct); two entries share one with chance ``1/dim``, as in a
  CountSketch, with independent signs: the map is unbiased;
- rows (or columns) of different chunks meet only through a random all-pass filter: their
  images have inner products of order ``1/sqrt(dim)`` with a Gaussian-like tail, never 1 (an
  all-pass filter keeps norms, so nothing is lost);
- the columns' own places and signs per row chunk: with one set for all, two head rows in
  different chunks met through the same sketch of their (correlated) features, whose power
  spectrum fluctuates, and their cosine error's spread was 1.2x a CountSketch's (C = 10,000,
  ``dim`` 1,024, a synthetic 256-wide head; 1.0x with a set per row chunk);
- a layer no wider than ``dim`` on both axes is one chunk pair, no filter: each entry one signed
  column, no FFT outside the fft route;
- on a token, ``M = g x^T``, the image is a sum of circular convolutions of the two factors'
  placed vectors, filtered: in the frequency domain ``sum_a phi_a rfft(g_a) (sum_b psi_b
  rfft(x_b placed for a))`` (``token_spectra``; Pham and Pagh, KDD 2013, for one chunk pair). A
  class's sum over its tokens is a sum of such products: its matrix never exists.

Streams: group ``TS_GROUP_BASE + GROUPS_PER_UNIT u`` (``u`` the weight's index in the layout) and
the next three: the row signs, the column signs (word ``a * cols_in + j``), the permutations
(argsort of the words ``a * dim`` to ``(a + 1) * dim``) and the phases (word ``c * (dim // 2 + 1)
+ f`` for chunk ``c``, the row chunks first, then the column chunks). Phases are computed in
float64 on the CPU and cast, so every device filters alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.projection.dense.dense_projector import stream_keys, stream_words
from classgrad.workers.projection.outer_matrix import SketchedMatrix
from classgrad.workers.projection.sketch.row_sketch import SignedMap

PLACEMENT = "chunked"
HASHED = "hashed"  # the placement of stores made before this one (their record has none)
GROUPS_PER_UNIT = 4
TS_GROUP_BASE = 3 << 29  # as tensor_sketch's: clear of 0.., SKETCH_GROUP (2^30) and 2^31..
# Entries of a unit's matrix up to which its folded columns are kept as one int32 table (64 MiB),
# both placements: bag_text's 2,000 x 128 EmbeddingBag sketched 4x faster from it (8.1 against
# 2.0 ms a run of 124 classes, 4k lookups; scratch timing). BERT-base's 30,522 x 768 table hashes
# per call.
ENTRY_TABLE_ENTRIES = 1 << 24
# Work buffers of one batched step of ``token_spectra`` off the CPU's routes: how many row chunks
# of a wide head go at once (256 tokens, dim 4,096, float32: 12 chunks; launches are what a GPU pays
# for). A CPU takes one chunk at a time: batched, its blocks fall out of cache, 1.3-3.0x the
# time at 2 to 25 chunks (``python -m benchmarks.sketch_kernels --section spectra``).
SPECTRA_BYTES = 256 << 20


def _words(seed: int, group: int, count: int) -> torch.Tensor:
    return stream_words(stream_keys(seed, group), 0, count, 1, "cpu")[:, 0]


def _phases(words: torch.Tensor, dim: int) -> torch.Tensor:
    """complex128 ``[chunks, dim // 2 + 1]`` unit phases from words ``[chunks, dim // 2 + 1]``; real
    +-1 at frequency 0 and, for an even ``dim``, ``dim / 2`` (what the rfft of a real signal has)."""
    angle = words.to(torch.float64) * (2 * math.pi / 2**32)
    out = torch.polar(torch.ones_like(angle), angle)
    real = [0] + ([dim // 2] if dim % 2 == 0 else [])
    out[:, real] = torch.where((words[:, real] & 1) == 1, -1.0, 1.0).to(out.dtype)
    out[0] = 1  # the first chunk is not filtered
    return out


@dataclass
class ChunkedSketchUnit(SketchedMatrix):
    """One layer's weight (+ bias) sketched into ``dim`` work columns at ``offset`` (module docstring)."""

    index: int
    weight: ParamSlot
    bias: ParamSlot | None
    a: int
    b: int
    input_first: bool
    dim: int
    seed: int
    offset: int = 0  # of its columns in the work row: 0, the columns every unit adds into
    structure: str = "tensorsketch"  # what layer_rules dispatch on
    nonzeros: int = 1  # signed entries per coordinate and chunk pair (the route costs read it)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        return self.dim

    @property
    def groups(self) -> tuple[int, ...]:
        first = TS_GROUP_BASE + GROUPS_PER_UNIT * self.index
        return tuple(range(first, first + GROUPS_PER_UNIT))

    @property
    def row_chunks(self) -> int:
        return -(-self.rows // self.dim)

    @property
    def col_chunks(self) -> int:
        return -(-self.cols_in // self.dim)

    # --- the map's parts, generated once per device -------------------------------------------

    def _cpu(self) -> dict[str, torch.Tensor]:
        if "cpu" not in self._cache:
            g_row, g_col, g_perm, g_phase = self.groups
            freqs = self.dim // 2 + 1
            chunks = self.row_chunks + self.col_chunks
            phases = _phases(_words(self.seed, g_phase, chunks * freqs).view(chunks, freqs), self.dim)
            # One permutation and one set of column signs per row chunk: [row_chunks, ...].
            perms = torch.argsort(_words(self.seed, g_perm, self.row_chunks * self.dim).view(-1, self.dim), stable=True)
            j = torch.arange(self.cols_in)
            i = torch.arange(self.rows)
            self._cache["cpu"] = {
                "neg1": (_words(self.seed, g_row, self.rows) & 1).bool(),
                "neg2": (_words(self.seed, g_col, self.row_chunks * self.cols_in) & 1).bool().view(-1, self.cols_in),
                "row_place": i % self.dim,
                "row_chunk": i // self.dim,
                "col_place": perms[:, j % self.dim],
                "col_chunk": j // self.dim,
                "phi": phases[: self.row_chunks],
                "psi": torch.cat([phases[:1], phases[self.row_chunks + 1 :]]),
            }
        return self._cache["cpu"]

    def _on(self, name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
        key = f"{name}:{device}:{dtype}"
        if key not in self._cache:
            t = self._cpu()[name]
            if dtype is not None and name in ("phi", "psi"):
                t = t.to(torch.complex128 if dtype == torch.float64 else torch.complex64)
            elif dtype is not None:
                t = torch.where(t, -1.0, 1.0).to(dtype)
            self._cache[key] = t.to(device)
        return self._cache[key]

    def filters(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """complex ``[chunk_pairs, dim // 2 + 1]``: ``phi_a psi_b`` of pair ``a * col_chunks + b``."""
        key = f"filters:{device}:{dtype}"
        if key not in self._cache:
            phi, psi = self._on("phi", "cpu", dtype), self._on("psi", "cpu", dtype)
            self._cache[key] = (phi[:, None] * psi[None]).reshape(self.chunk_pairs, -1).to(device)
        return self._cache[key]

    # --- the fft route: each token's image in the frequency domain ------------------------------

    def token_spectra(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """Factors ``[T, rows]`` and ``[T, cols_in]`` per token -> complex ``[T, dim // 2 + 1]``: the
        rfft of each token's image ``sum_a phi_a rfft(g_a) (sum_b psi_b rfft(x_b placed for a))``,
        on a GPU's routes as many row chunks at a time as ``SPECTRA_BYTES`` of work buffers hold,
        each group one batched rfft of each factor, not two per chunk (C = 1,000,000 is 245
        chunks); on a CPU's one at a time (memory ``[T, col_chunks * dim]`` whatever the head's
        width)."""
        device, dtype = first.device, first.dtype
        g = first * self._on("neg1", device, dtype)
        cpu = self._cpu()
        key = f"col_index:{device}"
        if key not in self._cache:  # [row_chunks, cols_in]: each column's place for each row chunk
            self._cache[key] = (cpu["col_chunk"] * self.dim + cpu["col_place"]).to(device)
        places, signs = self._cache[key], self._on("neg2", device, dtype)
        phi, psi = self._on("phi", device, dtype), self._on("psi", device, dtype)
        tokens, dim, width = g.shape[0], self.dim, self.col_chunks * self.dim
        # A row chunk's buffers, in g's elements a token: g's block and its spectra (2 dim), x
        # placed, its spectra and their product with psi (3 width), the signed copy of x.
        per_chunk = max(tokens, 1) * g.element_size() * (2 * dim + 3 * width + self.cols_in)
        step = 1 if rule_io.cpu_routes(device) else max(1, SPECTRA_BYTES // per_chunk)
        out = None
        for a0 in range(0, self.row_chunks, step):
            n = min(step, self.row_chunks - a0)
            g_n = g[:, a0 * dim : (a0 + n) * dim]  # the last row chunk may be short: zeros after it
            if n == 1:
                g_a = torch.fft.rfft(g_n, n=dim, dim=1).unsqueeze(1)  # [T, 1, dim // 2 + 1]
                at = places[a0]
            else:
                if g_n.shape[1] < n * dim:
                    g_n = torch.nn.functional.pad(g_n, (0, n * dim - g_n.shape[1]))
                g_a = torch.fft.rfft(g_n.unflatten(1, (n, dim)), dim=2)  # [T, n, dim // 2 + 1]
                at = (places[a0 : a0 + n] + torch.arange(0, n * width, width, device=device).unsqueeze(1)).reshape(-1)
            placed = second.new_zeros(tokens, n * width)
            placed.index_copy_(1, at, (second.unsqueeze(1) * signs[a0 : a0 + n]).reshape(tokens, -1))
            x_a = torch.fft.rfft(placed.view(tokens, n, self.col_chunks, dim), dim=3)
            x_a = x_a[:, :, 0] if self.col_chunks == 1 else (x_a * psi).sum(dim=2)
            term = g_a.mul_(x_a)
            if n > 1:
                term = term.mul_(phi[a0 : a0 + n]).sum(dim=1)
            else:  # phi_0 = 1: the first chunk is not filtered
                term = term[:, 0] if a0 == 0 else term[:, 0].mul_(phi[a0])
            out = term if out is None else out.add_(term)
        assert out is not None
        return out

    def entry_columns(
        self, i: torch.Tensor, j: torch.Tensor, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(col, negative)`` of entries ``(i, j)`` (broadcast): int64 columns in ``[0,
        chunk_pairs * dim)`` (pair ``a * col_chunks + b``, then place) and bool signs."""
        row_place, row_chunk, neg1 = (self._on(n, device) for n in ("row_place", "row_chunk", "neg1"))
        col_place, col_chunk, neg2 = (self._on(n, device) for n in ("col_place", "col_chunk", "neg2"))
        a = row_chunk[i]
        pair = a * self.col_chunks + col_chunk[j]
        return pair * self.dim + (row_place[i] + col_place[a, j]) % self.dim, neg1[i] ^ neg2[a, j]

    def entry_index(self, device: torch.device | str) -> torch.Tensor | None:
        """int32 ``[1, rows, cols_in]``: every entry's column plus ``chunk_pairs * dim`` when its
        sign is negative (folded as ``sketch.folded_index``), for a matrix of at most
        ``ENTRY_TABLE_ENTRIES`` entries, else None (an embedding's lookups gather rows of it)."""
        if self.full > ENTRY_TABLE_ENTRIES:
            return None
        key = f"entries:{device}"
        if key not in self._cache:
            i = torch.arange(self.rows, device=device)[:, None]
            j = torch.arange(self.cols_in, device=device)[None]
            col, neg = self.entry_columns(i, j, device)
            self._cache[key] = (col + neg.long() * (self.chunk_pairs * self.dim)).to(torch.int32).unsqueeze(0)
        return self._cache[key]

    def combine(self, pairs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, chunk_pairs * dim]`` (entries added at their columns) -> ``[n, dim]``: each chunk
        pair filtered, then summed (one pair: the columns as they are)."""
        if self.chunk_pairs == 1:
            return super().combine(pairs, out)
        if pairs.dtype not in (torch.float32, torch.float64):  # half-precision FFTs: CUDA and powers of 2 only
            pairs = pairs.float()
        spectra = torch.fft.rfft(pairs.reshape(pairs.shape[0], self.chunk_pairs, self.dim), dim=2)
        summed = (spectra * self.filters(pairs.device, pairs.dtype)).sum(dim=1)
        return self.from_spectra(summed, out)

    # --- per-class matrices ---------------------------------------------------------------------

    def _flat_columns(
        self, start: int, stop: int, device: torch.device, channels: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cols, negative)`` of flat coordinates ``[start, stop)`` of ``M`` (row-major, its
        columns in ``column_order(channels)`` when given), ``[stop - start, 1]``, as ``SignedMap``
        takes them: ``entry_columns``' values, built a row chunk at a time from per-row and
        per-column vectors (a row's places are its offset plus the chunk's column places, mod
        ``dim``): three passes over the entries, not ``entry_columns``' gathers (1.7M entries of a
        wide MLP: 5x faster; the table is the first call's cost of every model's hook check)."""
        j = torch.arange(self.cols_in) if channels is None else self.column_order(channels)
        j = j.to(device)
        row_place, neg1 = self._on("row_place", device), self._on("neg1", device)
        col_place, col_chunk, neg2 = (self._on(n, device) for n in ("col_place", "col_chunk", "neg2"))
        first, last = start // self.cols_in, -(-stop // self.cols_in)  # the rows [start, stop) touches
        cols, negs = [], []
        for a in range(first // self.dim, (last - 1) // self.dim + 1):
            lo, hi = max(first, a * self.dim), min(last, (a + 1) * self.dim)
            place = row_place[lo:hi, None] + col_place[a, j][None]  # < 2 dim: one wrap at most
            place = torch.where(place >= self.dim, place - self.dim, place)
            cols.append(place.add_(((a * self.col_chunks + col_chunk[j]) * self.dim)[None]))
            negs.append(neg1[lo:hi, None] ^ neg2[a, j][None])
        skip = start - first * self.cols_in
        col = torch.cat(cols).view(-1)[skip : skip + stop - start]
        neg = torch.cat(negs).view(-1)[skip : skip + stop - start]
        return col.unsqueeze(1), neg.unsqueeze(1)

    def sketch(
        self, matrices: torch.Tensor, out: torch.Tensor | None = None, *, channels_inner: int | None = None
    ) -> torch.Tensor:
        """``[n, rows, cols_in]`` (or ``[n, rows * cols_in]``) per-class matrices -> ``[n, dim]``
        (into ``out`` when given); ``channels_inner``: their columns are in ``column_order`` of it."""
        key = f"signed:{channels_inner}"
        if key not in self._cache:
            columns = lambda start, stop, device: self._flat_columns(start, stop, device, channels_inner)  # noqa: E731
            self._cache[key] = SignedMap(self.full, self.chunk_pairs * self.dim, 1, 1.0, columns)
        placed = self._cache[key].apply(matrices.reshape(matrices.shape[0], self.full))
        return self.combine(placed, out)

    def describe(self) -> dict[str, Any]:
        return {**self.matrix_record(), "chunks": [self.row_chunks, self.col_chunks], "groups": list(self.groups)}

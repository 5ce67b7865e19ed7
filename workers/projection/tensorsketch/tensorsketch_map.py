"""TensorSketch projection of gradient rows (``projection.structure: tensorsketch``, the default):
one sketch of the whole row whose map follows each layer's outer-product structure.

Holds:

- ``TensorSketchMap`` — the whole stored row: every unit (one outer-product layer's ``[W | b]``
  matrix: ``chunked_sketch.ChunkedSketchUnit`` for new stores, ``SketchUnit`` for stores that
  recorded no ``placement``), then the parameters outside every unit (the "rest", sketched by a
  ``SparseSignSketch``), all added into the same ``dim`` columns; its ``work_slots`` (where the
  hook path writes: the ``dim`` columns every unit adds into, then the rest whole),
  ``stored_rows`` (work rows to stored rows; in two steps, ``unit_rows`` then ``add_rest``, so a
  block's work rows can go before the rest of many blocks is sketched at once), ``work_rows`` /
  ``project_full`` (full rows to the same numbers: what the tests compare with) and ``describe``
  (what the store records, with its ``placement``).
- ``SketchUnit`` — the ``hashed`` placement of stores made before ``chunked`` (issue 44): a
  unit with the two hashes of its axes, ``sketch(M)`` and ``entry_index``, and the interface the
  layer rules apply (``outer_matrix.SketchedMatrix``). Kept so that those stores resume with the map they hold.
- ``SKETCH_SHAPES`` (``layer_shapes.shape_for`` plus ``nn.EmbeddingBag``; the weight matrices of
  module-VJP units, ``layer_shapes.unit_matrices``, are units too: a store that recorded them in
  the rest, as stores made before them did, resumes so), ``HASHED`` and ``TS_GROUP_BASE``.

The hashed map. The ``dim`` columns are split into ``s`` blocks (``sketch.sketch_blocks``; for a
unit ``s = UNIT_NONZEROS``, one block of all ``dim`` columns). For unit ``u`` and block ``b``
(``m_b`` columns from ``start_b``), row coordinate ``i`` of ``M`` has a bucket ``h1_b(i)`` in
``[0, m_b)`` and a sign ``s1_b(i)``, column coordinate ``j`` has ``h2_b(j)`` and ``s2_b(j)``: the
buckets and signs of two ``SparseSignSketch`` maps (stream groups ``TS_GROUP_BASE + 2 u`` and ``+
1``, ``u`` the weight's index in the parameter layout). Entry ``M[i, j]`` is added to column
``start_b + (h1_b(i) + h2_b(j)) mod m_b`` of every block with sign ``s1_b(i) s2_b(j) / sqrt(s)``.
Its inner-product variance is a CountSketch's, but not its tail: two rows with the same ``h1``
send their whole rows to the same columns (the chunked placement's docstring says what that did
to a classifier head). Because the hash is a sum, the block of a rank-one ``M = g x^T`` is the
circular convolution of the two factors' CountSketches, ``irfft(rfft(CS1 g) * rfft(CS2 x))``
(Pham and Pagh, KDD 2013), as for the chunked units. The rest's parameters (norms, raw
parameters, layers without a unit) are one ``SparseSignSketch`` over their concatenated columns
(stream group ``sketch.SKETCH_GROUP``), added into the same columns, for both placements. No
split of ``dim`` among layers, nothing measured: the map is a pure function of the layout, the
model's layer types, ``dim``, ``s``, the placement and the seed, the same on every worker and
device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from classgrad.errors import ConfigError
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.layer_rules.layer_shapes import UnitShape, outer_layers, shape_for, unit_matrices
from classgrad.workers.projection.dense.dense_projector import HASH_NAME
from classgrad.workers.projection.outer_matrix import SketchedMatrix, work_slots
from classgrad.workers.projection.sketch.row_sketch import SignedMap, SparseSignSketch, folded_index
from classgrad.workers.projection.tensorsketch import chunked_sketch
from classgrad.workers.projection.tensorsketch.chunked_sketch import HASHED, PLACEMENT, ChunkedSketchUnit
from classgrad.workers.projection.width import check_width

STRUCTURE = "tensorsketch"
# Buckets per coordinate of a layer's matrix: one (the plain TensorSketch). Its inner-product
# variance is a CountSketch's whatever s is; more buckets only thin the tail of rows whose mass
# sits on a few coordinates, which a layer's gradient rarely has (measured: bag_text at C = 300,
# cosine error median/p99 0.0102/0.0409 with 1, 0.0107/0.0423 with 4, CountSketch s = 4 of the
# exact rows 0.0108/0.0403), and each costs a bucket more per entry on both routes. The rest
# (norms, raw parameters: small, sometimes concentrated) keeps ``sketch_nonzeros``.
UNIT_NONZEROS = 1
TS_GROUP_BASE = chunked_sketch.TS_GROUP_BASE  # stream groups of the units' hashes


def _bag_shape(m: nn.EmbeddingBag) -> UnitShape | None:
    if m.sparse or m.max_norm is not None or m.scale_grad_by_freq:
        return None  # refused by the embedding rule: the layer is not on the hook path anyway
    return m.num_embeddings, m.embedding_dim, True


SKETCH_SHAPES: dict[type[nn.Module], Callable[[Any], UnitShape | None]] = {nn.EmbeddingBag: _bag_shape}


def sketch_shape_for(module: nn.Module) -> Callable[[Any], UnitShape | None] | None:
    """The ``UnitShape`` function of ``module``'s type for a sketch unit, or None."""
    return SKETCH_SHAPES.get(type(module)) or shape_for(module)


@dataclass
class SketchUnit(SketchedMatrix):
    """One layer's weight (+ bias) sketched into ``dim`` work columns at ``offset``."""

    index: int
    weight: ParamSlot
    bias: ParamSlot | None
    a: int
    b: int
    input_first: bool
    dim: int
    nonzeros: int
    seed: int
    offset: int = 0  # of its columns in the work row: 0, the columns every unit adds into
    structure: str = STRUCTURE  # what layer_rules dispatch on
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        return self.dim

    @property
    def groups(self) -> tuple[int, int]:
        return TS_GROUP_BASE + 2 * self.index, TS_GROUP_BASE + 2 * self.index + 1

    def factor_sketches(self) -> tuple[SparseSignSketch, SparseSignSketch]:
        """The CountSketches of ``M``'s row and column coordinates (``[n, rows]`` -> ``[n, dim]``)."""
        if "sketches" not in self._cache:
            g1, g2 = self.groups
            self._cache["sketches"] = (
                SparseSignSketch(self.rows, self.dim, nonzeros=self.nonzeros, seed=self.seed, group=g1),
                SparseSignSketch(self.cols_in, self.dim, nonzeros=self.nonzeros, seed=self.seed, group=g2),
            )
        return self._cache["sketches"]

    @property
    def blocks(self) -> list[tuple[int, int]]:
        return self.factor_sketches()[0].blocks

    def hashes(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h1, neg1, h2, neg2)``: buckets within each block (int64 ``[rows, s]``, ``[cols_in, s]``)
        and signs (True: -1) of the row and column coordinates, on ``device``."""
        key = f"hashes:{device}"
        if key not in self._cache:
            sk1, sk2 = self.factor_sketches()
            starts = torch.tensor([b0 for b0, _ in sk1.blocks], dtype=torch.int64, device=device)
            c1, n1 = sk1.columns(0, self.rows, device)
            c2, n2 = sk2.columns(0, self.cols_in, device)
            self._cache[key] = (c1 - starts, n1, c2 - starts, n2)
        return self._cache[key]

    def entry_index(self, device: torch.device | str) -> torch.Tensor | None:
        """int32 ``[s, rows, cols_in]``: every entry's work column in block ``b`` plus ``dim`` when its
        sign is negative (``sketch.folded_index``'s fold), for a matrix of at most
        ``ENTRY_TABLE_ENTRIES`` entries, else None. An embedding's lookups gather their buckets from
        it (one gather per token instead of a sum, a modulo and a fold of its hashes)."""
        if self.full * len(self.blocks) > chunked_sketch.ENTRY_TABLE_ENTRIES:
            return None
        key = f"entries:{device}"
        if key not in self._cache:
            folded = folded_index(*self._flat_columns(0, self.full, torch.device(device)), self.dim)  # [s, full]
            self._cache[key] = folded.to(torch.int32).view(-1, self.rows, self.cols_in)
        return self._cache[key]

    # --- the interface of ``layer_rules.sketch_sums`` (``chunked_sketch.ChunkedSketchUnit``'s):
    # one block (``UNIT_NONZEROS``), one chunk pair (``SketchedMatrix``'s), nothing filtered.

    def _one_block(self) -> tuple[SparseSignSketch, SparseSignSketch]:
        if self.nonzeros != 1:
            raise ValueError("a hashed sketch unit is applied by the layer rules with one block only")
        return self.factor_sketches()

    def token_spectra(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """``[T, rows]``, ``[T, cols_in]`` -> complex ``[T, dim // 2 + 1]``: the product of the
        rffts of the two factors' CountSketches."""
        sk1, sk2 = self._one_block()
        return torch.fft.rfft(sk1.project(first), dim=1).mul_(torch.fft.rfft(sk2.project(second), dim=1))

    def entry_columns(
        self, i: torch.Tensor, j: torch.Tensor, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(col, negative)`` of entries ``(i, j)`` (broadcast): ``(h1(i) + h2(j)) mod dim``, signs."""
        self._one_block()
        h1, n1, h2, n2 = self.hashes(device)
        return (h1[i, 0] + h2[j, 0]) % self.dim, n1[i, 0] ^ n2[j, 0]

    def _flat_columns(
        self, start: int, stop: int, device: torch.device, channels: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cols, negative)`` of flat coordinates ``[start, stop)`` of ``M`` (row-major, its
        columns in ``column_order(channels)`` when given): int64 ``[stop - start, s]`` columns and
        bool signs (True: -1), as ``SignedMap`` takes them."""
        h1, n1, h2, n2 = self.hashes(device)
        if channels is not None:
            order = self.column_order(channels).to(device)
            h2, n2 = h2[order], n2[order]
        sizes = torch.tensor([m for _, m in self.blocks], dtype=torch.int64, device=device)
        starts = torch.tensor([b0 for b0, _ in self.blocks], dtype=torch.int64, device=device)
        c = self.cols_in
        if start % c == 0 and stop % c == 0:  # whole rows of M: broadcast, no per-entry gathers
            i0, i1 = start // c, stop // c
            cols = (h1[i0:i1, None] + h2[None]) % sizes + starts  # [rows, cols_in, s]
            return cols.reshape(-1, cols.shape[-1]), (n1[i0:i1, None] ^ n2[None]).reshape(-1, cols.shape[-1])
        flat = torch.arange(start, stop, device=device)
        i, j = flat // c, flat % c
        return (h1[i] + h2[j]) % sizes + starts, n1[i] ^ n2[j]

    def sketch(
        self, matrices: torch.Tensor, out: torch.Tensor | None = None, *, channels_inner: int | None = None
    ) -> torch.Tensor:
        """``[n, rows, cols_in]`` (or ``[n, rows * cols_in]``) per-class matrices -> ``[n, dim]``
        (into ``out`` when given); ``channels_inner``: their columns are in ``column_order`` of it."""
        key = f"signed:{channels_inner}"
        if key not in self._cache:
            scale = 1.0 / math.sqrt(self.nonzeros)
            columns = functools.partial(self._flat_columns, channels=channels_inner)
            self._cache[key] = SignedMap(self.full, self.dim, self.nonzeros, scale, columns)
        return self._cache[key].apply(matrices.reshape(matrices.shape[0], self.full), out)

    def describe(self) -> dict[str, Any]:
        return {**self.matrix_record(), "groups": list(self.groups)}


class TensorSketchMap:
    """The stored row of a TensorSketch-projected job (see the module docstring)."""

    structure = STRUCTURE

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        units: Sequence[SketchUnit | ChunkedSketchUnit],
        *,
        dim: int,
        seed: int,
        nonzeros: int,
        placement: str = PLACEMENT,
    ):
        self.slots = tuple(slots)
        self.units = list(units)
        self.placement = placement
        self.dim = dim
        self.seed = seed
        self.nonzeros = min(nonzeros, dim)
        in_unit = {u.weight.name for u in units} | {u.bias.name for u in units if u.bias is not None}
        self.rest = [s for s in self.slots if s.name not in in_unit]
        self.rest_size = sum(s.size for s in self.rest)
        for u in units:
            u.offset = 0
        # One sketch that every unit adds into (the stored row's own map is their sum): a work row
        # of dim columns per unit would be summed afterwards, and made runs of BERT at C = 1,000
        # 64 classes instead of about 100 (the partitioned engine's groups are 32 MiB of rows).
        self.units_width = dim if units else 0
        self.rest_projector = (
            SparseSignSketch(self.rest_size, dim, nonzeros=self.nonzeros, seed=seed) if self.rest_size else None
        )
        self.unit_offsets_recorded = False

    @classmethod
    def plan(
        cls,
        slots: Sequence[ParamSlot],
        modules: dict[str, nn.Module],
        hooked: set[str],
        *,
        dim: int,
        seed: int,
        nonzeros: int,
        record: dict[str, Any] | None = None,
    ) -> TensorSketchMap:
        """A unit for every hooked layer of a sketchable type whose weight is selected (``hooked``:
        the modules the hook path covers); ``record``: a store's ``describe()``, checked to match."""
        full = sum(s.size for s in slots)
        check_width(dim, full)
        nonzeros = min(nonzeros, dim)
        found = list(outer_layers(slots, modules, hooked, sketch_shape_for))
        matrices = list(unit_matrices(slots, modules, hooked))
        if record is not None:  # stores made before these units kept those weights in the rest
            recorded = {u.get("param") for u in record.get("units", [])}
            matrices = [r for r in matrices if r[1].name in recorded]
        # A new store's units are chunked; one recorded without a placement was hashed, and resumes so.
        placement = PLACEMENT if record is None else record.get("placement", HASHED)
        if placement not in (PLACEMENT, HASHED):
            raise ConfigError(f"projection: the store's tensorsketch placement {placement!r} is unknown")
        units: list[SketchUnit | ChunkedSketchUnit] = [
            ChunkedSketchUnit(i, slot, bias, *shape, dim, seed)
            if placement == PLACEMENT
            else SketchUnit(i, slot, bias, *shape, dim, UNIT_NONZEROS, seed)
            for i, slot, bias, shape in sorted(found + matrices, key=lambda r: r[0])
        ]
        out = cls(slots, units, dim=dim, seed=seed, nonzeros=nonzeros, placement=placement)
        if record is not None:
            out.check_record(record)
            # Stores made before the units shared one sketch recorded each unit's work columns
            # ("offset": its position times dim), which the store compares on resume: kept for them.
            out.unit_offsets_recorded = any("offset" in u for u in record.get("units", []))
        return out

    def check_record(self, record: dict[str, Any]) -> None:
        """Refuse a store whose recorded map is not this one (another model, layout or setting)."""
        mine = {**self.describe(), "placement": self.placement}
        record = {**record, "placement": record.get("placement", HASHED)}
        for key in ("dim", "seed", "nonzeros", "unit_nonzeros", "dim_in", "rest_params", "placement"):
            if record.get(key) != mine[key]:
                raise ConfigError(
                    f"projection: the store's tensorsketch {key} is {record.get(key)!r}, this job's {mine[key]!r}"
                )
        if [u.get("param") for u in record.get("units", [])] != [u["param"] for u in mine["units"]]:
            raise ConfigError("projection: the store's tensorsketch layers differ from this model's")

    # --- the hook path's row: the units' dim columns, then the rest whole ------------------------

    @property
    def work_dim(self) -> int:
        return self.units_width + self.rest_size

    def work_slots(self) -> list[ParamSlot]:
        """Where the hook path writes: every unit's weight the same ``dim`` columns (the first value
        written there is copied, later ones added: ``layer_rules.rule_io.ClassRows``), its bias none
        (it joined the weight), every other parameter its full columns after them."""
        return work_slots(self.slots, self.units, self.rest, self.units_width)

    def unit_rows(self, work: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Work rows ``[n, work_dim]`` -> ``[n, dim]`` (into ``into`` when given, else a copy): the
        units' sketch (the rest not yet)."""
        n = work.shape[0]
        if self.units:
            units = work[:, : self.dim]
            return units.clone() if into is None else into.copy_(units)
        return work.new_zeros(n, self.dim) if into is None else into.zero_()

    def add_rest(self, out: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """``out`` (``unit_rows``) plus the sketch of the rest's columns ``rest`` ``[n, rest_size]``."""
        if self.rest_projector is not None:
            out += self.rest_projector.project(rest)
        return out

    def stored_rows(self, work: torch.Tensor) -> torch.Tensor:
        """Work rows ``[n, work_dim]`` -> stored rows ``[n, dim]``: the units' columns and the
        rest's sketch added up."""
        return self.add_rest(self.unit_rows(work), work[:, self.units_width :])

    def work_rows(self, full: torch.Tensor) -> torch.Tensor:
        """Full rows ``[n, D]`` (layout order) -> work rows, by the same map."""
        parts = []
        if self.units:
            units = self.units[0].sketch(self.units[0].matrices(full))
            for u in self.units[1:]:
                units += u.sketch(u.matrices(full))
            parts.append(units)
        parts += [full[:, s.offset : s.offset + s.size] for s in self.rest]
        return torch.cat(parts, dim=1) if parts else full[:, :0]

    def project_full(self, full: torch.Tensor) -> torch.Tensor:
        """Full rows -> the stored rows a job writes (for checks and the quality benchmark)."""
        return self.stored_rows(self.work_rows(full))

    def describe(self) -> dict[str, Any]:
        """What a store records: enough to regenerate every hash and find every part."""
        out: dict[str, Any] = {
            "structure": STRUCTURE,
            "kind": "sparse-sign",
            "dim": self.dim,
            "out_dim": self.dim,
            "seed": self.seed,
            "nonzeros": self.nonzeros,
            "unit_nonzeros": UNIT_NONZEROS,
            "hash": HASH_NAME,
            "dim_in": sum(s.size for s in self.slots),
            "units": [
                {**u.describe(), "offset": i * self.dim} if self.unit_offsets_recorded else u.describe()
                for i, u in enumerate(self.units)
            ],
            "rest_params": [s.name for s in self.rest],
        }
        if self.placement != HASHED:  # stores made before placements existed record none
            out["placement"] = self.placement
        if self.rest_projector is not None:
            out["rest_sketch"] = self.rest_projector.describe()
        return out

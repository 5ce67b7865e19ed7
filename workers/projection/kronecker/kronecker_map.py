"""Kronecker-structured projection of gradient rows: seeded factors per layer and how ``projection.dim``
is split among layers.

Holds:

- ``kronecker_factor`` — one factor ``[n, k]`` from the counter-based generator of
  ``classgrad.workers.projection`` (same bits on every device), entries of variance ``1/k``.
- ``KroneckerUnit`` — one layer's weight (and its bias, as a constant-1 input feature: a column
  of ``M``, or a row where the input is the first axis) of stored shape ``[a, b]`` projected to
  ``P_a M P_b^T``: ``k_out x k_in`` columns of the stored row.
- ``KroneckerMap`` — the whole stored row: the units, then the parameters outside every unit
  ("rest": kept whole, projected densely or by a sparse sign sketch), with ``work_layout`` (where the hook path writes),
  ``work_rows`` / ``stored_rows`` / ``project_full`` (full rows to stored rows: the reference the
  tests compare with; ``unit_rows`` and ``add_rest``, ``stored_rows`` in two steps) and
  ``describe`` (what the store records).
- ``allocate`` — the rule that splits ``dim`` among units and rest. The layers with units are
  the layer rules' outer-product layers (``layer_rules.layer_shapes.outer_layers``).

The factors. For a weight of stored shape ``[a, b]`` (Linear ``[out, in]``; Conv1d/2d/3d ``[cout,
cin * prod(kernel)]``) with a bias, the layer's matrix is ``M = [W | bias]`` (``a x (b + 1)``). Where the
stored matrix's first axis is the layer's input (``KroneckerUnit.input_first``: transformers'
``Conv1D``, ``[in, out]``; ``nn.Embedding``, ``[V, H]``, whose input is a one-hot row, so its
projection is a row of ``F_a``), the bias is a constant-1 input feature on that axis: ``M = [W;
bias^T]`` (``(a + 1) x b``), and ``F_a`` gets the extra row instead of ``F_b``. Its
projection is ``P_a M P_b^T`` with ``P_a = F_a^T``, ``P_b = F_b^T``, where ``F_a`` is ``[a,
k_out]`` and ``F_b`` is ``[b + 1, k_in]`` (``[a + 1, k_out]`` and ``[b, k_in]`` for
``input_first``), generated like a ``Projector``'s ``R`` (kind and seed of
the job) with stream group ``GROUP_BASE + 2 * i`` (``F_a``) and ``GROUP_BASE + 2 * i + 1``
(``F_b``), ``i`` the index of the weight in the parameter layout. Entries are ``±1/sqrt(k_out)``
and ``±1/sqrt(k_in)`` (rademacher), so the Kronecker product has entries of variance ``1/(k_out
k_in)`` and preserves inner products in expectation, like a dense projection. The flattened
``[k_out, k_in]`` result (row-major) is the unit's part of the stored row. The rest, projected
densely, uses a ``Projector`` over the rest's columns (concatenated in layout order) with the
job's seed (stream group 0, far from ``GROUP_BASE``); ``rest: sketch`` uses a
``classgrad.workers.projection.sketch.SparseSignSketch`` over the same columns instead (stream group
``SKETCH_GROUP``, ``s`` signed nonzeros per column of the rest: ``s`` additions per parameter and
row instead of ``2 k_rest`` flops).

The split of ``dim`` (``allocate``). Projecting unit ``u`` to ``k_u`` columns adds variance of
about ``n_u^2 / k_u`` to an inner product, ``n_u`` the squared norm of its part of the rows; for
a fixed total this is smallest with ``k_u`` proportional to ``n_u``. So with ``allocation: norm``
``n_u`` is measured (mean over the first block of up to ``MEASURE_CLASSES`` classes, from rows
projected with the ``size`` split; a projection preserves squared norms in expectation) and
recorded in the store; ``allocation: size`` uses the parameter count instead. Targets are
water-filled (each between 1 and the unit's full size), then rounded: ``k_out = round(sqrt(t))``,
``k_in = floor(t / k_out)`` (within bounds; balanced factors, because for the low-rank gradients
of small classes the variance goes as ``1/k_out + 1/k_in``). Columns left over by the rounding go
to the dense rest when there is one, else to the units (one more ``k_in`` or ``k_out`` step for
the most short-changed ones, then one unit re-factored to take the last few), so the stored
width is exactly ``dim``. With ``rest: keep`` the rest's full width is taken first; a sketched
rest takes its share like a dense one (its variance is a dense projection's to the same width).

What joins the rest besides the parameters without a Kronecker structure (norms, raw parameters
such as class tokens, grouped convolutions, embeddings the embedding rule refuses: ``max_norm``,
``scale_grad_by_freq``, ``sparse``; layers without a hook rule are refused earlier): layers
matching ``projection.dense_layers``, and with ``low_rank: dense`` every layer whose gradient reaches at
most one token of a sample on the first block (``KroneckerUnit.positions``: a classifier head, a
pooler, a last block read at the class token only). Their per-class gradients have rank at most
the class's sample count, where a Kronecker projection's variance is about ``1/k_out + 1/k_in``
instead of ``1/(k_out k_in)`` (benchmarks/RESULTS.md, projection quality). The layers so chosen
are recorded (``dense_layers``) with the split, and workers and resumes reuse the record.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from classgrad.errors import ConfigError
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.layer_rules.layer_shapes import outer_layers
from classgrad.workers.projection.dense.dense_projector import (
    HASH_NAME,
    PROJECTIONS,
    Projector,
    stream_keys,
    stream_words,
)
from classgrad.workers.projection.outer_matrix import OuterMatrix, work_slots
from classgrad.workers.projection.sketch.row_sketch import SparseSignSketch
from classgrad.workers.projection.width import check_width

GROUP_BASE = 1 << 31  # stream groups of the factors: far above the dense projection's 0, 1, ...
MEASURE_CLASSES = 32  # classes of the first block whose rows measure the gradient norms
PROJECTED_REST = ("dense", "sketch")  # rest modes that project the rest to a share of dim


def kronecker_factor(
    kind: str, seed: int, group: int, n: int, k: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Factor ``[n, k]`` (float32): rows ``[0, n)`` of the stream ``(seed, group)`` as a ``Projector``
    of ``kind`` with ``k`` columns generates them (bit-identical on every device)."""
    spec = PROJECTIONS[kind]
    device = torch.device(device)
    out = torch.empty(n, spec.buffer_cols(k), dtype=torch.float32, device=device)
    words = stream_words(stream_keys(seed, group), 0, n, spec.words_per_row(k), device)
    spec.entries(words, k, out)
    return out[:, :k].contiguous()


@dataclass
class KroneckerUnit(OuterMatrix):
    """One layer's weight (+ bias) as ``k_out x k_in`` columns at ``offset`` of the stored row."""

    index: int  # the weight's index in the parameter layout (stream groups)
    weight: ParamSlot
    bias: ParamSlot | None
    a: int
    b: int
    input_first: bool = False  # the first axis is the layer's input (Conv1D, Embedding): a bias row
    k_out: int = 1
    k_in: int = 1
    offset: int = 0
    measured: float | None = None  # mean squared norm of its part of the rows (allocation: norm)
    positions: int | None = None  # most tokens of a sample with a gradient (1: rank <= the class's samples)
    kind: str = "rademacher"
    seed: int = 0
    structure: str = "kronecker"  # what layer_rules dispatch on
    _cache: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        return self.k_out * self.k_in

    @property
    def groups(self) -> tuple[int, int]:
        return GROUP_BASE + 2 * self.index, GROUP_BASE + 2 * self.index + 1

    def factors(
        self, device: torch.device | str, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(F_a [rows, k_out], F_b [cols_in, k_in])`` on ``device`` (generated once per device)."""
        key = (str(device), dtype)
        if key not in self._cache:
            ga, gb = self.groups
            fa = kronecker_factor(self.kind, self.seed, ga, self.rows, self.k_out, device)
            fb = kronecker_factor(self.kind, self.seed, gb, self.cols_in, self.k_in, device)
            self._cache[key] = (fa.to(dtype), fb.to(dtype))
        return self._cache[key]

    def project_matrix(self, full: torch.Tensor, slots_rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, width]`` from full rows ``slots_rows`` ``[n, D]`` (the reference: ``F_a^T M F_b``)."""
        return self.map_matrix(self.matrices(slots_rows))

    def map_matrix(self, m: torch.Tensor) -> torch.Tensor:
        """``[k, width]``: ``F_a^T M F_b`` of per-class matrices ``m`` ``[k, rows, cols_in]``."""
        fa, fb = (f.to(m.dtype) for f in self.factors(m.device))
        return torch.matmul(torch.matmul(fa.t(), m), fb).reshape(m.shape[0], self.width)

    def describe(self) -> dict[str, Any]:
        out = {
            "param": self.weight.name,
            "bias": self.bias.name if self.bias is not None else None,
            "shape": [self.a, self.b],
            "k_out": self.k_out,
            "k_in": self.k_in,
            "factor_shapes": [[self.k_out, self.rows], [self.k_in, self.cols_in]],
            "width": self.width,
            "offset": self.offset,
            "groups": list(self.groups),
            "measured_sq_norm": self.measured,
            "tokens_per_sample": self.positions,
        }
        if self.input_first:  # only then: the records of Linear and Conv2d units keep their keys
            out["input_first"] = True
        return out


def _water_fill(budget: float, weights: Sequence[float], caps: Sequence[int]) -> list[float]:
    """Targets proportional to ``weights``, each in ``[1, cap]``, summing to ``budget``."""
    n = len(weights)
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        left = budget - sum(fixed.values())
        total = sum(max(weights[i], 0.0) for i in free)
        targets = {i: (left * max(weights[i], 0.0) / total if total > 0 else left / len(free)) for i in free}
        changed = False
        for i, t in targets.items():
            if t > caps[i]:
                fixed[i], changed = float(caps[i]), True
            elif t < 1:
                fixed[i], changed = 1.0, True
        if not changed or len(fixed) == n:
            return [fixed.get(i, targets.get(i, 1.0)) for i in range(n)]


def _factor(t: float, a: int, b: int) -> tuple[int, int]:
    # Balanced (k_out ~ k_in ~ sqrt(t)): for the low-rank matrices of small classes the variance
    # goes as 1/k_out + 1/k_in, smallest at equal factors for a given product.
    k_out = min(a, max(1, round(math.sqrt(max(t, 1.0)))))
    k_in = min(b, max(1, int(t // k_out)))
    return k_out, k_in


def _exact_pair(n: int, a: int, b: int, ratio: float) -> tuple[int, int] | None:
    """A divisor pair ``(k_out, k_in)`` of ``n`` within ``[1, a] x [1, b]`` closest to ``ratio``."""
    best = None
    for d in range(1, min(a, n) + 1):
        if n % d == 0 and n // d <= b:
            score = abs(math.log(d / (n / d)) - math.log(ratio))
            if best is None or score < best[0]:
                best = (score, d, n // d)
    return None if best is None else (best[1], best[2])


def _refactor(units: list[KroneckerUnit], left: int) -> int:
    """Give the last ``left`` columns to one unit re-factored exactly, else to two (widths moved
    between them by up to 64); return what is still left (0 on success)."""
    ordered = sorted(units, key=lambda u: -u.width)
    for u in ordered:
        pair = _exact_pair(u.width + left, u.rows, u.cols_in, u.k_out / u.k_in)
        if pair is not None:
            u.k_out, u.k_in = pair
            return 0
    for i, u in enumerate(ordered):
        for v in ordered[i + 1 :]:
            total = u.width + v.width + left
            for n in sorted(
                range(max(1, u.width - 64), min(total, u.width + left + 64)), key=lambda n: abs(n - u.width)
            ):
                pu = _exact_pair(n, u.rows, u.cols_in, u.k_out / u.k_in)
                pv = _exact_pair(total - n, v.rows, v.cols_in, v.k_out / v.k_in) if pu else None
                if pu and pv:
                    (u.k_out, u.k_in), (v.k_out, v.k_in) = pu, pv
                    return 0
    return left


def allocate(units: list[KroneckerUnit], dim: int, rest_size: int, rest_mode: str, weights: Sequence[float]) -> int:
    """Set every unit's ``k_out``/``k_in``; return the rest's width. ``weights``: one per unit, then
    one for the rest (ignored unless the rest is projected: dense or sketch)."""
    full = sum(u.full for u in units) + rest_size
    check_width(dim, full)
    dense_rest = rest_mode in PROJECTED_REST and rest_size > 0
    budget = dim - (rest_size if rest_mode == "keep" else 0)
    entries = len(units) + dense_rest
    if budget < entries:
        raise ConfigError(
            f"projection.dim ({dim}) leaves {budget} columns for {entries} projected parts "
            f"(rest: {rest_mode}, {rest_size} columns): raise projection.dim"
        )
    caps = [u.full for u in units] + ([rest_size] if dense_rest else [])
    targets = _water_fill(budget, list(weights[: len(units)]) + ([weights[-1]] if dense_rest else []), caps)
    for u, t in zip(units, targets):
        u.k_out, u.k_in = _factor(t, u.rows, u.cols_in)
    rest_width = int(targets[-1]) if dense_rest else (rest_size if rest_mode == "keep" else 0)
    left = dim - sum(u.width for u in units) - (rest_width if rest_mode in PROJECTED_REST else rest_size)
    if dense_rest:
        return rest_width + left
    # Leftover columns to the units: one k_in / k_out step for the most short-changed first.
    for _ in range(4 * len(units) + 4):
        order = sorted(range(len(units)), key=lambda i: units[i].width - targets[i])
        stepped = False
        for i in order:
            u = units[i]
            if u.k_out <= left and u.k_in < u.cols_in:
                u.k_in += 1
                left -= u.k_out
                stepped = True
            elif u.k_in <= left and u.k_out < u.rows:
                u.k_out += 1
                left -= u.k_in
                stepped = True
        if not stepped:
            break
    if left:
        left = _refactor(units, left)
    if left:
        raise ConfigError(f"projection.dim ({dim}) cannot be split exactly among the layers: choose another dim")
    return rest_width


class KroneckerMap:
    """The stored row of a Kronecker-projected job (see the module docstring)."""

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        units: list[KroneckerUnit],
        *,
        dim: int,
        kind: str,
        seed: int,
        rest_mode: str,
        allocation: str,
        weights: Sequence[float] | None = None,
        fixed: dict[str, Any] | None = None,
        dense_layers: Sequence[str] = (),
        low_rank: str = "dense",
        sketch_nonzeros: int = 4,
    ):
        self.slots = tuple(slots)
        self.sketch_nonzeros = sketch_nonzeros
        self.dense_layers = tuple(dense_layers)
        self.low_rank = low_rank
        self.units = units
        self.dim = dim
        self.kind = kind
        self.seed = seed
        self.rest_mode = rest_mode
        self.allocation = allocation
        in_unit = {u.weight.name for u in units} | {u.bias.name for u in units if u.bias is not None}
        self.rest = [s for s in self.slots if s.name not in in_unit]
        self.rest_size = sum(s.size for s in self.rest)
        if weights is None:  # allocation by size
            weights = [float(u.full) for u in units] + [float(self.rest_size)]
        self.weights = list(weights)
        if fixed is None:
            self.rest_width = allocate(units, dim, self.rest_size, rest_mode, self.weights)
        else:
            self.rest_width = self._take(fixed)
        offset = 0
        for u in units:
            u.kind, u.seed, u.offset = kind, seed, offset
            u._cache.clear()
            offset += u.width
        self.units_width = offset
        self.rest_projector: Projector | SparseSignSketch | None = None
        if rest_mode == "dense" and self.rest_size > 0:
            self.rest_projector = Projector(self.rest_size, self.rest_width, kind=kind, seed=seed)
        elif rest_mode == "sketch" and self.rest_size > 0:
            self.rest_projector = SparseSignSketch(self.rest_size, self.rest_width, nonzeros=sketch_nonzeros, seed=seed)

    @classmethod
    def plan(
        cls,
        slots: Sequence[ParamSlot],
        modules: dict[str, nn.Module],
        hooked: set[str],
        dense_layers: Sequence[str] = (),
        **options: Any,
    ) -> KroneckerMap:
        """Units for every hooked layer of a ``layer_shapes.OUTER_SHAPES`` type whose weight is selected
        (``hooked``: names of the modules the hook path covers), except the layers whose module
        name matches a pattern of ``dense_layers`` (they join the rest)."""

        def dense(owner: str) -> bool:
            return any(fnmatch.fnmatchcase(owner, pattern) for pattern in dense_layers)

        found = outer_layers(slots, modules, hooked, skip=dense)
        units = [KroneckerUnit(i, slot, bias, *shape) for i, slot, bias, shape in found]
        return cls(slots, units, dense_layers=dense_layers, **options)

    def _take(self, record: dict[str, Any]) -> int:
        """The split recorded in a store (``describe``): the same units, the same widths."""
        if record.get("rest", "dense") != self.rest_mode:
            raise ConfigError(f"projection: the store's rest is {record.get('rest')!r}, this job's {self.rest_mode!r}")
        recorded = {e.get("param"): e for e in record.get("units", [])}
        if set(recorded) != {u.weight.name for u in self.units}:
            raise ConfigError(
                "projection: the store's Kronecker units differ from this model's "
                f"({sorted(map(str, recorded))} vs {sorted(u.weight.name for u in self.units)})"
            )
        for u in self.units:
            u.k_out, u.k_in = int(recorded[u.weight.name]["k_out"]), int(recorded[u.weight.name]["k_in"])
            m = recorded[u.weight.name].get("measured_sq_norm")
            u.measured = None if m is None else float(m)
            p = recorded[u.weight.name].get("tokens_per_sample")
            u.positions = None if p is None else int(p)
        rest_width = int(record.get("rest_width") or 0)
        if sum(u.width for u in self.units) + rest_width != self.dim:
            raise ConfigError(f"projection: the store's widths do not add up to projection.dim ({self.dim})")
        return rest_width

    def remeasured(self, weights: Sequence[float]) -> KroneckerMap:
        """The same units split by ``weights`` (allocation: norm)."""
        units = [KroneckerUnit(u.index, u.weight, u.bias, u.a, u.b, u.input_first) for u in self.units]
        out = KroneckerMap(
            self.slots,
            units,
            dim=self.dim,
            kind=self.kind,
            seed=self.seed,
            rest_mode=self.rest_mode,
            allocation=self.allocation,
            weights=weights,
            dense_layers=self.dense_layers,
            low_rank=self.low_rank,
            sketch_nonzeros=self.sketch_nonzeros,
        )
        positions = {u.weight.name: u.positions for u in self.units}
        for u, w in zip(out.units, weights):
            u.measured = float(w)
            u.positions = positions[u.weight.name]
        return out

    # --- the hook path's row: units, then the rest whole -----------------------------------------

    @property
    def work_dim(self) -> int:
        return self.units_width + self.rest_size

    def work_slots(self) -> list[ParamSlot]:
        """Where the hook path writes each selected parameter: a unit's weight gets its projected
        columns, its bias none (it joined the weight), every other parameter its full columns
        after the units."""
        return work_slots(self.slots, self.units, self.rest, self.units_width)

    def measure(self, work: torch.Tensor) -> list[float]:
        """Mean squared norm of each unit's columns, then of the rest's, over rows ``work``."""
        sq = work.double().pow(2)
        out = [float(sq[:, u.offset : u.offset + u.width].sum(1).mean()) for u in self.units]
        return out + [float(sq[:, self.units_width :].sum(1).mean()) if self.rest_size else 0.0]

    def unit_rows(self, work: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Work rows ``[n, work_dim]`` -> ``[n, dim]`` (into ``into`` when given): the units'
        columns (the rest's still zero)."""
        if self.rest_projector is None:
            return work[:, : self.dim] if into is None else into.copy_(work[:, : self.dim])
        out = work.new_zeros(work.shape[0], self.dim) if into is None else into
        out[:, : self.units_width] = work[:, : self.units_width]
        if into is not None:  # new_zeros' rest columns are zero already
            out[:, self.units_width :] = 0
        return out

    def add_rest(self, out: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """``out`` (``unit_rows``) with the rest's columns ``rest`` ``[n, rest_size]`` projected in
        (a sketched rest in the rows' dtype, a dense one in float32)."""
        if self.rest_projector is not None:
            out[:, self.units_width :] += self.rest_projector.project(rest).to(out.dtype)
        return out

    def stored_rows(self, work: torch.Tensor) -> torch.Tensor:
        """Work rows ``[n, work_dim]`` -> stored rows ``[n, dim]`` (the rest projected or kept)."""
        return self.add_rest(self.unit_rows(work), work[:, self.units_width :])

    def work_rows(self, full: torch.Tensor) -> torch.Tensor:
        """Full rows ``[n, D]`` (layout order) -> work rows, with the same factors."""
        parts = [u.project_matrix(full, full) for u in self.units]
        parts += [full[:, s.offset : s.offset + s.size] for s in self.rest]
        return torch.cat(parts, dim=1) if parts else full[:, :0]

    def project_full(self, full: torch.Tensor) -> torch.Tensor:
        """Full rows -> the stored rows a job writes (for checks and the quality benchmark)."""
        return self.stored_rows(self.work_rows(full))

    def describe(self) -> dict[str, Any]:
        """What a store records: enough to regenerate every factor and find every part. (A
        sketched rest adds ``rest_sketch``; stores of the other modes keep the keys they had, so a
        resume compares equal.)"""
        out = {
            "structure": "kronecker",
            "kind": self.kind,
            "dim": self.dim,
            "out_dim": self.dim,
            "seed": self.seed,
            "hash": HASH_NAME,
            "dim_in": sum(s.size for s in self.slots),
            "allocation": self.allocation,
            "rest": self.rest_mode,
            "units": [u.describe() for u in self.units],
            "dense_layers": list(self.dense_layers),
            "low_rank": self.low_rank,
            "rest_params": [s.name for s in self.rest],
            "rest_offset": self.units_width,
            "rest_width": self.rest_width if self.rest_projector is not None else self.rest_size,
            "rest_groups": [[0, self.rest_size]] if isinstance(self.rest_projector, Projector) else None,
        }
        if isinstance(self.rest_projector, SparseSignSketch):
            out["rest_sketch"] = self.rest_projector.describe()
        return out

"""A projection structure written outside the package and on no built-in structure, as a user's
module would be (``engine.plugins: [tests.support.layer_gauss]``): ``layer_gauss``.

Each Linear layer that ``layers`` names gets its own Gaussian map: its per-class ``[W | b]``,
formed inside the backward from the layer's factors, times a ``[a (b + 1), width]`` matrix; every
other selected parameter (the rest) is mapped after the backward by one more Gaussian matrix
into its own share of the columns. The ``dim`` columns are split evenly among the layers and the
rest. Everything a structure brings is here, in one module: its options (``LayerGaussOptions``:
the job file checks ``layers``), its units (``GaussUnit``, on ``outer_matrix.OuterMatrix``, the
matrix view every structure's units share), its map (``GaussMap``, an
``engines.partitioned.ProjectedMap``), its sums for Linear-like layers (``gauss_outer_sums``) and
its registration. Small layers only: each unit's Gaussian matrix is formed whole.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field
from torch import nn

from classgrad.config.projection import ProjectionConfig
from classgrad.errors import ConfigError
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.layer_rules.layer_shapes import outer_layers, shape_for
from classgrad.workers.engines.layer_rules.registry import ProjectedSums
from classgrad.workers.engines.layer_rules.rule_io import LayerRows
from classgrad.workers.engines.partitioned.projected_engine import MeasureRows
from classgrad.workers.projection import ProjectionStructure, ResolvedProjection, register_structure
from classgrad.workers.projection.outer_matrix import OuterMatrix, work_slots

NAME = "layer_gauss"


class LayerGaussOptions(ProjectionConfig):
    """`structure: layer_gauss` (a test plugin): chosen Linear layers by their own Gaussian maps."""

    layers: list[str] = Field(
        default_factory=lambda: ["*"],
        description="fnmatch patterns of the Linear layers (module names) mapped inside the backward; the other "
        "parameters are mapped after it.",
    )


def gaussian(seed: int, stream: int, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` float64, entries N(0, 1/cols): the same on every worker (CPU generator)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stream)
    return torch.randn(rows, cols, generator=generator, dtype=torch.float64) / math.sqrt(cols)


@dataclass(eq=False)
class GaussUnit(OuterMatrix):
    """One layer's ``[W | b]`` (``a x (b + 1)``) mapped to ``width`` columns at ``offset``."""

    weight: ParamSlot
    bias: ParamSlot | None
    a: int
    b: int
    offset: int
    width: int
    seed: int
    stream: int
    input_first: bool = False
    structure: str = NAME
    _matrix: dict[tuple[torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)

    def matrix(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._matrix:
            self._matrix[key] = gaussian(self.seed, self.stream, self.full, self.width).to(device, dtype)
        return self._matrix[key]

    def map_matrix(self, m: torch.Tensor) -> torch.Tensor:
        flat = m.reshape(m.shape[0], -1)
        return flat @ self.matrix(flat.device, flat.dtype)

    def describe(self) -> dict[str, Any]:
        return {**self.matrix_record(), "offset": self.offset, "width": self.width, "stream": self.stream}


def gauss_outer_sums(factors: Any, out: LayerRows, unit: GaussUnit) -> None:
    """Class i's ``[dW_i | db_i]`` from the layer's factors (``dW_i = sum_t g_t x_t^T``), mapped."""
    grads, inputs = factors.grad_tokens(), factors.input_tokens()  # [k, T, a], [k, T, b]
    weight = torch.bmm(grads.transpose(1, 2), inputs)
    m = unit.joined(weight, grads.sum(dim=1)) if unit.bias is not None else weight
    rows = unit.map_matrix(m)
    out.bound_by_values(rows)
    out.put("weight", rows)


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class GaussMap:
    """The stored row: each unit's columns, then the rest's share (a Gaussian map of the rest)."""

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        modules: dict[str, nn.Module],
        covered: set[str],
        options: LayerGaussOptions,
        record: Mapping[str, Any] | None,
    ):
        self.slots, self.dim, self.seed = list(slots), int(options.dim or 0), options.seed
        self.patterns = list(options.layers)

        def linear(module: nn.Module) -> Any:
            return shape_for(module) if isinstance(module, nn.Linear) else None

        def skip(owner: str) -> bool:
            return not any(fnmatch.fnmatch(owner, p) for p in self.patterns)

        found = list(outer_layers(self.slots, modules, covered, lookup=linear, skip=skip))
        taken = {s.name for _, w, b, _ in found for s in (w, b) if s is not None}
        self.rest = [s for s in self.slots if s.name not in taken]
        self.rest_size = sum(s.size for s in self.rest)
        widths = _split(self.dim, len(found) + bool(self.rest_size))
        if not found or min(widths) < 1:
            raise ConfigError(
                f"projection.structure={NAME}: no Linear layer matches {self.patterns} or dim is too small"
            )
        self.units: list[GaussUnit] = []
        offset = 0
        for (i, weight, bias, (a, b, _)), width in zip(found, widths):
            self.units.append(GaussUnit(weight, bias, a, b, offset, width, self.seed, stream=i + 1))
            offset += width
        self.units_width = offset
        self.rest_width = self.dim - offset
        self.rest_projector: object | None = self if self.rest_size else None
        self._rest_matrix: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        if record is not None and dict(record) != {**self.describe(), "structure": NAME}:
            raise ConfigError(f"the store's {NAME} map is not the one this model and these options give")

    def work_slots(self) -> list[ParamSlot]:
        return work_slots(self.slots, self.units, self.rest, self.units_width)

    def unit_rows(self, work: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        out = work.new_zeros(work.shape[0], self.dim) if into is None else into.zero_()
        out[:, : self.units_width] = work[:, : self.units_width]
        return out

    def add_rest(self, out: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        if self.rest_size:
            key = (rest.device, rest.dtype)
            if key not in self._rest_matrix:  # generated once per device and dtype, as a unit's
                self._rest_matrix[key] = gaussian(self.seed, 0, self.rest_size, self.rest_width).to(*key)
            out[:, self.units_width :] += (rest @ self._rest_matrix[key]).to(out.dtype)
        return out

    def work_rows(self, full: torch.Tensor) -> torch.Tensor:
        parts = [u.map_matrix(u.matrices(full)) for u in self.units]
        parts += [full[:, s.offset : s.offset + s.size] for s in self.rest]
        return torch.cat(parts, dim=1)

    def project_full(self, full: torch.Tensor) -> torch.Tensor:
        work = self.work_rows(full)
        return self.add_rest(self.unit_rows(work), work[:, self.units_width :])

    def describe(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "seed": self.seed,
            "layers": self.patterns,
            "units": [u.describe() for u in self.units],
            "rest_params": [s.name for s in self.rest],
            "rest_width": self.rest_width,
        }


class LayerGaussStructure(ProjectionStructure[LayerGaussOptions]):
    name = NAME
    options = LayerGaussOptions
    in_backward = True

    def plan(
        self,
        projection: ResolvedProjection[LayerGaussOptions],
        slots: Sequence[ParamSlot],
        modules: dict[str, nn.Module],
        covered: set[str],
        measure: MeasureRows | None,
    ) -> GaussMap:
        return GaussMap(slots, modules, covered, projection.options, projection.record)

    def layer_sums(self) -> ProjectedSums:
        return ProjectedSums(outer=gauss_outer_sums)


register_structure(LayerGaussStructure())

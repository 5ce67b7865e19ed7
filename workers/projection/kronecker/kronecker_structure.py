"""``projection.structure: kronecker``: each Kronecker layer's gradient projected inside the
backward as ``P_out dW P_in^T``, the rest kept, projected densely or sketched.

Holds ``KroneckerOptions`` (its keys) and ``KroneckerStructure``: the plan of its map
(``projection.KroneckerMap``; the split of ``dim`` among layers measured on the first block of
classes, ``allocation: norm``, and recorded, so every worker and every resume reuses it), its layer
sums (``layer_rules.kronecker_sums``), and ``classgrad inspect``'s lines for its record (every
layer's factor shapes and columns)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field
from torch import nn

from classgrad.config.fields import StrictPositiveInt
from classgrad.config.projection import DEFAULT_KIND, DEFAULT_SKETCH_NONZEROS, ProjectionConfig, ProjectionKind
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.layer_rules.registry import ProjectedSums
from classgrad.workers.engines.partitioned.projected_engine import MeasureRows
from classgrad.workers.projection.base import ProjectionStructure, ResolvedProjection
from classgrad.workers.projection.kronecker import kronecker_sums
from classgrad.workers.projection.kronecker.kronecker_map import MEASURE_CLASSES, KroneckerMap
from classgrad.workers.projection.registration import register_structure

log = logging.getLogger(__name__)


class KroneckerOptions(ProjectionConfig):
    """`structure: kronecker`: each Linear, Conv1d/2d/3d, Embedding and transformers' Conv1D layer
    projected as P_out W P_in^T inside the backward, the other parameters as `rest` says (fast, but
    far noisier where a class's gradient has low rank: heads, few samples)."""

    kind: ProjectionKind = Field(
        DEFAULT_KIND, description="Distribution of the factors' (and a dense rest's) entries: random signs or Gaussian."
    )
    rest: Literal["dense", "keep", "sketch"] = Field(
        "sketch",
        description="Parameters outside the Kronecker layers (norms, position embeddings, grouped convolutions, "
        "low-rank layers) projected by a sparse sign sketch (sketch: each parameter added with a random sign to "
        "`sketch_nonzeros` columns, one per block of the rest's columns; `kind` does not apply to it), densely "
        "(dense: 2 k flops per parameter, a thinner error tail where a head's bias dominates the rows), or stored "
        "whole (keep). Stores made before sketch was the default (dense) resume with rest: dense set.",
    )
    sketch_nonzeros: StrictPositiveInt = Field(
        DEFAULT_SKETCH_NONZEROS,
        description="rest: sketch: columns each parameter of the rest is sent to (s; at most the rest's width).",
    )
    allocation: Literal["norm", "size"] = Field(
        "norm",
        description="How dim is split among layers: in proportion to each layer's squared gradient norm measured "
        f"on the first {MEASURE_CLASSES} classes (norm, recorded in the store) or to its parameter count (size).",
    )
    low_rank: Literal["dense", "kronecker"] = Field(
        "dense",
        description="Layers that see one token per sample (a classifier head, a pooler: per-class gradients of "
        "rank at most the class's sample count, where a Kronecker projection is far noisier than a dense one) "
        f"join the rest (dense), found on the first {MEASURE_CLASSES} classes and recorded; or are projected like "
        "the others (kronecker).",
    )
    dense_layers: list[str] = Field(
        default_factory=list,
        description="Module name patterns (fnmatch) of more layers left to the rest.",
    )


class KroneckerStructure(ProjectionStructure[KroneckerOptions]):
    name = "kronecker"
    options = KroneckerOptions
    in_backward = True
    unit_family = "kronecker"

    def plan(
        self,
        projection: ResolvedProjection[KroneckerOptions],
        slots: Sequence[ParamSlot],
        modules: dict[str, nn.Module],
        covered: set[str],
        measure: MeasureRows | None,
    ) -> KroneckerMap:
        """With ``measure`` None (a training log) nothing is measured: the split by size, and
        low-rank layers found only by ``dense_layers``."""
        options, record = projection.options, projection.record
        dense_layers = tuple(options.dense_layers)
        if record is not None:  # the layers the driver left to the rest, low-rank ones included
            dense_layers = tuple(record.get("dense_layers") or ())
        settings: dict[str, Any] = {
            "dim": projection.dim,
            "kind": options.kind,
            "seed": options.seed,
            "rest_mode": options.rest,
            # Nothing measured (a training log): the split by size, and recorded so.
            "allocation": options.allocation if measure is not None or record is not None else "size",
            "sketch_nonzeros": options.sketch_nonzeros,
            "low_rank": options.low_rank,
        }
        kmap = KroneckerMap.plan(slots, modules, covered, fixed=record, dense_layers=dense_layers, **settings)
        if record is None and kmap.units and measure is not None:
            kmap = self._measured(measure, slots, kmap, modules, covered, dense_layers, settings)
        log.info(
            "kronecker projection: %d layers in %d columns, rest %s (%d parameters) in %d",
            len(kmap.units),
            kmap.units_width,
            kmap.rest_mode,
            kmap.rest_size,
            kmap.dim - kmap.units_width,
        )
        return kmap

    @staticmethod
    def _measured(
        measure: MeasureRows,
        slots: Sequence[ParamSlot],
        kmap: KroneckerMap,
        modules: dict[str, nn.Module],
        covered: set[str],
        dense_layers: tuple[str, ...],
        settings: dict[str, Any],
    ) -> KroneckerMap:
        """The first block of classes, projected with the split by size: the layers whose gradient
        reaches one token per sample (``low_rank: dense``) join the rest, and every part's squared
        norm sets the split (``allocation: norm``)."""
        measured = kmap.measure(measure(kmap, MEASURE_CLASSES))
        low_rank = settings["low_rank"]
        is_low = [low_rank == "dense" and u.positions is not None and u.positions <= 1 for u in kmap.units]
        if any(is_low):
            positions = {u.weight.name: u.positions for u in kmap.units}
            low_names = tuple(u.weight.name.rpartition(".")[0] for u, flag in zip(kmap.units, is_low) if flag)
            moved = sum(m for m, flag in zip(measured, is_low) if flag)
            measured = [m for m, flag in zip(measured, is_low) if not flag] + [measured[-1] + moved]
            kmap = KroneckerMap.plan(slots, modules, covered, dense_layers=(*dense_layers, *low_names), **settings)
            for u in kmap.units:
                u.positions = positions[u.weight.name]
        return kmap.remeasured(measured) if settings["allocation"] == "norm" else kmap

    def layer_sums(self) -> ProjectedSums:
        return ProjectedSums(
            outer=kronecker_sums.projected_outer_sums, embedding=kronecker_sums.projected_embedding_sums
        )

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        """Every layer's factor shapes and columns, then the rest."""
        units = record.get("units") or []
        lines = [
            f"projection  kronecker ({record.get('kind')}, seed {record.get('seed')}, split by "
            f"{record.get('allocation')}) to {width} dims from {record.get('dim_in')}: {len(units)} layers "
            "projected as P_out W P_in^T",
        ]
        name_width = max([len(str(u.get("param"))) for u in units] + [5])
        for u in units:
            (ko, a), (ki, b) = u["factor_shapes"]
            bias = " + bias" if u.get("bias") else ""
            norm = u.get("measured_sq_norm")
            measured = "" if norm is None else f"  measured |g|^2 {norm:.4g}"
            where = f"{u['width']:>7,} cols at {u['offset']}"
            lines.append(f"  {u['param']:<{name_width}}  [{a}x{b}]{bias:<7} -> {ko} x {ki} = {where}{measured}")
        rest = record.get("rest_params") or []
        if rest:
            sketch = record.get("rest_sketch") or {}
            how = {
                "keep": "kept whole",
                "sketch": f"sparse sign sketch, {sketch.get('nonzeros')} nonzeros per parameter",
            }.get(str(record.get("rest")), "projected densely")
            lines.append(
                f"  rest ({how}): {record.get('rest_width')} cols at {record.get('rest_offset')}: {', '.join(rest[:8])}"
                f"{' ...' if len(rest) > 8 else ''}"
            )
        return lines


register_structure(KroneckerStructure())

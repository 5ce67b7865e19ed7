"""Downstream jobs on a finished store: one module per role, all built on ``classgrad.store``.

- ``similarity``: the C x C class similarity (cosine or dot) and its top-k neighbour table,
  computed out of core as Ray tasks (or in-process) and written back into the store.
- ``aggregate``: a weighted combination of rows (mean, or per-class weights) written as a
  state-dict-shaped gradient (safetensors), and ``load_into_grad`` for an optimizer step.
- ``inspect``: shape, layout, completion, per-class and per-parameter gradient norms.
- ``verify``: completeness, checksums, NaN/Inf, metadata; the exit-code bit flags.
- ``plot``: PNGs (similarity heatmap in clustered order, norm histogram, per-parameter bars).
- ``score_api``, ``score_driver``, ``scoring``, ``score_precondition``: ``classgrad score``.
- ``log_rows``, ``log_score``, ``log_similarity``, ``log_plot``: the same commands on a training
  log (``GradLog``): its windows read as a store's rows, TracIn scores, one window's similarity,
  its PNGs.
- ``blocks``: what they share (reads in blocks within a memory budget, completion, helpers),
  re-exported here.
"""

from __future__ import annotations

from classgrad.service.analysis.blocks import (
    DEFAULT_BLOCK_MB,
    MIB,
    BlockPlan,
    ceil_div,
    completion,
    cosine_from_gram,
    done_ranges,
    finite_summary,
    iter_tiles,
    plan_blocks,
    spans,
    validated,
)
from classgrad.units import fmt_bytes  # the one size formatter, as the analyses print it

__all__ = [
    "fmt_bytes",
    "DEFAULT_BLOCK_MB",
    "MIB",
    "BlockPlan",
    "plan_blocks",
    "done_ranges",
    "completion",
    "iter_tiles",
    "cosine_from_gram",
    "finite_summary",
    "ceil_div",
    "spans",
    "validated",
]

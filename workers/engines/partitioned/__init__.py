"""The partitioned engine, as a package of its strategies.

Holds the public names: ``PartitionedEngine`` (``engine``), ``plan_packs``/``plan_runs``
(``packing``) and ``GROUP_BYTES``. The parts: ``engine`` (the choice of path and the checked
loop), ``packing`` (which classes go through one pass), ``hook_path`` with ``capture`` and
``input_format`` (per-class sums from hooks, by the layer rules in
``classgrad.workers.engines.layer_rules``), ``vmap_path`` (``torch.func.vmap`` over packed classes).
"""

from __future__ import annotations

from classgrad.workers.engines.partitioned.engine import GROUP_BYTES, PartitionedEngine
from classgrad.workers.engines.partitioned.packing import plan_packs, plan_runs

__all__ = ["GROUP_BYTES", "PartitionedEngine", "plan_packs", "plan_runs"]

"""classgrad: per-class gradients of PyTorch models, computed on Ray into a chunked Zarr store.

Holds the public Python API, the names DESIGN.md promises:

- ``per_class_gradients(model, data, num_classes=C, ...)``: the rows in this process, no Ray.
- ``open_store(url)``: read a store (true values, parameter views, completeness).
- ``open_dataset(url)``: a store as a lazy xarray Dataset of float32 true values, with coordinates.
- ``JobConfig`` and ``load_config(path, overrides)``: a job's typed config.
- ``run_job(config)``: run a job on Ray from Python, as ``classgrad run`` does.
- ``PerClassGradScaler``: the ``GradScaler`` step of a training loop, with every class's row.
- ``GradLog``: those rows over a training run, summed over windows of steps into a store.
- ``GradLogCallback`` / ``GradLogLightningCallback``: a Hugging Face / Lightning ``Trainer``
  logs into a ``GradLog`` (they need transformers / lightning: not in ``__all__``).
- ``score(store, model, data, method="trak", top_k=10)``: the classes each query example leans
  on (query rows in the store's space scored against every class's row), as ``classgrad score``.
- ``__version__``.

The package is small on purpose: the driver side is ``classgrad.service``, the compute side
``classgrad.workers``. Names are resolved on first use so that ``import classgrad`` (and the
CLI, which lives under it) does not pay for torch or Ray before it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from classgrad.config.choices import set_loader
from classgrad.version import __version__

if TYPE_CHECKING:
    from classgrad.config import JobConfig, load_config
    from classgrad.service.analysis.score_api import score
    from classgrad.service.driver_runtime.driver import run_job
    from classgrad.store import open_dataset, open_store
    from classgrad.workers.gradients import per_class_gradients
    from classgrad.workers.training import GradLog, PerClassGradScaler
    from classgrad.workers.training.hf_callback import GradLogCallback as GradLogCallback
    from classgrad.workers.training.lightning_callback import GradLogLightningCallback as GradLogLightningCallback

# public name -> the module that defines it (imported on first access: torch and Ray are slow to load)
_EXPORTS = {
    "per_class_gradients": "classgrad.workers.gradients",
    "open_store": "classgrad.store",
    "open_dataset": "classgrad.store",
    "JobConfig": "classgrad.config",
    "load_config": "classgrad.config",
    "run_job": "classgrad.service.driver_runtime.driver",
    "PerClassGradScaler": "classgrad.workers.training",
    "GradLog": "classgrad.workers.training",
    # Optional dependencies (transformers, lightning): imported only when the name is used, and
    # kept out of __all__ so that `from classgrad import *` never needs them.
    "GradLogCallback": "classgrad.workers.training.hf_callback",
    "GradLogLightningCallback": "classgrad.workers.training.lightning_callback",
    "score": "classgrad.service.analysis.score_api",
}

__all__ = [
    "GradLog",
    "JobConfig",
    "PerClassGradScaler",
    "__version__",
    "load_config",
    "open_dataset",
    "open_store",
    "per_class_gradients",
    "run_job",
    "score",
]


# The config's registry-backed keys (engine.kind, loss.kind, projection.structure and .kind) take
# the names the compute side registers; it is imported the first time a config checks one.
set_loader(lambda: importlib.import_module("classgrad.workers.gradients"))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'classgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

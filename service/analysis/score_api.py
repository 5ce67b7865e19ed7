"""``classgrad.score``: which classes a model's predictions lean on: query examples scored
against every class's gradient row of one store, or of several checkpoints' stores.

Holds ``score`` (the Python API: stores, a model and query data in; ``Scores`` out),
``QueryFile`` with ``load_query_file`` (the YAML file of ``classgrad score --queries``: a job's
``data`` section, the query function, an optional group field) and ``query_data`` (the query
set and its groups from such a file).

The query rows come from ``classgrad.workers.actor_runtime.query`` (the store's own row definition,
one row per example, or per group), one set per store (each checkpoint's model makes its own);
the scores from ``score_driver.score_rows``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from classgrad.config import DataConfig
from classgrad.errors import ConfigError, InputError
from classgrad.service.analysis import validated
from classgrad.service.analysis.score_driver import Scores, check_stores, score_rows
from classgrad.service.analysis.score_precondition import trak_form
from classgrad.service.analysis.scoring import ScoreConfig
from classgrad.store import open_store
from classgrad.workers.actor_runtime.factory import call_factory
from classgrad.workers.actor_runtime.query import query_rows


class QueryFile(BaseModel):
    """The file of ``classgrad score --queries``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or NaN options: refused in one line

    data: DataConfig = Field(description="The query set, as a job's `data` section (a factory and its kwargs...).")
    fn: str = Field(
        "loss",
        description="The query function: `loss` (the store's loss on the query's label), `margin` (the logit "
        "margin, signed like a loss), or `module:function` taking (outputs, targets) and returning [n].",
    )
    group_field: str | None = Field(
        None, description="A key of dict samples holding a group id: one row per group (its examples' mean)."
    )


def load_query_file(path: str | Path) -> QueryFile:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--queries {str(path)!r}: no such file")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--queries {str(path)!r}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except UnicodeDecodeError:  # a .npy of query rows, say: the file names a factory, it holds no rows
        raise ConfigError(
            f"--queries {str(path)!r}: not a text file (a YAML file naming the query set's data.factory)"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--queries {str(path)!r}: expected a mapping with a 'data' section")
    data = raw.get("data")
    if not isinstance(data, dict) or "factory" not in data:
        # A job's data section defaults its factory; a query set's must be named (the default
        # probe would score examples the user never asked about).
        has = f" (data has: {', '.join(sorted(map(str, data)))})" if isinstance(data, dict) and data else ""
        raise ConfigError(f"--queries {str(path)!r}: data.factory is missing: name the factory of the query set{has}")
    return validated(QueryFile, f"--queries {path}", flags=False, **raw)


def query_data(spec: QueryFile) -> tuple[Any, list | None]:
    """The query set a file describes (its factory's result) and the group of each example."""

    data = call_factory(spec.data.factory, dict(spec.data.kwargs), "data.factory")
    if spec.group_field is None:
        return data, None
    samples = [data[i] for i in range(len(data))] if hasattr(data, "__getitem__") and hasattr(data, "__len__") else []
    if not samples or not all(isinstance(x, Mapping) and spec.group_field in x for x in samples):
        raise InputError(f"group_field {spec.group_field!r}: the query samples are not dicts holding it")
    groups = [x[spec.group_field] for x in samples]
    return data, [g.item() if hasattr(g, "item") else g for g in groups]


def _open(store: Any, mode: Literal["r", "r+"], storage_options: dict | None) -> Any:

    url = store if isinstance(store, str) else store.url
    return open_store(url, storage_options=storage_options, mode=mode)


def score(
    store: Any,
    model: Any = None,
    data: Any = None,
    *,
    method: str = "trak",
    top_k: int = 10,
    fn: str | Callable = "loss",
    groups: Sequence[Any] | None = None,
    weights: Sequence[float] | None = None,
    damping: float | None = None,
    out: str | None = None,
    storage_options: dict | None = None,
    device: str | None = None,
    batch_size: int | None = None,
    label_field: str | None = None,
    collate: Any = None,
    pad_values: dict | None = None,
    **options: Any,
) -> Scores:
    """The ``top_k`` classes of ``store`` whose gradient rows score highest for each query example.

    ``store``: an opened store or its URL, or a list of them (several checkpoints of one job:
    scores summed with ``weights``). ``model``: the model the store was made from (a list: one per
    store; default: built from each store's recorded config). ``data``: the query examples, as
    ``per_class_gradients`` takes data. ``method``: ``dot``, ``cosine`` or ``trak``; ``fn``:
    ``loss``, ``margin`` or ``fn(outputs, targets) -> [n]``; ``groups``: a group id per example
    (one row per group). ``out``: a Zarr location for the results (resumable; ``full=True`` also
    writes every query x class score). Other ``options`` are ``ScoreConfig`` fields
    (``damping_fraction``, ``task_mb``, ``executor``...). Returns ``Scores`` (``.class_ids``,
    ``.scores``: ``[Q, top_k]`` tensors, best first; ``.to_xarray()``)."""

    if data is None:
        raise InputError("score: give the query examples (data=...)")
    config: ScoreConfig = validated(
        ScoreConfig,
        "score",
        method=method,
        top_k=top_k,
        damping=damping,
        weights=None if weights is None else list(weights),
        **options,
    )
    given = list(store) if isinstance(store, (list, tuple)) else [store]
    models = list(model) if isinstance(model, (list, tuple)) else [model] * len(given)
    if len(models) != len(given):
        raise InputError(f"score: {len(models)} models for {len(given)} stores (one per store, or one for all)")
    mode: Literal["r", "r+"] = (
        "r+" if config.method == "trak" else "r"
    )  # trak saves each store's preconditioner beside its rows
    stores = [_open(s, mode, storage_options) for s in given]
    check_stores(stores)  # before any model runs, as are the checks below
    if config.method == "trak":
        trak_form(stores[0], config.precond_mb)
    if config.full and out is None:
        raise ConfigError("score option full (--all-scores): every query x class score needs an output (--out)")
    rows, digest = [], hashlib.sha256(b"classgrad queries v1")
    for s, m in zip(stores, models):
        q = query_rows(
            s,
            data,
            model=m,
            fn=fn,
            groups=groups,
            batch_size=batch_size,
            label_field=label_field,
            collate=collate,
            pad_values=pad_values,
            device=device,
        )
        rows.append(q.rows.numpy())
        digest.update(q.digest.encode())
    ids = None if q.groups is None else [str(g) for g in q.groups]
    return score_rows(
        stores, rows, config, queries_digest=digest.hexdigest(), groups=ids, out=out, storage_options=storage_options
    )

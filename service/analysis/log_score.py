"""``classgrad score LOG``: which classes of a training run a model's predictions lean on, from a
training log (``GradLog``): class-level TracIn over the log's windows, the query side at one
checkpoint.

Holds ``score_log`` (the Python API: a log, a model and query data in; ``Scores`` out, the same
result ``classgrad.score`` gives) and ``log_query_space`` (the log's row definition in the form
``workers.actor_runtime.query.query_rows`` reads a store's).

What is computed, exactly. For query example q and class c, over the chosen windows W:

    score[q, c] = sum_{w in W} < g_q, lr_grads[w, c] >
    lr_grads[w, c] = sum_{t in w} lr_t * S r_{c,t}(theta_t)     (what the log holds)
    g_q = S grad_theta loss(q; theta*)                          (the query's row)

with ``r_{c,t}(theta_t)`` class c's row at step t (the gradient of the class's mean loss over
its samples in that step, at that step's parameters: exact per step, as the log summed it),
``lr_t`` the step's learning rate, ``S`` the log's map (the structure its ``projection`` record
names, TensorSketch or a sparse sign sketch, rebuilt from the record by the code that projects a
job's rows, so the query rows land in the log's columns; none when the log holds whole rows),
and ``theta*`` the one set of parameters of the model given (a checkpoint). It is TracIn-CP with
a single checkpoint on the query side: the class side follows training step by step, the query
side does not (a log holds sums over steps, so a query row at each step's parameters cannot be
formed from it). A positive score: the logged steps of class c moved the parameters, to first
order, in a direction that lowers the query's loss. Classes absent from every chosen window
score 0.

The log records its parameter layout, its projection and the model's class, not how to build the
model nor its loss: the model is given (an ``nn.Module``, or a ``module:function`` factory with
its kwargs and a checkpoint), must be of the logged class and select the logged parameters
(names and shapes); the query function ``loss`` is the per-sample cross-entropy (what
``PerClassGradScaler.step_batch`` logs the rows of), or ``margin`` or ``module:function`` as
``classgrad score`` takes. Query rows come from ``query_rows`` (the partitioned engine, each
example its own class, fp32, eval mode, its projection record compared whole with the log's); the
scores from ``scoring.score_block`` over the windows' ``lr_grads`` summed (``LogRows``), in this
process, query block by query block within ``task_mb``.
"""

from __future__ import annotations

import glob
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from classgrad.errors import InputError
from classgrad.service.analysis import validated
from classgrad.service.analysis.log_rows import LogRows, fmt_windows, pick_windows
from classgrad.service.analysis.score_driver import Scores
from classgrad.service.analysis.scoring import ScoreConfig, plan_scores, score_block
from classgrad.store.core.params import ParamSlot
from classgrad.store.training_log.log_store import LogReader, open_log_reader
from classgrad.workers.actor_runtime.factory import build_model
from classgrad.workers.actor_runtime.query import query_rows

log = logging.getLogger(__name__)

METHOD = "tracin"  # the name a log's scores carry (dot products summed over windows)


@dataclass
class LogQuerySpace:
    """A log's row definition as ``query_rows`` reads a store's: ``attrs`` holds the job config
    that defines the same rows (the logged parameters by name, cross-entropy, fp32, eval mode,
    the log's map) and the log's projection record; ``layout`` and ``dim`` its columns."""

    url: str
    dim: int
    layout: list[ParamSlot]
    attrs: dict = field(default_factory=dict)


def log_query_space(reader: LogReader, factory: str | None = None) -> LogQuerySpace:
    """The query side's definition of ``reader``'s rows (``factory``: the model's, when known)."""
    spec = reader.spec
    slots, offset = [], 0
    for name, shape in spec.layout:
        size = int(np.prod(shape, dtype=np.int64))
        slots.append(ParamSlot(str(name), tuple(int(s) for s in shape), offset, size))
        offset += size
    record = spec.projection
    # The log's map as a job's projection section: the structure and seed it recorded, every
    # other setting at its default (GradLog sets no other); query_rows rebuilds the map from it
    # and the record, and compares what it would record with the log's record, whole.
    projection = (
        {} if record is None else {"dim": spec.width, "seed": record.get("seed"), "structure": record.get("structure")}
    )
    config: dict[str, Any] = {
        "model": {"mode": "eval", **({"factory": factory} if factory else {})},
        "loss": {"kind": "cross_entropy", "num_classes": spec.num_classes},
        # The logged parameters by their names (escaped: a name is a pattern to the selection).
        "params": {"include": [glob.escape(s.name) for s in slots]},
        "projection": projection,
    }
    return LogQuerySpace(url=reader.url, dim=spec.width, layout=slots, attrs={"config": config, "projection": record})


def _model(
    reader: LogReader, model: nn.Module | str, model_kwargs: dict | None, checkpoint: str | None
) -> tuple[nn.Module, str | None]:
    if isinstance(model, str):
        built = build_model(model, model_kwargs, checkpoint, "eval")
        factory: str | None = model
    elif isinstance(model, nn.Module):
        if model_kwargs or checkpoint:
            raise InputError("score_log: model_kwargs and checkpoint go with a model factory ('module:function')")
        built, factory = model, None
    else:
        raise InputError(f"score_log: model must be an nn.Module or a 'module:function' factory, got {model!r}")
    name = type(built).__qualname__
    if reader.spec.model and name != reader.spec.model:
        raise InputError(
            f"the query model is a {name}, grad log {reader.url} was written for a {reader.spec.model}: "
            "give the model the log was made from"
        )
    return built, factory


def score_log(
    url: str,
    model: nn.Module | str,
    data: Any,
    *,
    windows: str | int | Sequence[int] | None = None,
    top_k: int = 10,
    fn: str | Callable = "loss",
    groups: Sequence[Any] | None = None,
    model_kwargs: dict | None = None,
    checkpoint: str | None = None,
    storage_options: dict | None = None,
    device: str | None = None,
    batch_size: int | None = None,
    label_field: str | None = None,
    collate: Any = None,
    pad_values: dict | None = None,
    **options: Any,
) -> Scores:
    """The ``top_k`` classes of the training log at ``url`` with the highest TracIn scores for
    each query example (see the module's docstring for the exact sum).

    ``model``: the model at the checkpoint the query rows are taken at (an ``nn.Module``, or a
    ``module:function`` factory built with ``model_kwargs`` and ``checkpoint``); ``data``: the
    query examples, as ``per_class_gradients`` takes data; ``windows``: ``"all"`` (default),
    ``"last"``, indices, or text such as ``"0-3,7"``; ``fn``: ``loss`` (cross-entropy),
    ``margin`` or ``fn(outputs, targets) -> [n]``; ``groups``: a group id per example (one row
    per group). ``options``: ``task_mb`` and ``block_rows`` (``ScoreConfig``). Returns
    ``Scores`` (``[Q, top_k]`` class ids and scores, best first; ``info``)."""
    if data is None:
        raise InputError("score_log: give the query examples (data=...)")
    config: ScoreConfig = validated(ScoreConfig, "score", method="dot", top_k=top_k, executor="local", **options)
    reader = open_log_reader(url, storage_options=storage_options)
    chosen = pick_windows(reader, windows)
    rows = LogRows(reader, chosen, "lr_grads")
    net, factory = _model(reader, model, model_kwargs, checkpoint)
    q = query_rows(
        log_query_space(reader, factory),
        data,
        model=net,
        fn=fn,
        groups=groups,
        batch_size=batch_size,
        label_field=label_field,
        collate=collate,
        pad_values=pad_values,
        device=device,
    )
    queries = q.rows.numpy()[None]  # [1, Q, width]: the windows' rows are read as one store's
    Q = queries.shape[1]
    if Q == 0:
        raise InputError("score_log: the query set is empty")
    plan = plan_scores(Q, rows, config, num_stores=1, form=None)
    t0 = time.perf_counter()
    best = np.empty((Q, plan.top_k), dtype=np.int64)
    values = np.empty((Q, plan.top_k), dtype=np.float32)
    for a, b in plan.blocks():
        best[a:b], values[a:b] = score_block([rows.block], queries[:, a:b], [1.0], plan)
    steps = [reader.read("steps", w) for w in chosen]
    info = {
        "method": METHOD,
        "log": url,
        "windows": chosen,
        "windows_text": fmt_windows(chosen),
        "steps": [int(steps[0][0]), int(steps[-1][1])],
        "fn": q.fn,
        "num_queries": Q,
        "num_classes": plan.num_classes,
        "dim": plan.dim,
        "top_k": plan.top_k,
        "block_rows": plan.block_rows,
        "stream_rows": plan.stream_rows,
        "seconds": time.perf_counter() - t0,
        "memory_bound_bytes": plan.memory_bound()["total"],
    }
    log.info("tracin scores of %d queries x %d classes over windows %s", Q, plan.num_classes, info["windows_text"])
    ids = None if q.groups is None else [str(g) for g in q.groups]
    return Scores(
        class_ids=torch.from_numpy(best.copy()),  # a log's class ids are its rows
        scores=torch.from_numpy(values),
        rows=torch.from_numpy(best),
        class_names=None,
        method=METHOD,
        info=info,
        groups=ids,
    )

"""Query rows in a store's space: one row per query example (or group), computed with the
store's own row definition, so that a query row and a class row can be compared.

Holds ``store_job_config`` (the job config a store recorded), ``QueryLoss`` (each query example
its own "class" of the partitioned engine, its loss the query function of its own label),
``query_function`` (``loss``: the store's loss on the query's label; ``margin``: the logit
margin, signed like a loss; or ``fn(outputs, targets) -> [n]``), ``QueryRows`` and
``query_rows``.

How. The store records the job config it was made from and what its rows' projection is
(``projection``: structure, seed, factors, split of ``dim``). The query side builds its engine
exactly as a worker does (``factory.engine_from_parts`` with the store's config and record,
``stored_rows.build_projector`` and ``stored_rows.stored_blocks``), over the query examples with the
partitioned engine and every example its own group: about one forward and backward over the
query set. So every projection structure is applied by the code that applies it for the store
(dense, sketch, kronecker and any later one the engines or the row projector learn), never by
this module; what the query engine would record (``stored_rows.projection_record``) must equal the
store's record, or nothing is computed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from classgrad.config import JobConfig
from classgrad.errors import InputError, StoreError, first_line
from classgrad.workers.actor_runtime.factory import build_model, engine_from_parts, preflight
from classgrad.workers.actor_runtime.stored_rows import (
    build_projector,
    project_rows_for,
    projection_record,
    stored_blocks,
)
from classgrad.workers.imports import import_object
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import PartitionedLoss, check_label_range, create_loss
from classgrad.workers.model_io import input_pad_values
from classgrad.workers.probe import ProbeSet

log = logging.getLogger(__name__)

QUERY_FUNCTIONS = ("loss", "margin")
SampleFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def store_job_config(store: Any) -> JobConfig:
    """The job config ``store`` was made from (its recorded ``config`` attribute)."""
    recorded = store.attrs.get("config")
    if not isinstance(recorded, dict):
        raise StoreError(f"store {store.url} has no recorded job config; its rows' definition is unknown")
    try:
        return JobConfig.model_validate(recorded)
    except ValueError as exc:
        raise StoreError(f"store {store.url}: its recorded job config does not validate ({first_line(exc)})") from None


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _margin(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-(z_y - logsumexp_{j != y} z_j): TRAK's margin, negated so that it is signed like a loss."""
    z = _upcast(outputs)
    own = z.gather(1, labels.long()[:, None]).squeeze(1)
    others = z.scatter(1, labels.long()[:, None], float("-inf"))
    return torch.logsumexp(others, dim=1) - own


def query_function(fn: str | SampleFn, config: JobConfig) -> tuple[SampleFn, str]:
    """The per-sample query function ``fn(outputs [n, C], targets [n]) -> [n]`` and its name."""
    if callable(fn):
        return fn, getattr(fn, "__qualname__", "custom")
    if fn == "margin":
        return _margin, "margin"
    if fn != "loss":
        if ":" in fn:
            found = import_object(fn, what="query fn")
            if not callable(found):
                raise InputError(f"query fn {fn!r} is not callable")
            return found, fn
        raise InputError(f"query fn {fn!r} is unknown (choices: {', '.join(QUERY_FUNCTIONS)}, or 'module:function')")
    base = create_loss(config.loss.kind, config.loss.num_classes)
    if isinstance(base, PartitionedLoss):
        return base.sample_losses, f"loss ({base.name})"
    if base.name == "logit":  # the store's L_c is the mean logit of class c: the query's own logit
        return (lambda out, y: _upcast(out).gather(1, y.long()[:, None]).squeeze(1)), "loss (logit)"
    raise InputError(
        f"query fn 'loss': the store's loss {base.name!r} is not one per sample; "
        f"give fn='margin' or a function fn(outputs, targets) -> [n]"
    )


def _check_labels(labels: torch.Tensor, num_classes: int) -> None:
    """Query labels are the store's classes: one line before any model runs (an out-of-range label
    failed inside the hook path, whose refusal advised a dense projection)."""
    if labels.ndim != 1:
        return  # multi-hot or soft targets: what the loss itself checks
    if labels.is_floating_point():  # margin took them as they were; the loss failed inside the engine
        raise InputError(
            f"query labels are {str(labels.dtype).removeprefix('torch.')}: give the store's integer class ids "
            "(one per example)"
        )
    check_label_range(labels, num_classes, prefix="query labels outside the store's classes", item="example")


class QueryLoss(PartitionedLoss):
    """Every query example its own class: the probe set's targets are example indices, and
    example i's loss is ``fn(outputs, labels[i])`` on its own label."""

    def __init__(self, labels: torch.Tensor, output_width: int, fn: SampleFn, name: str):
        self._labels = labels
        self._width = int(output_width)
        self._fn = fn
        super().__init__(len(labels), self._per_sample, name)

    def _per_sample(self, outputs: torch.Tensor, examples: torch.Tensor) -> torch.Tensor:
        labels = self._labels.to(examples.device)[examples]
        return self._fn(outputs, labels)

    def check_outputs(self, outputs: torch.Tensor) -> None:
        if outputs.ndim != 2 or outputs.shape[1] != self._width:
            raise InputError(
                f"model output has shape {tuple(outputs.shape)}, expected (batch, {self._width}) "
                f"for the store's loss.num_classes={self._width}"
            )


@dataclass
class QueryRows:
    """Rows of the query examples (or groups) in a store's space."""

    rows: torch.Tensor  # float32 [G, width] on the CPU
    labels: torch.Tensor  # targets of the examples (CPU), in query order
    groups: np.ndarray | None  # each row's group id (None: one row per example)
    digest: str  # of the query set as built, the function and the grouping
    fn: str


@contextlib.contextmanager
def _in_mode(model: nn.Module, mode: str) -> Iterator[None]:
    before = [(m, m.training) for m in model.modules()]
    model.train(mode == "train")
    try:
        yield
    finally:
        for module, training in before:
            module.training = training


def _normalised(record: Any) -> Any:
    return json.loads(json.dumps(record, sort_keys=True, default=str))


def _check_layout(store: Any, slots: Sequence[Any], record: dict | None) -> None:
    """The model's selected parameters are the store's (a projected store records only the
    width they make, ``dim_in``; its record is compared whole afterwards)."""
    got = [(s.name, tuple(s.shape)) for s in slots]
    if not store.layout and record:
        width = sum(s.size for s in slots)
        if record.get("dim_in") not in (None, width):
            raise InputError(
                f"the query model does not match store {store.url}: its selected parameters make rows of "
                f"{width} values, the store's rows were projected from {record.get('dim_in')}; "
                "give the model the store was made from"
            )
        return
    want = [(s.name, tuple(s.shape)) for s in store.layout]
    if want != got:
        first = next(
            (f"{w} vs {g}" for w, g in zip(want, got) if w != g), f"{len(want)} vs {len(got)} selected parameters"
        )
        raise InputError(
            f"the query model does not match the layout of store {store.url} (store vs model: {first}); "
            "give the model the store was made from"
        )


def _group_ids(groups: Sequence[Any] | np.ndarray | None, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(each example's group position, the group ids in order of first appearance) or (None, None)."""
    if groups is None:
        return None, None
    ids = np.asarray(groups)
    if ids.shape != (n,):
        raise InputError(f"query groups: expected one group id per query example ({n}), got shape {list(ids.shape)}")
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # groups in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse.reshape(-1)], uniq[order]


def query_rows(
    store: Any,
    data: Any,
    *,
    model: nn.Module | None = None,
    fn: str | SampleFn = "loss",
    groups: Sequence[Any] | np.ndarray | None = None,
    batch_size: int | None = None,
    label_field: str | None = None,
    collate: str | Callable[[list[Any]], Any] | None = None,
    pad_values: Mapping[str, float] | None = None,
    device: str | None = None,
) -> QueryRows:
    """One row per query example of ``data`` (or per group of ``groups``, the mean of its
    examples' rows, as a group's loss is their mean) in the space of ``store``'s rows.

    ``model``: the model the store was made from (default: built from the store's recorded
    config, checkpoint included); its selected parameters must match the store's layout.
    ``data``: as ``per_class_gradients`` takes it (a Dataset, a DataLoader, a pair of tensors...);
    a ``ProbeSet`` is taken as it is. Other options default to the store's config."""
    config = store_job_config(store)
    record = store.attrs.get("projection")
    if config.projection.dim is not None and not record:
        raise StoreError(
            f"store {store.url} has no record of its rows' projection (attribute 'projection'); "
            "query rows cannot be put in its space"
        )
    sample_fn, fn_name = query_function(fn, config)
    dev = device or config.resolved_device()
    if model is None:
        model = build_model(config.model.factory, config.model.kwargs, config.model.checkpoint, config.model.mode)
    d = config.data
    collate = collate if collate is not None else d.collate
    pads = input_pad_values(model, collate, pad_values if pad_values is not None else d.pad_values)
    probe = (
        data
        if isinstance(data, ProbeSet)
        else ProbeSet(
            data,
            batch_size=batch_size or d.batch_size,
            label_field=label_field if label_field is not None else d.label_field,
            collate=collate,
            pad_values=pads,  # input_ids: the model's pad id, as the store's own probe set
        )
    )
    n = len(probe)
    position, group_ids = _group_ids(groups, n)
    h = hashlib.sha256(b"classgrad query set v1")
    h.update(probe.digest.encode())
    h.update(fn_name.encode())
    if group_ids is not None:
        h.update(np.ascontiguousarray(position).tobytes())
    labels = probe.targets
    if fn_name == "margin" or fn_name.startswith("loss"):  # built-in functions read each example's label
        _check_labels(labels, config.loss.num_classes)
    # The engine's classes are the examples: its targets become their indices; the labels stay
    # with the loss, which looks each example's own label up.
    probe.targets = torch.arange(n)
    loss = QueryLoss(labels, config.loss.num_classes, sample_fn, fn_name)
    try:
        with _in_mode(model, config.model.mode):
            selected = ParamLayout.from_model(model, include=config.params.include, exclude=config.params.exclude)
            _check_layout(store, selected.slots, record)
            engine = engine_from_parts(config, model, probe, loss, device=dev, record=record, kind="partitioned")
            preflight(engine)  # query data the model cannot take: one line, before any backward
            projector = build_projector(config, engine=engine, record=record)
            mine = projection_record(engine, projector)
            if _normalised(mine) != _normalised(record or None):
                raise InputError(
                    f"the query rows would be projected otherwise than the rows of store {store.url} "
                    f"(recorded projection {str(record)[:120]!r}, query side {str(mine)[:120]!r})"
                )
            out = torch.empty(n, store.dim)
            at = 0
            for block, rows in stored_blocks(engine, projector, list(range(n)), project_rows_for(selected.dim)):
                got = (block.rows if rows is None else rows).float().cpu()
                out[at : at + len(block)] = got
                at += len(block)
    finally:
        probe.targets = labels
    if position is not None:
        assert group_ids is not None
        sums = torch.zeros(len(group_ids), out.shape[1], dtype=torch.float64)
        sums.index_add_(0, torch.from_numpy(position), out.double())
        sizes = torch.bincount(torch.from_numpy(position), minlength=len(group_ids)).double()
        out = (sums / sizes[:, None]).float()
    log.info("query rows: %d x %d (%s, %s)", out.shape[0], out.shape[1], fn_name, engine.stats.notes[:1])
    return QueryRows(rows=out, labels=labels, groups=group_ids, digest=h.hexdigest(), fn=fn_name)

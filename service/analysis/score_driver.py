"""The driver of ``classgrad score``: prepared query rows scored against one or more stores, on
Ray or in this process, into memory or a resumable output.

Holds ``Scores`` (the result: ``class_ids``, ``scores`` and ``rows`` as ``[Q, top_k]`` tensors,
best first; ``class_names``; ``to_xarray``), ``row_definition`` (what must agree between
stores scored together), ``check_stores`` and ``score_rows``.

Order of work, so that a bad input writes nothing: the stores are checked (complete, the same
row definition, the query rows as wide as theirs), the method's form chosen (``trak`` refuses a
store too large for either form) and the plan made; only then is the preconditioner computed
and saved (``trak``, once per store) and the output created (or resumed: the blocks marked done
in it are skipped, and the query rows it holds are the ones scored).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from classgrad.errors import ClassgradError, ConfigError, InputError, StoreIncompleteError, first_line
from classgrad.service.analysis import MIB, validated
from classgrad.service.analysis.score_precondition import damping_for, ensure_gram, inverse, trak_form
from classgrad.service.analysis.scoring import ScoreConfig, ScorePlan, plan_scores, score_task
from classgrad.store import fmt_ranges
from classgrad.store.analysis.score_output import ScoreOutput
from classgrad.workers.projection import neighbour_caveat

log = logging.getLogger(__name__)

AUTO_RAY_MACS = 2e11  # executor "auto": Ray above this many multiply-adds (Q x C x k x stores)


@dataclass
class Scores:
    """Each query's best classes, best first (``[Q, top_k]`` tensors)."""

    class_ids: Any  # torch.int64 [Q, k]
    scores: Any  # torch.float32 [Q, k]
    rows: Any  # torch.int64 [Q, k]: the classes' rows in the stores
    class_names: list[list[str]] | None
    method: str
    info: dict = field(default_factory=dict)
    groups: list[str] | None = None  # each row's group id (as text), for rows of groups

    def __len__(self) -> int:
        return int(self.class_ids.shape[0])

    def to_xarray(self):  # -> xarray.Dataset (xarray is optional)
        import xarray as xr

        data = {
            "topk_class_id": (("query", "rank"), self.class_ids.numpy()),
            "topk_score": (("query", "rank"), self.scores.numpy()),
            "topk_row": (("query", "rank"), self.rows.numpy()),
        }
        if self.class_names is not None:
            data["topk_class_name"] = (("query", "rank"), np.array(self.class_names, dtype=object))
        Q, k = self.class_ids.shape
        coords: dict[str, Any] = {"query": np.arange(Q), "rank": np.arange(k)}
        if self.groups is not None:
            coords["group"] = ("query", np.array(self.groups, dtype=object))
        ds = xr.Dataset(data, coords=coords)
        ds.attrs.update({"method": self.method, **{k: str(v) for k, v in self.info.items() if k != "task_reports"}})
        return ds


def row_definition(store: Any) -> dict:
    """What makes two stores' rows the same function of the parameters (checkpoints aside)."""
    config = store.attrs.get("config") or {}
    return json.loads(
        json.dumps(
            {
                "layout": [s.to_dict() for s in store.layout],
                "class_ids": np.asarray(store.class_ids).tolist(),
                "dim": store.dim,
                "projection": store.attrs.get("projection"),
                "loss_kind": store.attrs.get("loss_kind"),
                "precision": (config.get("precision") or {}).get("dtype"),
                "params": config.get("params"),
                "model": {k: (config.get("model") or {}).get(k) for k in ("factory", "mode", "output")},
            },
            sort_keys=True,
            default=str,
        )
    )


def check_stores(stores: list[Any]) -> None:
    """Complete stores of one row definition, or one line saying what differs."""
    for store in stores:
        missing = store.missing_ranges()
        if missing:
            raise StoreIncompleteError(
                f"store {store.url} is incomplete: rows {fmt_ranges(missing)} are not written yet; finish the job first"
            )
    for store in stores:
        caveat = neighbour_caveat(store.attrs.get("projection"))
        if caveat:
            log.warning("store %s: %s", store.url, caveat)
    first = row_definition(stores[0])
    for store in stores[1:]:
        other = row_definition(store)
        if other != first:
            keys = sorted(k for k in first if first[k] != other.get(k))
            raise InputError(
                f"stores {stores[0].url} and {store.url} define their rows differently ({', '.join(keys)}); "
                "scores of several checkpoints add up only over stores of the same job"
            )


def _prepared(stores, queries, config: ScoreConfig, form: str | None, grams: list) -> tuple[np.ndarray, list, dict]:
    """Query rows as the tasks take them ([stores, Q, D] float32), the kernel inverses, and what
    the preconditioner was."""
    out = np.empty((len(stores), *queries[0].shape), dtype=np.float32)
    kinv: list = []
    info: dict = {}
    for s, (store, q) in enumerate(zip(stores, queries)):
        q = np.asarray(q, dtype=np.float32)
        if config.method == "cosine":
            norms = np.sqrt(np.square(q, dtype=np.float64).sum(axis=1))
            out[s] = (q / np.where(norms > 0, norms, 1.0)[:, None]).astype(np.float32)
        elif config.method == "trak":
            gram, attrs = grams[s]
            lam = damping_for(attrs, config.damping, config.damping_fraction)
            inv = inverse(gram, lam, store.url)
            info.setdefault("damping", []).append(lam)
            info.setdefault("preconditioner_checksum", []).append(attrs.get("checksum"))
            if form == "features":
                for r in range(0, q.shape[0], 1024):  # float64 product, a slice at a time
                    out[s, r : r + 1024] = (q[r : r + 1024].astype(np.float64) @ inv).astype(np.float32)
            else:
                out[s] = q
                kinv.append(inv)
        else:
            out[s] = q
    return out, kinv, info


def _request(stores, queries_digest: str, config: ScoreConfig, weights: list[float], form) -> dict:
    """What a resumable output was asked for (the preconditioner follows from the rows' digest)."""
    return {
        "stores": [{"url": s.url, "rows_digest": s.preconditioner.rows_digest()} for s in stores],
        "queries": queries_digest,
        "method": config.method,
        "form": form,
        "damping": config.damping,
        "damping_fraction": config.damping_fraction if config.damping is None else None,
        "weights": weights,
        "top_k": config.top_k,
        "full": config.full,
    }


def score_rows(
    stores: list[Any],
    queries: list[np.ndarray],
    config: ScoreConfig | None = None,
    *,
    queries_digest: str = "",
    groups: list[str] | None = None,
    out: str | None = None,
    storage_options: dict | None = None,
    **options: Any,
) -> Scores:
    """Score query rows (one ``[Q, k]`` array per store) against the stores' rows.

    ``options`` are ``ScoreConfig`` fields. ``out``: a Zarr location for the results (resumable;
    required for ``full``). ``queries_digest``: what identifies the query set in a resume;
    ``groups``: each query row's group id, when the rows are groups'."""
    import torch

    from classgrad.service.driver_runtime.ray_session import ray_session

    if config is None:
        config = validated(ScoreConfig, "score", **options)
    elif options:
        config = validated(ScoreConfig, "score", **{**config.model_dump(), **options})
    if len(queries) != len(stores) or not stores:
        raise InputError(f"score: {len(stores)} stores but {len(queries)} sets of query rows")
    weights = [1.0] * len(stores) if config.weights is None else [float(w) for w in config.weights]
    if len(weights) != len(stores):
        raise ConfigError(f"score option weights: {len(weights)} weights for {len(stores)} stores")
    if config.full and out is None:
        raise ConfigError("score option full (--all-scores): every query x class score needs an output (--out)")
    check_stores(stores)
    first = stores[0]
    Q = int(np.shape(queries[0])[0])
    for store, q in zip(stores, queries):
        if np.ndim(q) != 2 or np.shape(q) != (Q, store.dim):
            raise InputError(f"query rows of shape {list(np.shape(q))} for store {store.url} of rows [C, {store.dim}]")
    if Q == 0:
        raise InputError("score: the query set is empty")
    form = trak_form(first, config.precond_mb) if config.method == "trak" else None
    macs = Q * first.num_classes * first.dim * len(stores)
    executor = config.executor if config.executor != "auto" else ("ray" if macs > AUTO_RAY_MACS else "local")
    if executor == "ray" and any(s.url.startswith("memory://") for s in stores):
        raise ConfigError("a store in this process's memory is not visible to Ray tasks; use the local executor")
    plan_scores(Q, first, config, num_stores=len(stores), form=form)  # sizes checked before anything is written
    request = _request(stores, queries_digest, config, weights, form)
    if out is not None:  # another request's output, or something else, is refused before anything is written
        ScoreOutput.check_target(out, request, storage_options=storage_options, overwrite=config.overwrite)
    grams = [ensure_gram(s, form, recompute=config.recompute_preconditioner) for s in stores] if form else []
    prepared, kinv, pre_info = _prepared(stores, queries, config, form, grams)
    t0 = time.perf_counter()
    session = ray_session(config.address, option="--address") if executor == "ray" else None
    with session if session is not None else nullcontext() as ray:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1) // config.num_cpus)) if ray is not None else 1
        plan = plan_scores(Q, first, config, num_stores=len(stores), form=form, workers=workers)
        target = None
        resumed = False
        if out is not None:
            target, resumed = ScoreOutput.create_or_resume(
                out,
                request,
                query_rows=list(queries),
                class_ids=np.asarray(first.class_ids),
                class_names=first.class_names,
                top_k=plan.top_k,
                block_rows=plan.block_rows,
                class_block=plan.stream_rows,
                full=plan.full,
                groups=groups,
                storage_options=storage_options,
                overwrite=config.overwrite,
            )
            if resumed:  # the blocks of the run that made it, and the rows it scored
                plan = ScorePlan(
                    **{
                        **asdict(plan),
                        "block_rows": int(target.info["block_rows"]),
                        "stream_rows": int(target.info["class_block"]),
                    }
                )
                stored = [target.query_rows(0, Q)[s] for s in range(len(stores))]
                prepared, kinv, pre_info = _prepared(stores, stored, config, form, grams)
        done = target.block_done() if target is not None else np.zeros(len(plan.blocks()), dtype=bool)
        todo = [(i, a, b) for i, (a, b) in enumerate(plan.blocks()) if not done[i]]
        bound = plan.memory_bound()
        log.info(
            "score (%s%s) of %d queries x %d classes x %d: %d of %d blocks of <= %d queries to do, "
            "class blocks of %d, <= %.1f MiB per task, %s",
            plan.method,
            f", {form}" if form else "",
            Q,
            plan.num_classes,
            plan.dim,
            len(todo),
            len(plan.blocks()),
            plan.block_rows,
            plan.stream_rows,
            bound["total"] / MIB,
            executor,
        )
        urls = [s.local_path or s.url for s in stores]
        out_url = None if target is None else (target.local_path or target.url)
        reports = _run(ray, config, urls, storage_options, asdict(plan), todo, prepared, weights, kinv, out_url)
    seconds = time.perf_counter() - t0
    k = plan.top_k
    if target is not None:
        rows, class_ids, values = target.read_topk()
    else:
        rows = np.full((Q, k), -1, dtype=np.int64)
        values = np.full((Q, k), np.nan, dtype=np.float32)
        for r in reports:
            rows[r["start"] : r["stop"]] = r.pop("rows")
            values[r["start"] : r["stop"]] = r.pop("scores")
        class_ids = np.asarray(first.class_ids)[rows]
    names = first.class_names
    summary = {
        "method": plan.method,
        "form": form,
        "num_queries": Q,
        "num_classes": plan.num_classes,
        "dim": plan.dim,
        "stores": [s.url for s in stores],
        "weights": weights,
        "top_k": k,
        "executor": executor,
        "tasks": len(reports),
        "blocks_skipped": len(plan.blocks()) - len(todo),
        "block_rows": plan.block_rows,
        "stream_rows": plan.stream_rows,
        "band_cols": plan.band_cols,
        "seconds": seconds,
        "memory_bound_bytes": bound["total"],
        "task_cpu_seconds": float(sum(r["cpu_seconds"] for r in reports)),
        "task_pids": sorted({int(r["pid"]) for r in reports}),
        "peak_task_rss_added_bytes": int(max((r["rss_added"] for r in reports), default=0)),
        "peak_task_rss_bytes": int(max((r["rss_peak"] for r in reports), default=0)),
        "out": out,
        **pre_info,
    }
    if target is not None:
        target.finish({k2: v for k2, v in summary.items() if k2 != "stores"})
    return Scores(
        class_ids=torch.from_numpy(np.ascontiguousarray(class_ids)),
        scores=torch.from_numpy(np.ascontiguousarray(values)),
        rows=torch.from_numpy(np.ascontiguousarray(rows)),
        class_names=None if names is None else [[names[int(j)] for j in row] for row in rows],
        method=plan.method,
        info=summary,
        groups=groups,
    )


def _run(ray, config, urls, options, plan, todo, prepared, weights, kinv, out) -> list[dict]:
    """Every block of ``todo`` on Ray (two small retries) or here, in order; the reports."""
    if ray is None:
        return [score_task(urls, options, plan, a, b, prepared[:, a:b], weights, kinv, out, i) for i, a, b in todo]
    task = ray.remote(score_task).options(num_cpus=config.num_cpus, max_retries=1, name="classgrad-score")
    kref = ray.put(kinv)
    pending = {
        task.remote(urls, options, plan, a, b, prepared[:, a:b], weights, kref, out, i): (a, b) for i, a, b in todo
    }
    reports = []
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=10.0)
            for ref in ready:
                a, b = pending.pop(ref)
                try:
                    reports.append(ray.get(ref))
                except ray.exceptions.RayError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, ClassgradError):
                        raise cause from None
                    raise RuntimeError(f"score task for queries [{a}, {b}) failed: {first_line(str(exc))}") from None
    finally:
        for ref in pending:
            ray.cancel(ref)
    return reports

"""The "update" step done right: a weighted combination of per-class gradient rows, written as
a gradient shaped like the model's state dict, and loaded into ``.grad`` for an optimizer step.

Holds ``AggregateConfig`` (options and their defaults), ``load_weights`` (``mean`` or a file:
``.npy``, or ``.txt``/``.csv`` of C numbers in row order), ``weighted_sum`` (sum_c w_c g_c in one
out-of-core pass: blocks of rows, column bands when rows are long; blocks whose weights are all
0 are not read), ``aggregate`` (the whole command: checks, sum, optional norm clipping, one
safetensors file with one tensor per parameter of the layout, named like the model's
parameters) and ``load_into_grad`` (puts those tensors into ``param.grad``, optionally
clipping their total norm, so that ``optimizer.step()`` applies them).

Row i of the store is class ``class_ids[i]``: weights are given in row order. Weights are used
as given (``mean`` is 1/C each); class-balanced weights, for example, are a file. Each block's
contribution is summed in float32 (BLAS) and the blocks are accumulated in float64.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from classgrad.config.fields import MemoryMiB
from classgrad.errors import ClassgradError, ConfigError, InputError, StoreError, StoreIncompleteError
from classgrad.service.analysis import DEFAULT_BLOCK_MB, done_ranges, iter_tiles, plan_blocks, validated
from classgrad.store import open_store
from classgrad.workers.projection import structure_label

log = logging.getLogger(__name__)

FORMAT = "classgrad-aggregate-1"


class AggregateConfig(BaseModel):
    """Options of ``classgrad aggregate`` (defaults in one place)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or NaN options: refused in one line

    weights: str = Field(
        "mean", description="'mean' (1/C per class) or a file of C weights in row order: .npy, or .txt/.csv numbers"
    )
    clip_norm: float | None = Field(None, gt=0, description="scale the result down to this L2 norm if it is larger")
    block_rows: int | None = Field(
        None, ge=1, description="rows read at once (a multiple of the store's row_chunk); default from block_mb"
    )
    block_mb: MemoryMiB = Field(DEFAULT_BLOCK_MB, description="memory budget in MiB of one read")


def load_weights(spec: str, num_classes: int) -> tuple[np.ndarray, str]:
    """Weights (float64 [C]) and a description, from ``mean`` or a file."""
    if spec == "mean":
        return np.full(num_classes, 1.0 / num_classes), "mean"
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--weights {spec!r}: no such file (give 'mean', or a .npy, .txt or .csv file of {num_classes} numbers)"
        )
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            w = np.load(path, allow_pickle=False)
        elif suffix in (".txt", ".csv", ".tsv", ""):
            text = path.read_text()
            tokens = [
                t
                for line in text.splitlines()
                if not line.lstrip().startswith("#")
                for t in line.replace(",", " ").replace(";", " ").split()
            ]
            w = np.array([float(t) for t in tokens], dtype=np.float64)
        else:
            raise ConfigError(f"--weights {spec!r}: unknown file type {suffix!r} (expected .npy, .txt or .csv)")
    except ClassgradError:
        raise
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--weights {spec!r}: cannot read weights: {exc}") from None
    try:
        w = np.asarray(w, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--weights {spec!r}: not numbers: {exc}") from None
    if w.ndim == 2 and 1 in w.shape:  # a column or a row vector
        w = w.reshape(-1)
    if w.ndim != 1 or w.size != num_classes:
        raise ConfigError(
            f"--weights {spec!r}: expected {num_classes} weights (one per row of "
            f"the store), got shape {list(np.shape(w))}"
        )
    if not np.isfinite(w).all():
        raise ConfigError(
            f"--weights {spec!r}: weights must be finite (row {int(np.flatnonzero(~np.isfinite(w))[0])} is not)"
        )
    big = np.abs(w) > np.finfo(np.float32).max  # multiplied in float32
    if big.any():
        raise ConfigError(
            f"--weights {spec!r}: weights must be within float32's range (row {int(np.flatnonzero(big)[0])} "
            f"is {w[big][0]:g})"
        )
    return w, str(path)


def _check_rows_present(store, weights: np.ndarray) -> list[tuple[int, int]]:
    """Row ranges to read: done rows with a non-zero weight; refuses missing weighted rows."""
    missing = store.missing_ranges()
    needed = [(a, b) for a, b in missing if np.any(weights[a:b] != 0)]
    if needed:
        shown = ", ".join(f"[{a}, {b})" for a, b in needed[:5])
        raise StoreIncompleteError(
            f"store {store.url} is incomplete: rows {shown} have non-zero weight but are not "
            f"written yet; finish the job (rerun `classgrad run`) first"
        )
    return done_ranges(store, missing)


def weighted_sum(
    store, weights: np.ndarray, *, block_rows: int | None = None, block_mb: float = DEFAULT_BLOCK_MB
) -> np.ndarray:
    """sum_c weights[c] * row_c as float32 [D], reading at most one block (one band) at once."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (store.num_classes,):
        raise ConfigError(f"expected {store.num_classes} weights, got shape {list(weights.shape)}")
    ranges = _check_rows_present(store, weights)
    plan = plan_blocks(store, block_rows=block_rows, block_mb=block_mb)
    # Row blocks whose weights are all 0 are not read; iter_tiles keeps each remaining block
    # whole (none is longer than plan.block_rows) and reads it band by band.
    blocks = [(r0, r1) for start, stop in ranges for r0, r1 in plan.row_blocks(start, stop) if weights[r0:r1].any()]
    acc = np.zeros(store.dim, dtype=np.float64)
    for r0, r1, c0, c1, x in iter_tiles(store, plan, blocks):
        with np.errstate(over="ignore", invalid="ignore"):  # checked below, in one line
            acc[c0:c1] += weights[r0:r1].astype(np.float32) @ x
        del x
    limit = np.finfo(np.float32).max
    if not (np.isfinite(acc) & (np.abs(acc) <= limit)).all():
        raise ConfigError(
            "aggregate: the weighted sum of the rows overflows float32 (the weights times the rows leave its "
            "range); lower --weights"
        )
    return acc.astype(np.float32)


def _state_dict(store, vector: np.ndarray) -> dict[str, np.ndarray]:
    return {e.name: np.ascontiguousarray(vector[e.offset : e.offset + e.size].reshape(e.shape)) for e in store.layout}


# What ``--out``'s suffix says the file is: safetensors (with the summary as its metadata), or a
# torch state dict of tensors that ``torch.load(weights_only=True)`` reads.
OUT_SUFFIXES = (".safetensors", ".pt", ".pth")


def _check_out(path: Path) -> None:
    if path.suffix not in OUT_SUFFIXES:
        raise ConfigError(
            f"--out {path}: the suffix says the format; use {', '.join(OUT_SUFFIXES)} "
            f"(safetensors, or a torch state dict)"
        )


def _save(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        if path.suffix == ".safetensors":
            from safetensors.numpy import save_file

            save_file(tensors, str(tmp), metadata=metadata)
        else:
            import torch

            torch.save({name: torch.from_numpy(array) for name, array in tensors.items()}, tmp)
        os.replace(tmp, path)  # never a half-written file at the target
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def aggregate(url: str, out: str, *, storage_options: dict | None = None, **options: Any) -> dict:
    """``classgrad aggregate``: combine the rows of the store at ``url`` with the weights in
    ``options`` (``AggregateConfig`` fields) and write ``out`` (safetensors, or a torch state
    dict for ``.pt``/``.pth``: what the suffix says). Returns a
    summary (norm before and after clipping, tensors written, ...)."""

    config: AggregateConfig = validated(AggregateConfig, "aggregate", **options)
    _check_out(Path(out))  # before any row is read
    store = open_store(url, storage_options=storage_options)
    if not store.layout:
        proj = store.attrs.get("projection")
        what = (
            f"projected rows ({structure_label(proj)}, to {store.dim} dims)"
            if proj
            else f"rows without a parameter layout ({store.dim} columns)"
        )
        raise StoreError(
            f"store {url} holds {what}: they cannot be mapped back to the model's "
            f"parameters, so there is no gradient to aggregate; use a store "
            f"computed without projection"
        )
    weights, described = load_weights(config.weights, store.num_classes)
    vector = weighted_sum(store, weights, block_rows=config.block_rows, block_mb=config.block_mb)
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    scale = 1.0
    if config.clip_norm is not None and norm > config.clip_norm:
        scale = config.clip_norm / norm
        vector = (vector.astype(np.float64) * scale).astype(np.float32)
    tensors = _state_dict(store, vector)
    metadata = {
        "format": FORMAT,
        "store": store.url,
        "fingerprint": store.fingerprint,
        "weights": described,
        "weights_sum": repr(float(weights.sum())),
        "num_classes": str(store.num_classes),
        "norm": repr(norm),
        "clip_norm": repr(config.clip_norm),
        "scale": repr(scale),
        "layout": json.dumps([e.name for e in store.layout]),
    }
    path = Path(out)
    _save(tensors, path, metadata)
    log.debug(  # the command prints its own summary line
        "wrote %s: %d tensors, norm %.6g%s",
        path,
        len(tensors),
        norm,
        f" clipped to {config.clip_norm}" if scale != 1.0 else "",
    )
    return {
        "out": str(path),
        "tensors": len(tensors),
        "numbers": int(vector.size),
        "weights": described,
        "weights_sum": float(weights.sum()),
        "norm": norm,
        "clip_norm": config.clip_norm,
        "scale": scale,
        "final_norm": float(np.linalg.norm(vector.astype(np.float64))),
    }


def load_into_grad(model: Any, path: str | os.PathLike, clip_norm: float | None = None, *, strict: bool = True) -> dict:
    """Load an aggregated gradient (``classgrad aggregate``'s file) into ``model``'s
    parameters' ``.grad``, so that ``optimizer.step()`` applies it.

    Every tensor replaces the ``.grad`` of the parameter of the same name (moved to its device
    and dtype); parameters the file does not name keep their ``.grad`` (call
    ``optimizer.zero_grad()`` first for a clean step). With ``clip_norm``, the total L2 norm of
    the loaded gradients is clipped as ``torch.nn.utils.clip_grad_norm_`` does. ``strict``
    refuses names the model does not have. Returns {"loaded", "not_in_file", "total_norm"}.
    """
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise InputError(f"cannot load the gradient {path}: {exc}") from None
    params = dict(model.named_parameters())
    unknown = [name for name in tensors if name not in params]
    if unknown and strict:
        raise InputError(
            f"{path} holds gradients for parameters the model does not have: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} "
            f"(pass strict=False to skip them)"
        )
    loaded = []
    for name, param in params.items():  # the model's order (the file's is alphabetical)
        if name not in tensors:
            continue
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise InputError(
                f"{path}: gradient {name!r} has shape {list(tensor.shape)}, the model's parameter {list(param.shape)}"
            )
        param.grad = tensor.to(device=param.device, dtype=param.dtype)
        loaded.append(name)
    grads = [params[n] for n in loaded]
    if clip_norm is not None:
        total = float(torch.nn.utils.clip_grad_norm_(grads, clip_norm))
    else:
        total = (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in grads])))
            if grads
            else 0.0
        )
    return {"loaded": loaded, "not_in_file": [n for n in params if n not in tensors], "total_norm": total}

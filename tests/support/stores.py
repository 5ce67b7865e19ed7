"""Stores for the tests of ``classgrad.service.analysis`` (``tests/unit/test_support_stores.py``
checks that they hold what they claim).

- ``synthetic_store``: C x D rows with planted structure (groups of classes sharing a direction,
  rows of very different norms, a zero row), in any store dtype, with a parameter layout or as
  a projected store; returns the store and the true float32 rows a reader returns.
- ``model_store``: a real store: the per-class gradients of a small MLP on a synthetic probe
  set, computed in-process by ``classgrad.workers.gradients.per_class_gradients`` and written with
  ``write_rows``; returns (store, model, rows).
"""

from __future__ import annotations

import numpy as np

from classgrad.store import ParamSlot, StoreSpec, create_store

LAYOUT = (
    ParamSlot("layer.weight", (8, 10), 0, 80),
    ParamSlot("layer.bias", (8,), 80, 8),
    ParamSlot("head.weight", (2, 4), 88, 8),
)
DIM = 96
ZERO_ROW = 7


def synthetic_rows(num_classes: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    groups = rng.standard_normal((10, dim))
    rows = 0.7 * groups[rng.integers(0, 10, num_classes)] + rng.standard_normal((num_classes, dim))
    rows *= np.logspace(-3, 2, num_classes)[rng.permutation(num_classes)][:, None]
    rows[ZERO_ROW] = 0.0  # a class without samples
    return rows.astype(np.float32)


def write_all(store, rows: np.ndarray, shards=None) -> None:
    for shard in range(store.num_shards) if shards is None else shards:
        a, b = store.shard_range(shard)
        store.write_rows(a, rows[a:b], loss=np.linspace(1, 2, b - a), count=np.full(b - a, 2))
        store.mark_shard_done(shard)


def synthetic_store(
    path,
    *,
    num_classes: int = 500,
    dim: int = DIM,
    dtype: str = "float32",
    projected: bool = False,
    row_chunk: int = 16,
    shard_rows: int = 64,
    col_chunk: int = 40,
    shards=None,
    seed: int = 0,
    layout: tuple[ParamSlot, ...] | None = None,
    **spec,
):
    """(open r+ store, true float32 rows as the reader returns them); ``layout`` replaces the
    default parameter layout (which needs ``dim == DIM``)."""
    if layout is None:
        layout = () if projected or dim != DIM else LAYOUT
    projection = {"kind": "rademacher", "dim": dim, "seed": 0, "out_dim": dim} if projected else None
    store = create_store(
        str(path),
        StoreSpec(
            num_classes=num_classes,
            dim=dim,
            shard_rows=shard_rows,
            row_chunk=row_chunk,
            col_chunk=col_chunk,
            dtype=dtype,
            layout=layout,
            projection=projection,
            fingerprint=f"fp-{seed}",
            loss_kind="cross_entropy",
            **spec,
        ),
    )
    rows = synthetic_rows(num_classes, dim, seed)
    write_all(store, rows, shards)
    true = store.rows(np.arange(num_classes), allow_missing=True)
    return store, true


def model_store(path, *, num_classes: int = 500, dtype: str = "float32"):
    """(store, model, rows): per-class gradients of a small MLP (D = 4,572 for 500 classes)."""
    from classgrad.workers.gradients import per_class_gradients
    from classgrad.workers.layout import ParamLayout
    from classgrad.workers.zoo import mlp, synthetic_probe

    model = mlp(num_classes=num_classes, in_features=8, hidden=8, depth=1, seed=1).eval()
    data = synthetic_probe(
        num_classes=num_classes, samples_per_class=2, kind="vector", input_shape=[8], empty_classes=[3], seed=1
    )
    rows = per_class_gradients(model, data, num_classes=num_classes).numpy()
    layout = ParamLayout.from_model(model)
    store = create_store(
        str(path),
        StoreSpec(
            num_classes=num_classes,
            dim=layout.dim,
            shard_rows=128,
            row_chunk=32,
            col_chunk=1024,
            dtype=dtype,
            fingerprint="fp-model",
            loss_kind="cross_entropy",
            layout=layout.slots,
        ),
    )
    write_all(store, rows)
    return store, model, store.rows(np.arange(num_classes))


def dense_similarity(rows: np.ndarray, metric: str) -> np.ndarray:
    """The reference: float64 numpy, all at once."""
    x = rows.astype(np.float64)
    gram = x @ x.T
    if metric == "dot":
        return gram
    norms = np.linalg.norm(x, axis=1)
    inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    return gram * inv[:, None] * inv[None, :]

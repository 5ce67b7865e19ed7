"""The preconditioner of ``--method trak``: the Gram matrix of a store's rows, accumulated out
of core, saved beside the rows once, and turned into ``(Gram + lambda I)^-1`` for a run.

Holds ``trak_form`` (which form a store takes, or one line refusing it), ``gram_matrix`` (the
accumulation), ``ensure_gram`` (load the saved matrix, or compute and save it under the store's
lease), ``damping_for`` and ``inverse``.

The score. With ``Phi`` the store's C x k rows and ``g`` a query row, TRAK's class score is
``g^T (Phi^T Phi + lambda I)^-1 phi_c``. Two forms give the same numbers:

- ``features`` (k <= C, projected stores): ``Phi^T Phi`` is k x k, summed over row blocks in
  float64 (``X_b^T X_b``), one pass over the rows; the query rows are multiplied by its damped
  inverse once, after which scoring is a plain product with the rows.
- ``kernel`` (C < k, e.g. full rows): by ``(Phi^T Phi + l I)^-1 Phi^T = Phi^T (Phi Phi^T + l I)^-1``,
  the scores of a query are its dot products with every row times ``(K + lambda I)^-1``, with
  ``K = Phi Phi^T`` C x C (blocks ``X_i X_j^T``, column bands when rows are wide).

The chosen matrix must fit ``precond_mb``, or the run is refused in one line that names
``projection.dim``. ``lambda`` is ``damping`` when given (absolute), else ``damping_fraction``
times the mean eigenvalue (trace / min(C, k): the mean nonzero eigenvalue for rows of full
rank, the same in both forms).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from classgrad.errors import ConfigError, InputError
from classgrad.service.analysis import MIB, plan_blocks
from classgrad.service.driver_runtime.run_ids import new_run_id
from classgrad.units import fmt_bytes

log = logging.getLogger(__name__)


def trak_form(store: Any, precond_mb: float) -> str:
    """``features`` (k x k) or ``kernel`` (C x C), whichever is smaller, if it fits ``precond_mb``."""
    C, D = store.num_classes, store.dim
    form, n = ("features", D) if D <= C else ("kernel", C)
    size = n * n * 8
    if size > precond_mb * MIB:
        raise ConfigError(
            f"--method trak: store {store.url} holds {C:,} rows of {D:,} columns, so its preconditioner "
            f"({form}, {n:,} x {n:,} float64) would take {fmt_bytes(size)}, above --precond-mb "
            f"{precond_mb:g}; store projected rows (projection.dim, e.g. 4096) or use --method dot|cosine"
        )
    return form


def gram_matrix(store: Any, form: str, block_mb: float = 64.0) -> np.ndarray:
    """``Phi^T Phi`` (features) or ``Phi Phi^T`` (kernel) of the store's rows, float64, holding at
    most two row blocks (one column band each) and the result."""
    C, D = store.num_classes, store.dim
    plan = plan_blocks(store, block_mb=block_mb)
    blocks = plan.row_blocks(0, C)
    if form == "features":
        out = np.zeros((D, D), dtype=np.float64)
        for a, b in blocks:
            x = store.block(a, b, (0, D)).astype(np.float64)
            out += x.T @ x
        return (out + out.T) / 2  # exactly symmetric
    out = np.zeros((C, C), dtype=np.float64)
    for band in plan.bands(D):
        for i, (a, b) in enumerate(blocks):
            xi = store.block(a, b, band).astype(np.float64)
            out[a:b, a:b] += xi @ xi.T
            for c, d in blocks[i + 1 :]:
                xj = store.block(c, d, band).astype(np.float64)
                tile = xi @ xj.T
                out[a:b, c:d] += tile
                out[c:d, a:b] += tile.T
    return out


def ensure_gram(
    store: Any, form: str, *, recompute: bool = False, lease_ttl_s: float = 120.0
) -> tuple[np.ndarray, dict]:
    """The store's saved Gram matrix of ``form`` (computed and saved first when there is none, or
    when ``recompute``), with its attributes. A saved one of these rows is reused; one made from
    other rows, or damaged, is refused (``Preconditioners.load``) unless ``recompute``."""
    pre = store.preconditioner
    info = pre.info()
    if info is not None and info.get("state") == "ready" and info.get("form") == form and not recompute:
        return pre.load(form=form)
    run_id = new_run_id("score")
    t0 = time.perf_counter()
    digest = pre.rows_digest()
    matrix = gram_matrix(store, form)
    seconds = time.perf_counter() - t0
    with store.lease.hold(run_id, ttl_s=lease_ttl_s, info={"command": "score", "what": "preconditioner"}):
        if pre.rows_digest() != digest:
            raise InputError(f"the rows of store {store.url} changed while its preconditioner was computed; rerun")
        attrs = pre.save(matrix, form=form, rows_digest=digest, info={"seconds": seconds, "run_id": run_id})
    log.info("preconditioner (%s, %d x %d) of %s computed in %.1f s", form, *matrix.shape, store.url, seconds)
    return matrix, attrs


# Above this multiple of the Gram matrix's mean eigenvalue, (G + lambda I)^-1 is I / lambda to
# 12 digits: TRAK's scores are the dot products divided by lambda, which float32 flushes to 0 as
# lambda grows (--damping 1e308 gave every score 0.0; --damping-fraction 1e308 every score NaN).
MAX_DAMPING_RATIO = 1e12


def damping_for(info: dict, damping: float | None, fraction: float) -> float:
    """The absolute ``lambda``: ``damping`` as given, else ``fraction`` x the recorded mean
    eigenvalue. Refuses (one line, naming the option) a lambda that is not finite or that
    drowns every eigenvalue (``MAX_DAMPING_RATIO``)."""
    mean = float(info["mean_eigenvalue"])
    option, given = ("--damping", damping) if damping is not None else ("--damping-fraction", fraction)
    lam = float(damping) if damping is not None else float(fraction) * mean
    if not math.isfinite(lam) or (mean > 0 and lam > MAX_DAMPING_RATIO * mean):
        raise ConfigError(
            f"score option {option} {given:g}: lambda {lam:g} is more than {MAX_DAMPING_RATIO:g} times the Gram "
            f"matrix's mean eigenvalue ({mean:g}), so trak would score the dot products divided by lambda "
            "(float32 flushes them to 0); give a smaller one, or --method dot"
        )
    return lam


def inverse(gram: np.ndarray, lam: float, url: str) -> np.ndarray:
    """``(gram + lam I)^-1`` in float64; a singular matrix (lam 0 on rows without full rank) is one line."""
    n = gram.shape[0]
    try:
        factor = np.linalg.cholesky(gram + lam * np.eye(n))
    except np.linalg.LinAlgError:
        raise InputError(
            f"--method trak: the Gram matrix of {url} plus {lam:g} I is not positive definite; "
            "give a positive --damping"
        ) from None
    inv_factor = np.linalg.solve(factor, np.eye(n))
    return inv_factor.T @ inv_factor

"""The Zarr v3 gradient store: the only part of classgrad that knows key names and layout.

Holds the public names, re-exported (``from classgrad.store import open_store, ...``), and the
store as a whole: ``grad_store`` (``GradStore``, which assembles the parts below), ``create``
(``create_store``, ``open_store``, ``open_dataset``), ``store_keys`` (every key a store holds,
told from anything else at its location, and their deletion) and ``scan`` (every array's chunks
scanned, ``ChunkProblem``, for ``classgrad verify``). The parts, by role, each importing only
the ones listed before it:

- ``core`` — what every other part stands on: ``format`` (constants, key and array names,
  ``StoreSpec``, the layout described in full), ``params`` (``ParamSlot``), ``encoding`` (row
  scale, bfloat16 bits), ``indexing`` (row ids and ranges), ``location`` (local or fsspec
  location, ``local_path``), ``retry`` (transient I/O errors sent again with backoff) and
  ``coords`` (format 3's coordinates, attributes and consolidated metadata).
- ``integrity`` — what proves a store whole and owned: ``shard_records`` (per-shard records of
  chunk digests), ``verified`` (reads checked against those digests), ``lease`` (the driver's
  lease, ``store_lease``) with ``lease_files`` (its atomic files), and ``checks``
  (``check_metadata``).
- ``rows`` — the job's gradient rows: ``arrays`` (the open arrays, reads with a diagnosis),
  ``reader`` and ``writer`` (rows), ``direct_write`` (the chunk writer for local uncompressed
  stores), ``raw_chunks`` (whole chunks read without zarr), ``done_marks`` (the shards' done
  marks) and ``dataset`` (the lazy xarray Dataset of true values).
- ``analysis`` — what the analysis commands write beside the rows: ``similarity_arrays``
  (``classgrad similarity``'s results) with ``result_records`` (their digests),
  ``preconditioner`` (``classgrad score``'s saved Gram matrix) and ``score_output`` (the output
  of ``classgrad score --out``).
- ``training_log`` — a training run's per-class rows summed over windows of steps (``GradLog``'s
  store): ``log_store`` (``open_log``, ``read_log``), ``log_records`` (its digests),
  ``row_shards`` (a window's stored rows) and ``log_dataset`` (``open_log_dataset``: the lazy
  xarray Dataset of its done windows, every block checked).

It needs numpy, zarr and fsspec only (s3fs for ``s3://``; dask for ``to_dask``, xarray too for
``open_dataset``), never torch or Ray.
"""

from classgrad.store.analysis.similarity_arrays import SimilarityArrays
from classgrad.store.core.format import FORMAT_VERSION, SIMILARITY_METRICS, StoreSpec
from classgrad.store.core.indexing import fmt_ranges
from classgrad.store.core.location import local_path
from classgrad.store.core.params import ParamSlot
from classgrad.store.create import create_store, open_dataset, open_store
from classgrad.store.grad_store import GradStore
from classgrad.store.integrity.checks import check_metadata
from classgrad.store.integrity.lease import HeldLease, StoreLease, lease_state, store_lease
from classgrad.store.scan import ChunkProblem
from classgrad.store.training_log.log_dataset import open_log_dataset
from classgrad.store.training_log.log_store import read_log

__all__ = [
    "FORMAT_VERSION",
    "SIMILARITY_METRICS",
    "ChunkProblem",
    "GradStore",
    "HeldLease",
    "ParamSlot",
    "SimilarityArrays",
    "StoreLease",
    "StoreSpec",
    "check_metadata",
    "create_store",
    "fmt_ranges",
    "lease_state",
    "local_path",
    "open_dataset",
    "open_log_dataset",
    "open_store",
    "read_log",
    "store_lease",
]

"""The Zarr v3 gradient store: the only part of classgrad that knows key names and layout.

Re-exports the public names. The package: ``format`` (constants, ``StoreSpec``, metadata, the
layout described in full), ``params`` (``ParamSlot``), ``encoding`` (row scale, bfloat16 bits),
``indexing`` (row ids and ranges), ``location`` (local or fsspec location, ``local_path``),
``create`` (``create_store``, ``open_store``), ``grad_store`` (``GradStore``), ``coords``
(format 3's coordinates, attributes and consolidated metadata), ``dataset`` (``open_dataset``:
a lazy xarray Dataset of true values), ``arrays``
(array reads with a diagnosis), ``reader`` and ``writer`` (rows), ``direct_write`` (the chunk
writer for local uncompressed stores), ``lease`` (the driver's lease, ``store_lease``),
``lease_files`` (its atomic files), ``store_keys`` (the keys a store holds, their deletion),
``retry`` (transient I/O errors sent again with backoff), ``records`` (per-shard records),
``similarity_arrays`` (the similarity results), ``grad_log`` (a training run's per-class rows
summed over windows of steps, ``read_log``), ``preconditioner`` (``classgrad score``'s saved
Gram matrix), ``score_output`` (the output of ``classgrad score --out``), ``scan`` (chunk
scanning, ``ChunkProblem``) and ``checks`` (``check_metadata``). It needs numpy, zarr and
fsspec only (s3fs for ``s3://``; dask for ``to_dask``, xarray too for ``open_dataset``), never
torch or Ray.
"""

from classgrad.store.checks import check_metadata
from classgrad.store.create import create_store, open_dataset, open_store
from classgrad.store.format import FORMAT_VERSION, SIMILARITY_METRICS, StoreSpec
from classgrad.store.grad_log import read_log
from classgrad.store.grad_store import GradStore
from classgrad.store.indexing import fmt_ranges
from classgrad.store.lease import HeldLease, StoreLease, lease_state, store_lease
from classgrad.store.location import local_path
from classgrad.store.params import ParamSlot
from classgrad.store.scan import ChunkProblem
from classgrad.store.similarity_arrays import SimilarityArrays

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
    "open_store",
    "read_log",
    "store_lease",
]

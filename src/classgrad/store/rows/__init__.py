"""The store's rows: the job's gradient arrays opened, written and read.

Holds nothing itself; its modules are ``arrays`` (``StoreArrays``: the open arrays, reads with a
diagnosis), ``writer`` (``RowWriter``) with ``direct_write`` (the chunk writer for local
uncompressed stores), ``reader`` (``RowReader``), ``raw_chunks`` (whole chunks read without
zarr), ``done_marks`` (the shards' done marks) and ``dataset`` (the lazy xarray Dataset of true
values). Imports only the store's ``core`` and ``integrity``.
"""

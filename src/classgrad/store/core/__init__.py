"""The store's core: what every other part of the store stands on.

Holds nothing itself; its modules are ``format`` (the format version, key and array names,
``StoreSpec``, the metadata and the layout described in full), ``params`` (``ParamSlot``),
``encoding`` (row scale, bfloat16 bits), ``indexing`` (row ids and ranges), ``location`` (a
store URL's Zarr store and fsspec view, ``probe``), ``retry`` (transient I/O errors sent again
with backoff) and ``coords`` (format 3's coordinates, attributes and consolidated metadata).
Imports no other part of the store.
"""

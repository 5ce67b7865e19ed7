"""The store's integrity: what proves a store whole, unaltered and owned by one run.

Holds nothing itself; its modules are ``shard_records`` (each shard's record of its chunks'
sizes and digests), ``verified`` (reads checked against those records), ``lease`` (the driver's
lease on a store) with ``lease_files`` (its atomic files) and ``checks`` (``check_metadata``).
Imports only the store's ``core``.
"""

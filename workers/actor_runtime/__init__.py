"""The actor's runtime: the Ray actor, what a stored row is, the row writer and the job's
model/data/engine factory.

Holds nothing itself; its modules are ``actor``, ``stored_rows``, ``shard_writer``, ``factory``,
``identity`` and ``query``. Imports the compute layer (``classgrad.workers``) and the bottom layer
(errors, config, store); never the driver.
"""

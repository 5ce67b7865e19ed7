"""The actor's runtime: the Ray actor, the row writer and the job's model/data/engine factory.

Holds nothing itself; its modules are ``actor``, ``writer``, ``factory`` and ``identity``. Imports the compute
layer (``classgrad.workers``) and the bottom layer (errors, config, store); never the driver.
"""

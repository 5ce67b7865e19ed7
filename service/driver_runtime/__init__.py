"""The driver's runtime: plans shards, runs Ray actors over them, submits jobs, estimates.

Holds nothing itself; its modules are ``driver`` (one job on Ray), ``preparation`` (the job checked
and its store prepared before any actor starts), ``plan`` (classes -> shards),
``progress``, ``submit`` (Ray Jobs), ``estimate``, ``ray_session`` (start or join Ray, shared with
``classgrad similarity``) and ``run_ids``. Imports only the bottom layer
(``classgrad``'s foundation: errors, config, store) and ``classgrad.workers``.
"""

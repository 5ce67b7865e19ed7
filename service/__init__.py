"""classgrad's driver side, imported as ``classgrad.service``: the top of the stack.

``driver_runtime`` (the job's driver: plan, preparation, Ray, progress) stands on the compute side
(``classgrad.workers``) and the foundation (``classgrad.errors``, ``classgrad.config``,
``classgrad.store``); the downstream analyses and the CLI, ``analysis`` and ``commands``, on
top. Packages import only downward; ``tests/unit/test_layers.py`` checks it.
"""

"""classgrad's driver side, imported as ``classgrad.service``.

Holds only ``errors`` at this level (the bottom layer, with ``config`` and ``store``); the
driver's runtime is ``runtime``, and the downstream analyses and the CLI are ``analysis`` and
``commands`` on top. Packages import only downward; ``tests/unit/test_layers.py`` checks it.
"""

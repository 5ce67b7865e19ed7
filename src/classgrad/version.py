"""The installed classgrad's version, for ``classgrad --version``, ``classgrad.__version__`` and stores.

Holds ``__version__``: the distribution's version as pip installed it, or ``0+unknown`` in a tree
that was never installed.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("classgrad")
except PackageNotFoundError:  # imported from a tree that was never installed
    __version__ = "0+unknown"

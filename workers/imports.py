"""Resolve ``module:attribute`` import paths given in job configs, with one-line errors.

Holds ``import_object`` and ``from_working_dir``. A module that is not importable as the
process's ``sys.path`` stands, but lies in the directory the command runs from (the user's own
``models.py`` beside the job file; ``classgrad run``, a console script, does not put that
directory on ``sys.path`` as ``python -m`` does), is imported from there, and its name is kept:
the job driver then ships that directory to every actor (Ray's ``working_dir``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from classgrad.errors import InputError

# Top-level module names imported from the working directory by the fallback (see the docstring).
_FROM_WORKING_DIR: set[str] = set()


def from_working_dir() -> frozenset[str]:
    """Names of top-level modules this process imported from its working directory only."""
    return frozenset(_FROM_WORKING_DIR)


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        cwd = os.getcwd()
        here = os.path.isfile(os.path.join(cwd, top + ".py")) or os.path.isdir(os.path.join(cwd, top))
        if exc.name != top or not here or cwd in sys.path:
            raise
        sys.path.append(cwd)
        module = importlib.import_module(module_name)
        _FROM_WORKING_DIR.add(top)
        return module


def import_object(path: str, *, what: str = "factory") -> Any:
    """Import ``module:attr`` (``attr`` may be dotted). Errors name the path and the problem."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{what} {path!r}: expected 'module:function'")
    try:
        obj: Any = _import(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise InputError(f"{what} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InputError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj

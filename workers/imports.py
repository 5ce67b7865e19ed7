"""Resolve ``module:attribute`` import paths given in job configs, with one-line errors."""

from __future__ import annotations

import importlib
from typing import Any

from classgrad.service.errors import InputError


def import_object(path: str, *, what: str = "factory") -> Any:
    """Import ``module:attr`` (``attr`` may be dotted). Errors name the path and the problem."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{what} {path!r}: expected 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise InputError(f"{what} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InputError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj

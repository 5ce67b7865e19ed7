"""Secrets hidden from the config as it is written into a store.

Holds ``redact`` (values under secret-looking keys replaced, at any depth) and ``REDACTED``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["REDACTED", "redact"]

# Keys whose values are treated as secrets when the config is written anywhere.
_SECRET_RE = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)
REDACTED = "***"


def redact(value: Any) -> Any:
    """``value`` with every value under a key containing key/secret/token/password/credential
    (any case, any depth, in mappings and lists) replaced by ``REDACTED``."""
    if isinstance(value, dict):
        return {k: REDACTED if _SECRET_RE.search(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value

"""The fingerprint: what makes two stores interchangeable.

Holds:

- ``FINGERPRINT_VERSION`` and ``FINGERPRINT_FIELDS`` (the sections and fields hashed);
- ``fingerprint``: sha256 of the canonical JSON of the hashed fields of the given sections.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from classgrad.service.config.fields import Section

__all__ = ["FINGERPRINT_FIELDS", "FINGERPRINT_VERSION", "fingerprint"]

FINGERPRINT_VERSION = 1

# Fields of a section that change the stored bytes; None = every field of the section.
# Everything else (where the store is, how the job runs) may differ between a run and its resume.
FINGERPRINT_FIELDS: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "data": None,
    "loss": None,
    "precision": None,
    "params": None,
    "engine": ("kind", "block_rows", "group_rows"),
    "sharding": ("shard_rows",),
    "store": ("dtype", "row_chunk", "col_chunk", "codec", "sharded"),
    "projection": None,
}


def fingerprint(sections: Mapping[str, Section]) -> str:
    """sha256 hex of the canonical JSON of the hashed fields of ``sections``.

    ``sections`` maps each name in ``FINGERPRINT_FIELDS`` to its validated section.
    """
    selected: dict[str, Any] = {"fingerprint_version": FINGERPRINT_VERSION}
    for name, fields in FINGERPRINT_FIELDS.items():
        values = sections[name].model_dump(mode="json")
        selected[name] = values if fields is None else {f: values[f] for f in fields}
    canonical = json.dumps(selected, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

"""Run ids: the name of one run of a command, in its store's history, lease and Ray actor names.

Holds ``new_run_id``: ``[PREFIX-]YYYYMMDDTHHMMSSZ-xxxxxx`` (UTC start time, so ids sort by
start; six random hex digits, so two runs started in the same second differ).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone


def new_run_id(prefix: str = "") -> str:
    """A new run id, e.g. ``20250101T120000Z-1a2b3c`` or, with ``prefix="similarity"``,
    ``similarity-20250101T120000Z-1a2b3c``."""
    stamp = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    return f"{prefix}-{stamp}" if prefix else stamp

"""Byte sizes as people read them, in one unit system for every command: binary KiB, MiB, GiB,
TiB (powers of 1024, as Ray, the kernel and ``free -h`` count memory).

Holds ``fmt_bytes`` (one decimal from KiB up, "12.3 MiB") and ``fmt_mib`` (a rounded figure in
MiB below 1 GiB, "253 MiB", one decimal in GiB and TiB above it: the estimate's and preflight's
style). ``classgrad estimate``, the preflight, the run summary, ``status``, ``inspect`` and the
similarity commands all print sizes through these (``tests/unit/test_units.py`` checks that no
module of the package prints a decimal MB or GB).
"""

from __future__ import annotations

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def fmt_bytes(n: float) -> str:
    """Human-readable bytes (KiB and up use one decimal)."""
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_mib(n: float) -> str:
    """Bytes in one short figure: whole MiB below 1 GiB, GiB and TiB with one decimal above;
    beyond 1024 TiB (sizes no machine has), bytes in powers of ten."""
    if n >= 1024 * TIB:
        return f"{n:.1e} bytes"
    for unit, size in (("TiB", TIB), ("GiB", GIB)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / MIB:,.0f} MiB"

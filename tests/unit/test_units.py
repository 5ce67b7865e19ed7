"""One unit system for sizes (issue 29: MB, MiB and GiB were mixed across ``estimate``, the run
summary and ``inspect``): binary units everywhere, through ``classgrad.units``."""

from __future__ import annotations

import re
from pathlib import Path

from classgrad.service.analysis import fmt_bytes as analysis_fmt_bytes
from classgrad.service.driver_runtime.footprint import mb
from classgrad.units import fmt_bytes, fmt_mib

REPO = Path(__file__).resolve().parents[2]
# A decimal unit after a number or a format field in a string: "12 MB", "{x:.1f} GB", "~{mb} kB".
DECIMAL = re.compile(r"""(\d|\})\s?(kB|KB|MB|GB|TB)\b""")


def test_sizes_are_binary():
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 * 2**20) == "3.0 MiB" and fmt_bytes(1.5 * 2**30) == "1.5 GiB"
    assert fmt_mib(253 * 2**20) == "253 MiB" and fmt_mib(12 * 2**30) == "12.0 GiB" and fmt_mib(2**41) == "2.0 TiB"
    assert analysis_fmt_bytes is fmt_bytes and mb(300 * 2**20) == "300 MiB"


def test_no_module_prints_a_decimal_unit():
    offenders = []
    for folder in ("service", "workers", "src"):
        for path in (REPO / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if ('"' in code or "'" in code) and DECIMAL.search(code):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)

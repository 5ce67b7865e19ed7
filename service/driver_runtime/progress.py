"""Progress of a long job: a bar on a terminal or in a notebook (a text bar without ipywidgets),
periodic log lines elsewhere (Ray job logs).

Holds ``Progress``: ``update(rows)`` as shards finish, ``tick()`` from the driver's loop (for
the log lines), ``close()`` at the end. Rows/s and ETA come from the rows done in this run.
"""

from __future__ import annotations

import logging
import sys
import time

from classgrad.progress_bar import in_notebook, progress_bar

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_rows: int, mode: str = "auto", log_every_s: float = 10.0, label: str = ""):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() or in_notebook() else "log"
        self.mode = mode
        self.total = total_rows
        self.done = 0
        self.label = label
        self.log_every_s = log_every_s
        self._t0 = time.monotonic()
        self._last_log = self._t0
        self._bar = progress_bar(total_rows, desc=label, unit="row", show=True) if mode == "bar" else None

    def update(self, rows: int) -> None:
        self.done += rows
        if self._bar is not None:
            self._bar.update(rows)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta_text = f"{eta:.0f} s" if eta != float("inf") else "unknown"
        return f"{self.label}: {self.done}/{self.total} rows ({pct:.1f}%), {rate:.1f} rows/s, ETA {eta_text}"

    def tick(self) -> None:
        if self.mode == "log" and time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            log.info("%s", self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "log":
            log.info("%s", self.line())

"""The row writer: an actor's rows go into the store in whole chunks, off the compute thread.

Holds ``ShardWriter``. The engine yields blocks of any size; the writer gathers them into runs
of whole row chunks (the store refuses anything else), moves them to host memory, and hands
each run to a background thread that writes it while the engine computes the next block. At
most ``max_pending`` runs wait, so a slow store slows the engine down instead of filling
memory. Errors on the writer thread surface on the next ``add`` or on ``close``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from classgrad.service.errors import StoreError
from classgrad.service.store import GradStore
from classgrad.workers.engines import RowBlock

_STOP = object()


@dataclass
class WriteStats:
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0  # time the writer thread spent in the store


class ShardWriter:
    """Writes rows ``[start, stop)`` of the store, given in order, in whole-chunk runs."""

    def __init__(self, store: GradStore, start: int, stop: int, *, max_pending: int = 2):
        self.store = store
        self.next_row = start  # first row not yet handed to the writer thread
        self.stop = stop
        self.align = store.write_align
        self.stats = WriteStats()
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="classgrad-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue  # drain: keep the producer from blocking after a failure
            start, pieces = item
            try:
                t0 = time.perf_counter()
                # Blocks that already cover whole chunks arrive as one piece: no copy at all.
                rows, loss, count = (parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in zip(*pieces))
                self.stats.bytes += self.store.write_rows(start, rows, loss=loss, count=count)
                self.stats.seconds += time.perf_counter() - t0
                self.stats.rows += len(rows)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = exc

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def add(self, block: RowBlock, rows: torch.Tensor | None = None) -> None:
        """Queue a block (``rows`` replaces ``block.rows``, e.g. after projection)."""
        self._raise_if_failed()
        values = block.rows if rows is None else rows
        self._pending.append(
            (
                values.detach().to("cpu", torch.float32).numpy(),
                block.loss.numpy().astype(np.float32, copy=False),
                block.count.numpy(),
            )
        )
        self._pending_rows += len(block)
        if self.next_row + self._pending_rows > self.stop:
            raise StoreError(f"writer got more rows than its range [{self.next_row}, {self.stop}) holds")
        whole = (self._pending_rows // self.align) * self.align
        if self.next_row + self._pending_rows == self.stop:
            whole = self._pending_rows
        if whole:
            self._flush(whole)

    def _flush(self, n: int) -> None:
        """Hand the first ``n`` pending rows to the writer thread, as views (any joining of
        pieces happens there, off the compute thread)."""
        take: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        need = n
        while need:
            rows, loss, count = self._pending[0]
            if len(rows) <= need:
                take.append(self._pending.pop(0))
                need -= len(rows)
            else:
                take.append((rows[:need], loss[:need], count[:need]))
                self._pending[0] = (rows[need:], loss[need:], count[need:])
                need = 0
        self._queue.put((self.next_row, take))
        self.next_row += n
        self._pending_rows -= n

    def close(self) -> WriteStats:
        """Wait for every queued run; raise if a write failed or rows are missing."""
        self._queue.put(_STOP)
        self._thread.join()
        self._raise_if_failed()
        if self._pending_rows or self.next_row != self.stop:
            raise StoreError(f"writer closed with rows [{self.next_row}, {self.stop}) not written")
        return self.stats

    def abort(self) -> None:
        """Stop the thread without raising (the shard is being abandoned)."""
        self._error = self._error or StoreError("writer aborted")
        self._queue.put(_STOP)
        self._thread.join()

"""The row writer: an actor's rows go into the store in whole chunks, off the compute thread.

Holds ``ShardWriter``. The engine yields blocks of any size; the writer gathers them into runs
of whole row chunks (the store refuses anything else) and hands each run to a background thread
that writes it while the engine computes the next block. Rows leave a GPU on a side stream into
pinned memory (``host_device.copy_to_host``), so the copy runs beside the next block's compute
and the writer thread, not the compute thread, waits for it; on a CPU they are used in place. At
most ``max_pending`` runs wait, so a slow store slows the engine down instead of filling
memory. Errors on the writer thread surface on the next ``add`` or on ``close``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from classgrad.errors import StoreError
from classgrad.store import GradStore
from classgrad.workers.engines import RowBlock, host_device

_STOP = object()


@dataclass(frozen=True)
class Piece:
    """Rows of one block on the host (``wait()``: until their copy off the device is done),
    with their losses and counts."""

    rows: torch.Tensor
    loss: np.ndarray
    count: np.ndarray
    wait: Callable[[], None]

    def part(self, rows: slice) -> Piece:
        return Piece(self.rows[rows], self.loss[rows], self.count[rows], self.wait)


@dataclass
class WriteStats:
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0  # time the writer thread spent in the store


class ShardWriter:
    """Writes rows ``[start, stop)`` of the store, given in order, in whole-chunk runs."""

    def __init__(self, store: GradStore, start: int, stop: int, *, max_pending: int = 2):
        self.store = store
        self.start = start
        self.next_row = start  # first row not yet handed to the writer thread
        self.stop = stop
        self.align = store.write_align
        self.stats = WriteStats()
        self._pending: list[Piece] = []
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
                for piece in pieces:
                    piece.wait()  # the rows' copy off the device
                # Blocks that already cover whole chunks arrive as one piece: no copy at all.
                parts = [(p.rows.numpy(), p.loss, p.count) for p in pieces]
                rows, loss, count = (one[0] if len(one) == 1 else np.concatenate(one) for one in zip(*parts))
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
        if self.next_row + self._pending_rows + len(block) > self.stop:
            raise StoreError(
                f"writer got more rows than its range [{self.start}, {self.stop}) holds "
                f"({self.next_row + self._pending_rows - self.start} before a block of {len(block)})"
            )
        values, wait = host_device.copy_to_host(block.rows if rows is None else rows)
        self._pending.append(
            Piece(values, block.loss.numpy().astype(np.float32, copy=False), block.count.numpy(), wait)
        )
        self._pending_rows += len(block)
        whole = (self._pending_rows // self.align) * self.align
        if self.next_row + self._pending_rows == self.stop:
            whole = self._pending_rows
        if whole:
            self._flush(whole)

    def _flush(self, n: int) -> None:
        """Hand the first ``n`` pending rows to the writer thread, as views (any joining of
        pieces happens there, off the compute thread)."""
        take: list[Piece] = []
        need = n
        while need:
            piece = self._pending[0]
            if len(piece.rows) <= need:
                take.append(self._pending.pop(0))
                need -= len(piece.rows)
            else:
                take.append(piece.part(slice(0, need)))
                self._pending[0] = piece.part(slice(need, None))
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

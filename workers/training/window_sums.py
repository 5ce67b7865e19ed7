"""A training log's sums of the window in progress, and their writes behind the next steps.

Holds ``WindowSums``: the window's ``C x width`` row sums and learning-rate-weighted sums, each
class's sample count and loss sum, on the model's device (``add``: one step's rows); when a step
falls in the next window the finished window goes to the store (``GradLogStore.write_window``,
then ``mark_done``: a window is done only once its arrays are). Under ``torch.distributed`` the
sums are reduced over the ranks first and rank 0 writes while the others wait (a barrier).

In one process the write runs on a writer thread while the next window's steps are summed into a
second set of sums (``background=True``): a window of ``C = 10,000`` rows of 4,096 columns is two
160 MB arrays, which take a 2-core CPU about as long to encode and write as ten training steps of
the benchmark's MLP. At most one write is in flight; the next window's hand-over waits for it, and
``close`` for the last, so a write's error surfaces at the next window or at ``close``. Memory: two
sets of sums instead of one (``background=False``: one, and the steps wait for each write).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from classgrad.store.training_log.log_store import GradLogStore

log = logging.getLogger(__name__)


class _Sums:
    """One window's accumulators."""

    def __init__(self, num_classes: int, width: int, device: torch.device):
        self.rows = torch.zeros(num_classes, width, device=device)
        self.lr_rows = torch.zeros_like(self.rows)
        self.count = torch.zeros(num_classes, dtype=torch.int64, device=device)
        self.loss = torch.zeros(num_classes, dtype=torch.float64, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.rows, self.lr_rows, self.count, self.loss

    def zero(self) -> None:
        for t in self.tensors():
            t.zero_()


class WindowSums:
    """The window in progress of a log of ``num_classes`` rows ``width`` wide on ``device``;
    ``store``: where windows go (None on a rank that does not write)."""

    def __init__(
        self,
        store: GradLogStore | None,
        num_classes: int,
        width: int,
        device: torch.device,
        *,
        distributed: bool,
        background: bool = True,
    ):
        self.store = store
        self.distributed = distributed
        self.sums = _Sums(num_classes, width, device)
        self.window: int | None = None  # the window being summed
        self.steps = (0, 0)  # its first step and one past the last added
        background = background and not distributed and store is not None  # collectives stay in order
        self._spare = _Sums(num_classes, width, device) if background else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grad-log-writer") if background else None
        self._pending: Future | None = None
        self._failed: BaseException | None = None  # a write that failed: every later use raises it

    def start(self, window: int, step: int) -> None:
        """Step ``step`` belongs to ``window``: the window in progress, written first if another."""
        if self._failed is not None:
            raise self._failed
        if self.window is not None and window != self.window:
            self.finish()
        if self.window is None:
            self.window, self.steps = window, (step, step)
        self.steps = (self.steps[0], step + 1)

    def add(
        self, ids: torch.Tensor, rows: torch.Tensor, lr: float, n: torch.Tensor, losses: torch.Tensor | None
    ) -> None:
        """Rows ``[k, width]`` of the distinct classes ``ids`` (on the device), ``n`` samples each."""
        sums = self.sums
        rows = rows.to(sums.rows.dtype)  # the log stores float32 whatever the model's dtype (float64 too)
        # The class ids of a step are distinct: each index is added once, in any order, exactly.
        sums.rows.index_add_(0, ids, rows)
        sums.lr_rows.index_add_(0, ids, rows * lr)
        sums.count.index_add_(0, ids, n.to(torch.int64))
        if losses is not None:
            sums.loss.index_add_(0, ids, losses.detach().to(sums.loss.device, torch.float64) * n.to(torch.float64))

    def finish(self) -> None:
        """Write the window in progress (behind the next steps when in the background)."""
        if self.window is None:
            return
        w, steps, sums = self.window, self.steps, self.sums
        self.window = None
        if self.distributed:
            for t in sums.tensors():
                dist.all_reduce(t)
        if self._pool is None:
            if self.store is not None:  # rank 0 (or the one process) writes it
                self._write(w, steps, sums)
            if self.distributed:
                dist.barrier()  # every rank goes on once the window is written and marked done
            sums.zero()
            return
        self.wait()  # one write in flight: its sums come back as the next spare
        assert self._spare is not None
        self.sums, self._spare = self._spare, None
        self._pending = self._pool.submit(self._write_then_zero, w, steps, sums)

    def wait(self) -> None:
        """Until the write in flight is done (its error, if any, raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                self._spare = pending.result()
            except BaseException as exc:
                self._failed = exc
                raise

    def close(self) -> None:
        """Write the window in progress and wait for it."""
        try:
            if self._failed is not None:
                raise self._failed
            self.finish()
            self.wait()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the writer (training ended in an error): a write in flight finishes, so a done
        window stays done; the window in progress is dropped, never marked done."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _write_then_zero(self, w: int, steps: tuple[int, int], sums: _Sums) -> _Sums:
        self._write(w, steps, sums)
        sums.zero()
        if sums.rows.is_cuda:  # zeroed before the steps add into it again, whatever stream they use
            torch.cuda.current_stream(sums.rows.device).synchronize()
        return sums

    def _write(self, w: int, steps: tuple[int, int], sums: _Sums) -> None:
        assert self.store is not None
        tensors = list(sums.tensors())
        if self.store.spec.dtype == "bfloat16":  # rounded where the sums are (a GPU: half the copy)
            tensors[:2] = [_bf16_bits(t) for t in tensors[:2]]
        rows, lr_rows, count, loss = (t.cpu().numpy() for t in tensors)
        self.store.write_window(w, rows, lr_rows, count, loss, steps)
        self.store.mark_done(w)  # after its chunks are written: a crash before leaves it absent
        log.debug("grad log: window %d (steps %d-%d) written", w, steps[0], steps[1] - 1)


def _bf16_bits(sums: torch.Tensor) -> torch.Tensor:
    """float32 sums as bfloat16 bits (uint16), rounded to nearest even by torch: one pass, where
    the sums are (numpy's integer route took four times a float32 window's write)."""
    return sums.to(torch.bfloat16).view(torch.uint16)

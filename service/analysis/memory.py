"""Peak resident memory of this process, for the tasks of ``classgrad similarity`` and the
benchmarks.

Holds ``PeakMemory`` (the peak from construction on: the kernel's high-water mark on Linux, a
sampling thread elsewhere) and ``_rss`` (this process's resident memory now).
"""

from __future__ import annotations

import threading


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak resident memory of this process from construction on.

    On Linux the kernel's high-water mark is reset (``/proc/self/clear_refs``) and read back
    (``VmHWM``), which is exact; elsewhere a thread samples the RSS every 2 ms (may miss very
    short peaks). ``start`` is the RSS at construction, so ``peak() - start`` is what the work
    in between added (memory the allocator kept from earlier work counts in ``start``)."""

    def __init__(self) -> None:
        self.start = _rss()
        self.exact = False  # True: the kernel's high-water mark; False: sampled
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.exact = _vm_hwm() is not None
        except OSError:
            pass
        self._max = self.start
        self._stop = threading.Event()
        self._thread = None
        if not self.exact:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._max = max(self._max, _rss())

    def peak(self) -> int:
        if self.exact:
            return max(_vm_hwm() or 0, self.start)
        return max(self._max, _rss())

    def close(self) -> int:
        peak = self.peak()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return peak

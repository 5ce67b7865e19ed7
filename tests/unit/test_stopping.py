"""``classgrad.service.driver_runtime.stopping``: SIGINT and SIGTERM stop a run like Ctrl-C, also in a
process that started with SIGINT ignored and blocked (what a Ray head started in the background
by a script hands to a job's driver); a second signal while stopping does not cut the cleanup
short, a third does. Each case runs in a fresh interpreter started that way."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.support.harness import REPO

_CHILD = """
import os, signal, sys
from classgrad.service.driver_runtime.stopping import install_stop_handlers

sig = getattr(signal, sys.argv[1])
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # started that way
install_stop_handlers()
try:
    os.kill(os.getpid(), sig)
    signal.sigtimedwait([], 0)  # let the handler run
    print("not stopped")
except KeyboardInterrupt:
    try:  # cleanup: a second signal is logged, not raised
        os.kill(os.getpid(), sig)
        print("cleanup finished")
    except KeyboardInterrupt:
        print("cleanup cut short")
    try:
        os.kill(os.getpid(), sig)
        print("third ignored")
    except KeyboardInterrupt:
        print("third stops")
"""


def _started_with_sigint_ignored_and_blocked() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_either_signal_stops_once_lets_cleanup_finish_then_stops_again(sig):
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, sig],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        preexec_fn=_started_with_sigint_ignored_and_blocked,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["cleanup", "finished", "third", "stops"], proc.stdout + proc.stderr

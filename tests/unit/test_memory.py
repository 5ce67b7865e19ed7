"""``workers.allocator.keep_freed_memory``: glibc keeps freed tensors' memory for the next ones.

Each case runs in a fresh interpreter: the allocator's thresholds are process state, and the
effect is what a fresh process's first call sees (a freed block reused without page faults)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, torch
from classgrad.workers.allocator import keep_freed_memory
applied = keep_freed_memory()
assert keep_freed_memory() == applied  # once per process, the same answer after
faults = []
for mib in (24, 16):  # the second fits in the first's freed memory, whatever follows that
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(mib << 18).fill_(1.0)  # past glibc's starting mmap threshold (128 KiB)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults)
"""
PAGES = (16 << 20) // 4096  # of the second block


def probe(**env: str) -> tuple[bool, int, int]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", PROBE], env=run_env, capture_output=True, text=True, check=True)
    applied, first, second = out.stdout.split()
    return applied == "True", int(first), int(second)


@pytest.mark.skipif(sys.platform != "linux", reason="mallopt is glibc's; elsewhere the call changes nothing")
def test_freed_memory_is_reused_without_faulting_it_in_again():
    applied, first, second = probe()
    assert applied == (platform.libc_ver()[0] == "glibc")
    if applied:
        assert first >= PAGES  # touched for the first time: faulted in
        # The second block is in the first's memory, kept (without the call: the first was a
        # mapping of its own, returned on free, and every page of the second faults). Slack
        # for the interpreter's own objects.
        assert second < PAGES // 10


def test_the_user_can_turn_it_off_or_choose_for_themselves():
    assert probe(CLASSGRAD_KEEP_FREED_MEMORY="0")[0] is False
    assert probe(MALLOC_MMAP_THRESHOLD_="1048576")[0] is False  # the user's own malloc settings stand

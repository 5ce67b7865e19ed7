"""The Ray test cluster starts a worker again whose `ray start` timed out during startup.

Ray 2.60's `ray start` gives up when the node's raylet has not registered with the GCS within
30 s, a constant no setting widens, and a loaded 2-core CI machine has missed it (CI's fault
tests then failed in setup). ``LocalRayCluster`` starts such a worker again, up to
``NODE_START_TRIES`` tries, after killing what the failed try left running, and a head whose
GCS missed its own startup deadline on fresh ports; any other exit is still an error at once.
The failed tries here are injected: a stand-in for `ray start` that leaves a child running (as a
failed try leaves its raylet), prints Ray's message and exits 1.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.cluster import NODE_START_TRIES, STARTUP_TIMEOUT_MARK, LocalRayCluster, RayNode

# What Ray prints (ray/_private/node.py) when the raylet did not register in time.
RAY_TIMEOUT_MESSAGE = (
    "Exception: The current node timed out during startup. This could happen because some of the "
    "raylet failed to startup or the GCS has become overloaded."
)


def _failing_start(message: str, leftover_pid_file: Path) -> list[str]:
    """A `ray start` stand-in: a child left running in the node's session, then ``message``."""
    script = textwrap.dedent(
        f"""
        import subprocess, sys
        child = subprocess.Popen(["sleep", "600"])
        open({str(leftover_pid_file)!r}, "a").write(f"{{child.pid}}\\n")
        print({message!r}, flush=True)
        sys.exit(1)
        """
    )
    return [sys.executable, "-c", script]


class FlakyStartCluster(LocalRayCluster):
    """Workers' (or, with ``fail_head``, the head's) first ``fail_tries`` `ray start` tries
    print ``message`` and exit 1."""

    def __init__(
        self, *, fail_tries: int, message: str = RAY_TIMEOUT_MESSAGE, fail_head: bool = False, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.fail_tries = fail_tries
        self.message = message
        self.fail_head = fail_head
        self.leftovers = self.root / "leftover_pids"

    def _ray_command(self, node: RayNode) -> list[str]:
        if node.head == self.fail_head and node.tries <= self.fail_tries:
            return _failing_start(self.message, self.leftovers)
        return super()._ray_command(node)

    def leftover_pids(self) -> list[int]:
        return [int(p) for p in self.leftovers.read_text().split()] if self.leftovers.exists() else []


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


def test_ray_message_is_the_mark():
    assert STARTUP_TIMEOUT_MARK in RAY_TIMEOUT_MESSAGE  # the retry keys on Ray's own words


@pytest.mark.slow  # a real head and worker
def test_a_worker_that_timed_out_during_startup_is_started_again():
    with FlakyStartCluster(fail_tries=1, workers=1, head_cpus=0, worker_cpus=1) as cluster:
        worker = cluster.nodes[1]
        assert worker.tries == 2 and worker.alive
        assert set(cluster.node_ids()) == {0, 1}  # the second try registered, under its own name
        (leftover,) = cluster.leftover_pids()
        assert not _running(leftover)  # what the failed try left running was killed
        assert worker.ray_name == "cg-worker-1-try2" and "try2" in worker.log_path.name
        cluster.stop_node(1)
        assert not cluster.session_pids(1)


@pytest.mark.slow  # a real head
def test_a_head_whose_gcs_missed_its_startup_deadline_is_started_again_on_fresh_ports():
    message = "ray.exceptions.RpcError: GCS ... failed: Deadline Exceeded"  # as the head's client says it
    cluster = FlakyStartCluster(fail_tries=1, fail_head=True, message=message, workers=0, head_cpus=1)
    first_port = cluster.gcs_port
    with cluster:
        head = cluster.nodes[0]
        assert head.tries == 2 and head.alive and cluster.gcs_port != first_port
        assert set(cluster.node_ids()) == {0}
        (leftover,) = cluster.leftover_pids()
        assert not _running(leftover)


def test_a_worker_that_keeps_timing_out_fails_after_the_last_try():
    # No head is started: the stand-ins never reach one, and waiting only checks the processes.
    cluster = FlakyStartCluster(fail_tries=NODE_START_TRIES, workers=0)
    try:
        cluster._start_node(head=False, num_cpus=1)
        with pytest.raises(RuntimeError, match="exited with 1") as raised:
            cluster.wait_for_nodes(1, timeout_s=60)
        assert STARTUP_TIMEOUT_MARK in str(raised.value)
        assert cluster.nodes[0].tries == NODE_START_TRIES
        leftovers = cluster.leftover_pids()
        assert len(leftovers) == NODE_START_TRIES
        assert not any(_running(p) for p in leftovers[:-1])  # each retry killed the try before it
    finally:
        cluster.shutdown()
    assert not any(_running(p) for p in leftovers)  # and shutdown the last one's


def test_any_other_start_failure_is_an_error_at_once():
    cluster = FlakyStartCluster(fail_tries=1, message="ValueError: some other failure", workers=0)
    try:
        cluster._start_node(head=False, num_cpus=1)
        with pytest.raises(RuntimeError, match="some other failure"):
            cluster.wait_for_nodes(1, timeout_s=60)
        assert cluster.nodes[0].tries == 1
    finally:
        cluster.shutdown()
    assert os.path.exists(cluster.root) is False

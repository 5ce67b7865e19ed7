"""A real multi-node Ray cluster on loopback, for integration and fault tests.

Holds ``LocalRayCluster`` (and its ``RayNode`` records): a head node with the dashboard and job
server plus any number of worker nodes joined with ``ray start --address``, all on 127.0.0.1,
each node a separate ``ray start --block`` process tree with its own ports, temp dir, log file
and Unix session, so one node can be stopped (``stop_node``: SIGTERM to each of its processes,
what ``ray stop`` sends) or crashed (``stop_node(i, force=True)``: SIGKILL) without touching the
others or any other Ray on the machine (``ray stop`` itself would stop every Ray here).
``free_port`` is the port picker it uses.

Token authentication stays on: the cluster gets its own random token in a file under its root
(``RAY_AUTH_MODE=token`` + ``RAY_AUTH_TOKEN_PATH`` in every node's environment), so nothing is
read from or written to ``~/.ray``. ``client_env()`` is the environment a client process (our
CLI, ``ray job submit``, a ``ray.init`` driver) needs to talk to it; ``client_env(token=False)``
is one without any token, for checking that such clients are refused.

Typical use, one cluster per test module (starting one costs ~10-20 s on 2 cores)::

    from tests.support.cluster import LocalRayCluster

    @pytest.fixture(scope="module")
    def cluster():
        with LocalRayCluster(workers=2, head_cpus=1, worker_cpus=1) as c:
            yield c

    def test_x(cluster):
        subprocess.run([..., "--address", cluster.dashboard_url], env=cluster.client_env())
        cluster.stop_node(1)                       # worker node 1 goes away
        cluster.actor_nodes("classgrad-")          # {actor name: node index} of live actors

Nodes are numbered in start order: 0 is the head, 1.. the workers (``add_node`` appends). Every
process of a node (the ``--block`` parent, raylet, agents, log monitor, workers) shares the Unix
session the parent was started in; that is how ``stop_node`` finds exactly them (Ray gives each
worker its own process group, so a process group would miss the actors). ``shutdown`` (also on
``__exit__``, also when a test fails) stops every node still up, head last.

A worker whose ``ray start`` gives up because its raylet did not register in time ("timed out
during startup": a fixed 30 s in Ray 2.60, missed on a loaded CI machine) is started again, up to
``NODE_START_TRIES`` tries, each under a new Ray node name (``RayNode.ray_name``); so is a head
whose GCS missed its own startup deadline, before any worker joined, on fresh ports. Any other
exit of a node is an error at once (``tests/integration/test_cluster_harness.py``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# Ray's minimum object store (75 MiB) plus headroom: the jobs here never put rows in it, and the
# default (30% of RAM per node) would reserve gigabytes of /dev/shm per node for nothing.
OBJECT_STORE_BYTES = 100 * 1024 * 1024
NODE_START_TIMEOUT_S = 120.0
# Like `ray stop --grace-period`: a raylet takes up to ~10 s to drain after SIGTERM, the GCS and
# the autoscaler monitor on the head may not exit on SIGTERM at all.
NODE_STOP_GRACE_S = 12.0
SHUTDOWN_GRACE_S = 2.0  # tearing the whole cluster down needs no drain
# `ray start` on a worker gives up when its raylet has not registered with the GCS within 30 s
# (a constant in Ray 2.60's node.py, no setting widens it), which a loaded 2-core CI machine
# has missed; such a worker is started again, up to this many tries in all.
NODE_START_TRIES = 3
STARTUP_TIMEOUT_MARK = "timed out during startup"
# The head's `ray start` gives up the same way when its GCS does not answer its own client in
# time on a loaded machine ("... Deadline Exceeded"), which a suite run has missed once.
HEAD_START_MARKS = (STARTUP_TIMEOUT_MARK, "Deadline Exceeded")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the OS picks it), never one this process
    was given before: the OS may hand a just-released port out again, and two components of one
    Ray node given the same port refuse to start ("is trying to use a port number ... that is used
    by other components", seen in CI)."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ray_executable() -> str:
    """The ``ray`` CLI of the interpreter running the tests (the venv), not whatever is on PATH."""
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else shutil.which("ray") or "ray"


@dataclass
class RayNode:
    """One ``ray start --block`` process tree: the head (index 0) or a worker node."""

    index: int
    name: str
    head: bool
    num_cpus: int
    temp_dir: Path
    log_path: Path
    ports: dict[str, int]
    proc: subprocess.Popen | None = None
    stopped: bool = False
    tries: int = 0  # `ray start` launches so far (see NODE_START_TRIES)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ray_name(self) -> str:
        """The node name Ray reports. A retried start gets a new one, so a raylet of the failed
        try that registered late (killed, but ALIVE in the GCS until its health check fails) is
        never taken for this node."""
        return f"cg-{self.name}" + (f"-try{self.tries}" if self.tries > 1 else "")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self.stopped

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class LocalRayCluster:
    """A head node (dashboard + job server) and ``workers`` worker nodes on 127.0.0.1.

    Args:
        workers: worker nodes started with the head (more with ``add_node``).
        head_cpus / worker_cpus: logical CPUs each node advertises (0 keeps work off the head).
        root: directory for temp dirs, logs and the token; a fresh short one under /tmp by
            default (Unix socket paths inside Ray's session dir must stay under ~107 bytes,
            which pytest's deep tmp paths can exceed). Removed on shutdown if we made it.
        env: extra environment for every node (e.g. object-store credentials, PYTHONPATH);
            the nodes also get the test interpreter's bin dir first on PATH, like an activated
            venv or a container image, so ``python`` and ``classgrad`` resolve to it in job
            entrypoints.
        system_config: Ray system config for the head (``ray start --system-config``), e.g.
            ``{"health_check_period_ms": 1000}`` to notice crashed nodes sooner.
        ignore_sigint: start every node with SIGINT ignored, as a script that starts Ray in the
            background (``setsid ray start ... &``) does: every process Ray starts inherits it,
            job drivers too.

    The root (logs included) is removed on shutdown unless ``CLASSGRAD_KEEP_RAY_LOGS=1`` is set,
    for looking at a failed test's nodes afterwards.
    """

    def __init__(
        self,
        *,
        workers: int = 1,
        head_cpus: int = 1,
        worker_cpus: int = 1,
        root: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        system_config: Mapping[str, Any] | None = None,
        object_store_bytes: int = OBJECT_STORE_BYTES,
        start_timeout_s: float = NODE_START_TIMEOUT_S,
        ignore_sigint: bool = False,
    ) -> None:
        self.ignore_sigint = ignore_sigint
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="cgray-", dir="/tmp"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.initial_workers = workers
        self.head_cpus = head_cpus
        self.worker_cpus = worker_cpus
        self.extra_env = dict(env or {})
        self.system_config = dict(system_config or {})
        self.object_store_bytes = object_store_bytes
        self.start_timeout_s = start_timeout_s
        self.nodes: list[RayNode] = []
        self.token_path = self.root / "auth_token"
        self.gcs_port = free_port()
        self.dashboard_port = free_port()

    # --- addresses and environments ---------------------------------------------------------

    @property
    def gcs_address(self) -> str:
        """``host:port`` of the GCS: what ``ray start --address`` and ``ray.init`` take."""
        return f"{HOST}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """``http://127.0.0.1:PORT``: the job server (``classgrad submit --address``)."""
        return f"http://{HOST}:{self.dashboard_port}"

    @property
    def token(self) -> str:
        return self.token_path.read_text().strip()

    def _base_env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_"))
        }
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env

    def node_env(self) -> dict[str, str]:
        """Environment of every node's processes (and so of job drivers and actors)."""
        env = self._base_env()
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        env.update(self.extra_env)
        return env

    def client_env(self, *, token: bool = True, home: str | Path | None = None) -> dict[str, str]:
        """Environment of a client process on "another machine": no RAY_ADDRESS, and the token
        through ``RAY_AUTH_TOKEN_PATH`` (plus ``RAY_AUTH_MODE=token``, which Ray 2.60's own
        clients need before they send it to an explicit address). ``token=False`` gives a client
        with no token anywhere: ``HOME`` points at an empty directory so ``~/.ray/auth_token``
        is not found either."""
        env = self._base_env()
        if token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        else:
            empty_home = Path(home) if home is not None else self.root / "empty-home"
            empty_home.mkdir(exist_ok=True)
            env["HOME"] = str(empty_home)
        return env

    # --- starting and stopping nodes ---------------------------------------------------------

    def start(self) -> LocalRayCluster:
        # A fresh random token per cluster, readable only by us (it is a credential).
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            self._start_node(head=True, num_cpus=self.head_cpus)
            self._wait_dashboard()
            for _ in range(self.initial_workers):
                self._start_node(head=False, num_cpus=self.worker_cpus)
            self.wait_for_nodes(len(self.nodes))
        except BaseException:
            self.shutdown()
            raise
        return self

    def add_node(self, num_cpus: int | None = None, *, wait: bool = True) -> int:
        """Start one more worker node; returns its index."""
        node = self._start_node(head=False, num_cpus=self.worker_cpus if num_cpus is None else num_cpus)
        if wait:
            self.wait_for_nodes(len(self.alive_nodes()))
        return node.index

    def _start_node(self, *, head: bool, num_cpus: int) -> RayNode:
        index = len(self.nodes)
        name = "head" if head else f"worker-{index}"
        node = RayNode(
            index=index,
            name=name,
            head=head,
            num_cpus=num_cpus,
            temp_dir=self.root / f"n{index}",  # short: it prefixes Unix socket paths
            log_path=self.root / f"{name}.log",
            ports={},
        )
        self.nodes.append(node)
        self._launch(node)
        return node

    def _launch(self, node: RayNode) -> None:
        """One `ray start --block` try for ``node``, with fresh ports (a failed try's may linger)."""
        node.tries += 1
        if node.tries > 1:
            node.temp_dir = self.root / f"n{node.index}t{node.tries}"
            node.log_path = self.root / f"{node.name}.try{node.tries}.log"
        node.temp_dir.mkdir(parents=True, exist_ok=True)
        node.ports = {
            "node_manager": free_port(),
            "object_manager": free_port(),
            "dashboard_agent_listen": free_port(),
            "dashboard_agent_grpc": free_port(),
            "runtime_env_agent": free_port(),
            "metrics_export": free_port(),
        }
        with open(node.log_path, "wb") as out:
            # Own session: stop_node finds exactly this node's processes by their session id.
            node.proc = subprocess.Popen(
                self._ray_command(node),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.node_env(),
                cwd=self.root,
                start_new_session=True,
                preexec_fn=_ignore_sigint if self.ignore_sigint else None,
            )
        log.info(
            "started Ray node %d (%s, try %d), pid %d, log %s",
            node.index,
            node.name,
            node.tries,
            node.proc.pid,
            node.log_path,
        )

    def _ray_command(self, node: RayNode) -> list[str]:
        ports = node.ports
        cmd = [
            _ray_executable(),
            "start",
            "--block",
            "--disable-usage-stats",
            f"--node-ip-address={HOST}",
            f"--node-name={node.ray_name}",
            f"--temp-dir={node.temp_dir}",
            f"--num-cpus={node.num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={self.object_store_bytes}",
            f"--node-manager-port={ports['node_manager']}",
            f"--object-manager-port={ports['object_manager']}",
            f"--dashboard-agent-listen-port={ports['dashboard_agent_listen']}",
            f"--dashboard-agent-grpc-port={ports['dashboard_agent_grpc']}",
            f"--runtime-env-agent-port={ports['runtime_env_agent']}",
            f"--metrics-export-port={ports['metrics_export']}",
            # 0/0 = workers bind OS-chosen ports: a fixed range would collide between nodes.
            "--min-worker-port=0",
            "--max-worker-port=0",
        ]
        if node.head:
            ports.update(gcs=self.gcs_port, dashboard=self.dashboard_port, client_server=free_port())
            cmd += [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=true",
                f"--dashboard-host={HOST}",
                f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={ports['client_server']}",
            ]
            if self.system_config:
                cmd.append(f"--system-config={json.dumps(self.system_config)}")
        else:
            cmd.append(f"--address={self.gcs_address}")
        return cmd

    def _retry_start(self, node: RayNode) -> bool:
        """Start a node again whose `ray start` gave up on a startup deadline (a worker's raylet
        not registered in time; the head's own GCS client past its deadline, before any worker
        joined: then on fresh GCS and dashboard ports, the old ones may linger); False (the
        caller raises) for any other exit, or once the tries are spent."""
        marks = HEAD_START_MARKS if node.head else (STARTUP_TIMEOUT_MARK,)
        if node.tries >= NODE_START_TRIES or not any(m in node.log_tail() for m in marks):
            return False
        if node.head and len(self.nodes) > 1:
            return False  # workers joined its address
        if node.head:
            self.gcs_port, self.dashboard_port = free_port(), free_port()
        log.warning(
            "Ray node %d (%s) timed out during startup (try %d of %d); starting it again:\n%s",
            node.index,
            node.name,
            node.tries,
            NODE_START_TRIES,
            node.log_tail(800),
        )
        self.stop_node(node.index, force=True)  # the try's raylet and agents may still run
        node.stopped = False
        self._launch(node)
        return True

    def session_pids(self, index: int) -> list[int]:
        """Pids of every live process of node ``index``: its session (``start_new_session``).
        Ray puts each worker in a process group of its own but leaves it in the session, so the
        session, not the process group, is what covers raylet, agents and workers."""
        node = self.nodes[index]
        if node.proc is None:
            return []
        sid = node.proc.pid
        pids = []
        node.proc.poll()  # reap the parent if it exited, so it does not linger as a zombie
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getsid(int(entry)) != sid:
                        continue
                    with open(f"/proc/{entry}/stat", "rb") as fh:
                        state = fh.read().rsplit(b")", 1)[1].split()[0]
                except OSError:  # gone meanwhile, or not ours
                    continue
                if state != b"Z":  # a zombie has exited already; only its parent can reap it
                    pids.append(int(entry))
        return pids

    def _signal_node(self, index: int, sig: signal.Signals) -> int:
        sent = 0
        for pid in self.session_pids(index):
            try:
                os.kill(pid, sig)
                sent += 1
            except OSError:
                pass
        return sent

    def stop_node(self, index: int, *, force: bool = False, grace_s: float = NODE_STOP_GRACE_S) -> None:
        """Stop one node, as ``ray stop`` would on a machine that ran only that node: SIGTERM to
        each of its processes at once (workers exit at once and the raylet tells the GCS it is
        leaving, so its actors are declared dead right away), SIGKILL for whatever is left after
        ``grace_s`` (as ``ray stop`` does after its grace period).
        ``force=True`` SIGKILLs them all at once instead: a crashed machine, which the GCS only
        notices through missed health checks (see ``system_config`` to make that faster)."""
        node = self.nodes[index]
        if node.proc is None or node.stopped:
            return
        node.stopped = True
        self._signal_node(index, signal.SIGKILL if force else signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.session_pids(index) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._signal_node(index, signal.SIGKILL):
            log.debug("node %d: processes left after %.0f s were killed", index, grace_s)
        try:
            node.proc.wait(timeout=NODE_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("node %d (pid %d) survived SIGKILL", index, node.proc.pid)
        log.info("stopped Ray node %d (%s)%s", index, node.name, " (killed)" if force else "")

    def shutdown(self) -> None:
        """Stop every node still running (workers first, the head last) and remove the root."""
        for node in reversed(self.nodes):
            try:
                self.stop_node(node.index, grace_s=SHUTDOWN_GRACE_S)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                log.error("could not stop node %d: %s", node.index, exc)
        if self._own_root and os.environ.get("CLASSGRAD_KEEP_RAY_LOGS") != "1":
            shutil.rmtree(self.root, ignore_errors=True)
        elif self._own_root:
            log.warning("Ray cluster files kept in %s", self.root)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --- state ---------------------------------------------------------------------------------

    def alive_nodes(self) -> list[RayNode]:
        return [n for n in self.nodes if n.alive]

    def api(self, path: str, *, timeout_s: float = 10.0) -> Any:
        """GET a dashboard JSON endpoint with the cluster's token (e.g. ``/api/v0/nodes``)."""
        request = urllib.request.Request(
            f"{self.dashboard_url}{path}", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - loopback
            return json.loads(response.read())

    def _state(self, kind: str, **filters: str) -> list[dict]:
        query = "&".join(f"filter_keys={k}&filter_predicates=%3D&filter_values={v}" for k, v in filters.items())
        payload = self.api(f"/api/v0/{kind}?limit=1000&detail=1" + (f"&{query}" if query else ""))
        return payload["data"]["result"]["result"]

    def _index_by_ray_name(self) -> dict[str, int]:
        return {n.ray_name: n.index for n in self.nodes}

    def node_ids(self) -> dict[int, str]:
        """{node index: Ray node id} of the nodes the GCS reports ALIVE."""
        by_name = self._index_by_ray_name()
        return {
            by_name[r["node_name"]]: r["node_id"]
            for r in self._state("nodes", state="ALIVE")
            if r.get("node_name") in by_name
        }

    def node_index(self, node_id: str) -> int | None:
        """Our index of a Ray node id (alive or dead), or None."""
        by_name = self._index_by_ray_name()
        for r in self._state("nodes"):
            if r["node_id"] == node_id:
                return by_name.get(r.get("node_name"))
        return None

    def actor_nodes(self, name_prefix: str = "") -> dict[str, int]:
        """{actor name: node index} of ALIVE named actors whose name starts with ``name_prefix``."""
        index = {v: k for k, v in self.node_ids().items()}
        return {
            a["name"]: index[a["node_id"]]
            for a in self._state("actors", state="ALIVE")
            if a.get("name", "").startswith(name_prefix) and a.get("node_id") in index
        }

    def wait_for_nodes(self, count: int, timeout_s: float | None = None) -> None:
        """Wait until the GCS reports ``count`` alive nodes of ours (raises with logs if not)."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        seen = -1
        while time.monotonic() < deadline:
            self._check_processes()
            try:
                seen = len(self.node_ids())
                if seen == count:
                    return
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{seen} of {count} Ray nodes came up within the timeout; logs:\n{self._logs()}")

    def _wait_dashboard(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            self._check_processes()
            try:
                self.api("/api/version", timeout_s=2.0)
                return
            except (OSError, ValueError, urllib.error.URLError):
                time.sleep(0.5)
        raise RuntimeError(f"the Ray dashboard did not answer on {self.dashboard_url}; logs:\n{self._logs()}")

    def _check_processes(self) -> None:
        """Raise for a node whose `ray start` exited, unless it is a worker started again."""
        for node in self.nodes:
            if not node.stopped and node.proc is not None and node.proc.poll() is not None:
                if self._retry_start(node):
                    continue
                raise RuntimeError(
                    f"Ray node {node.index} ({node.name}) exited with {node.proc.returncode}:\n{node.log_tail()}"
                )

    def _logs(self) -> str:
        return "\n".join(f"--- {n.name} ({n.log_path})\n{n.log_tail()}" for n in self.nodes)

"""The driver of one extraction job: plan, create the store, run the actors, survive faults.

Holds:
- ``JobDriver``: joins or starts Ray, hands the shards to its actors through a
  ``dispatch.ShardDispatcher`` over ``ray_actors.RayActors`` (shards only to ready actors, a lost
  actor's shards requeued and the actor replaced, a shard that raised retried up to
  ``sharding.max_attempts``, bounds on actors that do not start), holds the store's lease, shows
  progress, stops its actors before it counts what they saved, and writes the run summary into
  the store's history.
- ``RunSummary``: what a run did, printed by the CLI and stored in the run history.
- ``run_job``: the whole job as one call (``classgrad.run_job``).

What happens before any actor starts (the job checked, the store prepared, the recorded identity
compared) is ``preparation``'s.

Rows never pass through the driver or Ray's object store: actors write them, and return reports.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import psutil

from classgrad.config import JobConfig
from classgrad.config.redaction import has_secrets, redact_text
from classgrad.errors import (
    ClassgradError,
    ConfigError,
    StoreError,
    first_line,
)
from classgrad.service.driver_runtime.dispatch import ActorBackend, ActorSlot, DispatchPolicy, ShardDispatcher
from classgrad.service.driver_runtime.plan import Shard, dispatch_order
from classgrad.service.driver_runtime.preparation import check_identity, check_job, prepare_store
from classgrad.service.driver_runtime.progress import Progress
from classgrad.service.driver_runtime.ray_actors import RayActors
from classgrad.service.driver_runtime.ray_session import ray_session, resolve_ray_address
from classgrad.service.driver_runtime.run_ids import new_run_id
from classgrad.service.driver_runtime.run_record import estimate_record, record_peak, summary_lines
from classgrad.service.driver_runtime.shipping import actor_config, working_dir_env
from classgrad.service.driver_runtime.stopping import stop_actors
from classgrad.store import GradStore, HeldLease, store_lease
from classgrad.workers.actor_runtime.actor import GradientWorker
from classgrad.workers.devices import check_device
from classgrad.workers.imports import from_working_dir

log = logging.getLogger(__name__)

MAX_ENGINE_NOTES = 5  # a summary line each; the engine's log has them all
ENGINE_NOTE_CHARS = 200
# How long a stopping run waits for its killed actors to end (Ray's report, their processes);
# well inside the 30 s a stopped Ray job has before its SIGKILL (``submit.STOP_ENV``), so the
# record is still written.
ACTOR_STOP_WAIT_S = 10.0


def _note_key(note: str) -> str:
    """A note without the figures in its parentheses ("(seconds per sample: 1.2e-03)"): two notes
    that differ only in those say the same thing."""
    return re.sub(r"\([^()]*\)", lambda m: re.sub(r"[0-9][0-9.eE+-]*", "#", m.group()), note)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class RunSummary:
    """What one run did; printed at the end and appended to the store's run history."""

    run_id: str
    status: str = "running"  # complete | failed | interrupted
    started: str = field(default_factory=_now)
    ended: str | None = None
    engine: str = ""
    shards_total: int = 0
    shards_skipped: int = 0  # already done when the run started (resume)
    shards_done: int = 0  # done by this run
    rows: int = 0  # rows computed by this run
    seconds: float = 0.0  # the whole run: startup_s + compute_s
    startup_s: float = 0.0  # from the run's start until every actor is ready (Ray, store, actor builds)
    compute_s: float = 0.0  # from then to the end
    rows_per_s: float = 0.0  # over compute_s only: start-up is reported apart
    bytes: int = 0
    recomputed_rows: int = 0
    retries: int = 0  # shard attempts beyond the first (actor deaths and errors)
    actors_replaced: int = 0
    nodes: list[str] = field(default_factory=list)
    engine_notes: list[str] = field(default_factory=list)  # the path the engine took, and why (deduped, short)
    fallbacks: list[str] = field(default_factory=list)  # paths given up for slower ones, said plainly (deduped)
    preflight: list[str] = field(default_factory=list)  # the preflight's notes: clamps, warnings near a limit
    memory: dict[str, Any] = field(default_factory=dict)  # the preflight's estimate beside each actor's peak
    error: str | None = None

    def add_engine_notes(self, notes: list[str]) -> None:
        """Add ``notes`` not already held, each cut to one short line, up to ``MAX_ENGINE_NOTES``."""
        from classgrad.service.driver_runtime.run_record import add_fallback

        for note in notes:
            line = first_line(note, limit=ENGINE_NOTE_CHARS)
            if add_fallback(self.fallbacks, line):  # a fallback: said apart, once
                continue
            # Once per kind: each actor reports its own measured figures ("image inputs
            # channels_last (seconds per sample: ...)"), which differ only in their numbers.
            seen = {_note_key(n) for n in self.engine_notes}
            if line and _note_key(line) not in seen and len(self.engine_notes) < MAX_ENGINE_NOTES:
                self.engine_notes.append(line)

    def finish(self, seconds: float, ready_after_s: float | None) -> None:
        """Set the run's times: ``ready_after_s`` is when every actor was ready (None: never, so the
        whole run was start-up), and the rate is over compute alone."""
        self.seconds = seconds
        self.startup_s = seconds if ready_after_s is None else min(ready_after_s, seconds)
        self.compute_s = seconds - self.startup_s
        self.rows_per_s = self.rows / self.compute_s if self.compute_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        return [
            f"run {self.run_id}: {self.status}",
            f"  shards      {self.shards_done} computed, {self.shards_skipped} already done, {self.shards_total} total",
            f"  rows        {self.rows} in {self.compute_s:.1f} s of compute ({self.rows_per_s:.1f} rows/s), "
            f"{self.bytes / 2**20:.1f} MiB written",
            f"  start-up    {self.startup_s:.1f} s (Ray, store, actors); {self.seconds:.1f} s in all",
            f"  engine      {self.engine}; recomputed rows (fp16 overflow): {self.recomputed_rows}",
            *(f"              {note}" for note in self.engine_notes),
            *summary_lines(self.fallbacks, self.preflight, self.memory),
            f"  faults      {self.retries} shard retries, {self.actors_replaced} actors replaced",
        ] + ([f"  error       {self.error}"] if self.error else [])


class JobDriver:
    """Runs one job to completion on Ray, resuming whatever a previous run left done."""

    def __init__(self, config: JobConfig, *, run_id: str | None = None, preflight: bool = True):
        self.config = config
        self.preflight = preflight  # False: --no-preflight (the resource checks of check_job skipped)
        self.run_id = run_id or new_run_id()
        self.summary = RunSummary(run_id=self.run_id)
        self.completions: collections.Counter = collections.Counter()  # shard index -> times completed
        self._ray = contextlib.ExitStack()  # the Ray session this driver opened, closed in _shutdown
        self._ready_after_s: float | None = None  # seconds from the run's start until cluster.min_workers were ready
        self._t_start = 0.0
        self._dispatcher: ShardDispatcher | None = None
        self._progress: Progress | None = None
        self._lease: HeldLease | None = None
        self._processes: dict[tuple[int, int], psutil.Process] = {}  # (slot, generation) -> its process, on our node
        self._shipped = False  # the working directory went to the actors (they start in a copy of it)
        self._node: str | None = None  # the Ray node this driver runs on, once connected
        self._identity: dict | None = None  # the driver's build (RunIdentity.to_dict()), for the actors
        self._checked_targets: np.ndarray | None = None  # the probe set's targets, as this driver gathered them
        self._probe_targets: Any = None  # their Ray object, put once, which every actor takes

    # --- Ray ------------------------------------------------------------------------------

    def _connect(self) -> None:
        """Use this process's Ray, or join cluster.address (RAY_ADDRESS inside a Ray job), or start a
        local Ray with enough CPUs for every actor."""
        cluster = self.config.cluster
        needed = cluster.num_workers * cluster.num_cpus_per_worker
        cpus = os.cpu_count() or 1
        starts_local = self.starts_local_ray()
        if starts_local and needed > cpus:
            log.warning("the job asks for %d CPUs on a %d-CPU machine; actors will share cores", needed, cpus)
        import ray

        # The user's own modules beside the job file go to every actor (Ray ships a local directory
        # only with the session: a session this process already has keeps what it was given).
        ship = None if ray.is_initialized() else working_dir_env()
        self._shipped = ship is not None
        if ray.is_initialized() and from_working_dir():
            log.warning(
                "module(s) %s come from the working directory, which this process's Ray session was not "
                "started with: actors on other machines will not find them (run with a session of its own)",
                ", ".join(sorted(from_working_dir())),
            )
        self._ray.enter_context(
            ray_session(cluster.address, option="cluster.address", num_cpus=max(cpus, needed), runtime_env=ship)
        )
        self._node = ray.get_runtime_context().get_node_id()  # its actors' processes are ours to watch

    def _actor_options(self) -> dict[str, Any]:
        cluster = self.config.cluster
        options: dict[str, Any] = {
            "num_cpus": cluster.num_cpus_per_worker,
            "num_gpus": cluster.num_gpus_per_worker,
            "max_restarts": 0,  # the driver replaces dead actors itself and requeues their shards
            "max_task_retries": 0,
            "scheduling_strategy": "SPREAD",
        }
        if cluster.runtime_env:
            options["runtime_env"] = dict(cluster.runtime_env)
        return options

    def _warn_about_secrets(self) -> None:
        # Ray writes runtime_env values into its own logs (runtime_env_agent.log).
        if has_secrets(self.config.cluster.runtime_env):
            log.warning(
                "cluster.runtime_env holds secret-looking values; Ray writes runtime_env into its "
                "logs: give credentials to the nodes' environment instead"
            )

    def _check_device(self) -> None:
        """Refuse a device the actors cannot have, once, before any actor starts (an actor failing
        on it would be replaced, again and again): GPUs the cluster lacks, and on a cluster that is
        this machine alone, a device this machine lacks (Ray does not count MPS devices)."""
        import ray

        device = self.config.resolved_device()
        wanted = self.config.cluster.num_gpus_per_worker
        gpus = ray.cluster_resources().get("GPU", 0)
        # Whatever the device: Ray would keep the actors pending until run.actor_start_timeout_s.
        # (GPU nodes an autoscaler has not started yet count as none, as they did for cuda.)
        if gpus < wanted:
            fix = (
                "use engine.device=cpu and num_gpus_per_worker=0"
                if device.startswith("cuda")
                else "set cluster.num_gpus_per_worker=0"
            )
            raise ConfigError(
                f"engine.device {device!r}: the Ray cluster has {gpus:g} GPUs, each actor asks for "
                f"{wanted:g} (cluster.num_gpus_per_worker); {fix}"
            )
        if device == "cpu":
            return
        here = ray.util.get_node_ip_address()
        if all(node["NodeManagerAddress"] == here for node in ray.nodes() if node.get("Alive")):
            self._check_device_here()

    def starts_local_ray(self) -> bool:
        import ray

        return not ray.is_initialized() and resolve_ray_address(self.config.cluster.address)[0] is None

    def _check_device_here(self) -> None:

        try:
            check_device(self.config.resolved_device())
        except ClassgradError as exc:
            # "use cpu" alone would leave actors asking for a GPU, which would never start.
            hint = str(exc).endswith("(use cpu)") and self.config.cluster.num_gpus_per_worker > 0
            also = "; with engine.device=cpu, set cluster.num_gpus_per_worker=0 too" if hint else ""
            raise ConfigError(f"engine.{exc}{also}") from None

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> RunSummary:
        t_start = time.perf_counter()
        url = self.config.store.url
        if url.lower().startswith("memory://"):
            # The driver would create it in its own memory, where no actor can write a row.
            raise ConfigError(
                f"store.url {url!r}: a memory:// store lives in one process, and a job's actors run in "
                f"others; use a path or s3://bucket/path"
            )
        if self.starts_local_ray():  # the actors will run on this machine: check its device now
            self._check_device_here()
        store_cfg = self.config.store
        lease_of_store = store_lease(store_cfg.url, storage_options=store_cfg.storage_options)
        lease_of_store.check_free(self.run_id)  # a store in use is refused before the model is built
        checked = check_job(self.config, preflight=self.preflight)
        self._checked_targets = checked.probe_targets
        self.summary.add_engine_notes(checked.engine_notes)
        self.summary.preflight = list(checked.preflight_notes)
        self.summary.memory = {"estimate": estimate_record(checked.footprint), "peak_rss_per_actor": {}}
        # The lease is taken before the store is created, reopened or deleted, so that two drivers
        # never both touch it. It is released on the way out of the ``with`` (also when the record
        # failed: a stale lease would refuse the rerun), after the actors stopped and the record.
        try:
            with lease_of_store.hold(
                self.run_id,
                ttl_s=self.config.run.lease_ttl_s,
                info={"host": socket.gethostname(), "pid": os.getpid(), "started": self.summary.started},
            ) as lease:
                prepared = prepare_store(self.config, lease=lease, checked=checked)
                store = prepared.store
                self.summary.engine = prepared.engine_kind
                self.summary.shards_total = len(prepared.shards)
                check_identity(store, prepared.identity)  # before any done shard is trusted
                self._identity = prepared.identity
                todo: list[Shard] = []
                try:
                    # One listing: done shards whose recorded chunks are gone or resized are unmarked.
                    todo = dispatch_order(prepared.shards, store.unmark_damaged_shards())
                    self.summary.shards_skipped = len(prepared.shards) - len(todo)
                    if todo:
                        self._run_shards(store, todo, t_start, lease)
                    missing = store.missing_ranges()
                    if missing:
                        raise StoreError(f"store {store.url} still misses rows {missing[:5]} after the run")
                    self.summary.status = "complete"
                    return self.summary
                except KeyboardInterrupt:
                    self.summary.status = "interrupted"
                    self.summary.error = "interrupted by the user; rerun the same command to resume"
                    raise
                except ClassgradError as exc:
                    self.summary.status = "failed"
                    self.summary.error = redact_text(str(exc))
                    raise
                except BaseException as exc:
                    self.summary.status = "failed"
                    # One line: a library's message can be a whole dump (Ray's are 40 lines).
                    self.summary.error = redact_text(first_line(exc, with_type=True))
                    raise
                finally:
                    # Actors first: one still computing could mark a shard done after the count
                    # below, and the record would then say less than the store holds.
                    self._stop_actors()
                    if self.summary.status != "complete":
                        self._count_saved(store, todo)
                    self.summary.ended = _now()
                    self.summary.finish(time.perf_counter() - t_start, self._ready_after_s)
                    self._record(store)
        finally:
            self._shutdown()

    def _count_saved(self, store: GradStore, todo: list[Shard]) -> None:
        """A stopped run's shards and rows as the store holds them: an actor may have marked a shard
        done whose report the driver never read (Ctrl-C between the two), and the record must
        say what the rerun will skip."""
        try:
            done = store.shard_done
        except ClassgradError as exc:  # the run's own error says more; keep the driver's count
            log.warning("could not count the run's saved shards from the store: %s", exc)
            return
        saved = [s for s in todo if done[s.index]]
        self.summary.shards_done = len(saved)
        self.summary.rows = sum(s.rows for s in saved)

    def _record(self, store: GradStore) -> None:
        try:
            store.append_run(self.summary.to_dict())
        except ClassgradError as exc:
            log.error("could not record the run in the store: %s", exc)

    def _stop_actors(self) -> None:
        """Kill the actors and wait until none can mark a shard done (``stopping.stop_actors``),
        so that the run's count of saved shards is final."""
        dispatcher = self._dispatcher
        slots = [slot for slot in dispatcher.slots if slot.actor is not None] if dispatcher else []
        if not slots:
            return
        processes = [p for slot in slots if (p := self._processes.get((slot.index, slot.generation))) is not None]
        try:
            pending = stop_actors(
                [slot.actor for slot in slots],
                [call for slot in slots for call, _ in slot.inflight],
                processes,
                ACTOR_STOP_WAIT_S,
            )
            if pending:
                log.warning(
                    "%d actor calls or processes had not ended %.0f s after the kill", pending, ACTOR_STOP_WAIT_S
                )
        except Exception as exc:  # Ray itself is gone: the run's own error and record come first
            log.warning("could not stop the run's actors: %s", first_line(exc, with_type=True))
        finally:
            for slot in slots:
                slot.actor = None
                slot.inflight.clear()
            self._processes.clear()

    def _shutdown(self) -> None:
        self._stop_actors()  # when the run stopped before the lease was taken, or the stop raised
        self._ray.close()

    def _run_shards(self, store: GradStore, todo: list[Shard], t_start: float, lease: HeldLease) -> None:
        import ray

        self._connect()
        self._check_device()
        self._warn_about_secrets()
        self._t_start, self._lease = t_start, lease
        # Put once: every actor of a node maps the one copy (the probe set's targets, read and
        # hashed by this driver alone).
        self._probe_targets = ray.put(self._checked_targets) if self._checked_targets is not None else None
        c = self.config.cluster

        def resources() -> str:
            return (
                f"; each asks for {c.num_cpus_per_worker} CPU and {c.num_gpus_per_worker:g} GPU, the cluster has "
                f"{ray.cluster_resources()}"
            )

        self.dispatch(RayActors(GradientWorker, self._actor_options(), self._actor_args, self.run_id), todo, resources)

    def dispatch(
        self,
        backend: ActorBackend,
        todo: list[Shard],
        resources: Callable[[], str] = lambda: "",
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Compute ``todo`` on ``backend``'s actors (Ray's; the scale simulation's are simulated),
        this driver hearing of each ready actor and done shard."""
        cfg = self.config
        policy = DispatchPolicy(
            inflight_per_actor=cfg.cluster.inflight_per_worker,
            max_attempts=cfg.sharding.max_attempts,
            min_actors=cfg.cluster.min_workers,
            start_timeout_s=cfg.run.actor_start_timeout_s,
            resources=resources,
        )
        self._dispatcher = ShardDispatcher(
            backend,
            self,
            policy,
            num_actors=min(cfg.cluster.num_workers, len(todo)),
            shards_saved_before=self.summary.shards_skipped,
            shards_total=self.summary.shards_total,
            clock=clock,
        )
        self.completions = self._dispatcher.completions
        total_rows = sum(s.rows for s in todo)
        self._progress = Progress(total_rows, cfg.run.progress, cfg.run.log_every_s, label=f"run {self.run_id}")
        try:
            self._dispatcher.run(todo)
        finally:
            # Shards still in flight die with their actors in _stop_actors; nothing marks them done.
            self.summary.retries = self._dispatcher.retries
            self.summary.actors_replaced = self._dispatcher.actors_replaced
            self._progress.close()

    def _actor_args(self) -> tuple[tuple, dict[str, Any]]:
        kwargs = {
            "num_threads": self.config.cluster.num_cpus_per_worker,
            "run_id": self.run_id,
            "identity": self._identity,
            "probe_targets": self._probe_targets,
        }
        return (actor_config(self.config.model_dump(mode="json"), self._shipped),), kwargs

    # --- what the dispatcher tells the driver (dispatch.DispatchEvents) ------------------------------

    def actor_ready(self, slot: ActorSlot, info: dict[str, Any]) -> None:
        self._note_actor(slot, info)
        dispatcher = self._dispatcher
        if self._ready_after_s is None and dispatcher is not None and dispatcher.started_at is not None:
            self._ready_after_s = time.perf_counter() - self._t_start
            waiting = len(dispatcher.slots) - dispatcher.ever_ready
            log.info(
                "%d actor(s) ready on %d node(s)%s",
                dispatcher.ever_ready,
                len(self.summary.nodes),
                f"; {waiting} more join as they start" if waiting > 0 else "",
            )

    def shard_done(self, slot: ActorSlot, shard: Shard, report: dict[str, Any]) -> None:
        self.summary.shards_done += 1
        self.summary.rows += report["rows"]
        self.summary.bytes += report["bytes"]
        self.summary.recomputed_rows += report["recomputed_rows"]
        self.summary.add_engine_notes(report.get("engine_notes", []))
        record_peak(self.summary.memory, report)
        self._note_actor(slot, report)
        if self._progress is not None:
            self._progress.update(report["rows"])

    def tick(self) -> None:
        if self._lease is not None:
            self._lease.keep_alive()  # renews every third of the TTL
        if self._progress is not None:
            self._progress.tick()

    def _note_actor(self, slot: ActorSlot, info: dict[str, Any]) -> None:
        """The actor's node (for the summary) and, if that is the driver's own node (the same
        machine and process ids), its process, from its ready info or a report: a stopping driver
        waits for that process to exit."""
        if info.get("node") and info["node"] not in self.summary.nodes:
            self.summary.nodes.append(info["node"])
        key = (slot.index, slot.generation)
        if key not in self._processes and self._node is not None and info.get("node") == self._node:
            with contextlib.suppress(psutil.Error, KeyError, TypeError, ValueError):
                self._processes[key] = psutil.Process(int(info["pid"]))


def run_job(config: JobConfig, *, preflight: bool = True) -> RunSummary:
    """``classgrad run``: the whole job, as one call (``preflight``: False is ``--no-preflight``)."""
    return JobDriver(config, preflight=preflight).run()

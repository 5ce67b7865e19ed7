"""Helpers the reliability tests share: run the CLI, wait with a deadline, compare stores.

- ``classgrad_cli`` / ``start_cli``: ``python -m classgrad ...`` in a subprocess of its own
  session (so whatever it starts can be removed with ``kill_session``), from the repository
  root, with the repository on PYTHONPATH.
- ``error_lines``: the ``classgrad:`` lines of a CLI's stderr (there must be exactly one).
- ``wait_for``: poll a predicate until it is true or a deadline passes (no bare sleeps).
- ``shards_done``: shards marked done in a store, 0 while it does not exist yet.
- ``uninterrupted``: the rows an uninterrupted run of a job stores, computed in this process by
  the job's own worker (``GradientWorker``, the class the Ray actors run, with the actors' one
  torch thread), shard by shard into a store of its own. Same engine, same CPU arithmetic, so
  a faulty run must match it bit for bit.
- ``store_arrays``: rows, loss and count of a complete store (``rows`` raises if any row of a
  done shard is missing, or if a shard is not done).
- ``assert_identical``: two such results are bit-identical.
- ``reference_rows``: the float64 reference engine's rows for a job file (with overrides).
- ``tmpfs``: a small real filesystem mounted for a test (a full disk, a read-only one).
- ``ray_processes``, ``listening``, ``job_api_without_token``: the processes of a Ray instance,
  the TCP ports they listen on, and what a client without a token gets from each (loopback only).
- ``fault_job``: the small job of ``jobs.small_job`` through the fault-injecting loss of
  ``faulty.py``, with a fault plan for the actors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from classgrad.config import JobConfig
from classgrad.errors import StoreError
from classgrad.store import open_store

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "classgrad"]


def fault_job(url: str, plan_dir: str | None = None, **sections) -> dict:
    """The small job of ``jobs.small_job`` (48 classes, class 5 empty, 12 shards of 4 rows,
    2 actors) on an MLP, through ``faulty.flaky_cross_entropy``; ``plan_dir`` (a fault plan)
    goes to the actors' environment only. Without a plan its rows are those of a plain
    cross-entropy job."""
    from tests.support import faulty
    from tests.support.jobs import small_job

    mine: dict[str, dict] = {
        "model": {
            "factory": "tests.support.faulty:unhooked_mlp",
            "kwargs": {"num_classes": 48, "in_features": 8, "hidden": 16},
        },
        "data": {
            "kwargs": {
                "num_classes": 48,
                "samples_per_class": 3,
                "kind": "vector",
                "input_shape": [8],
                "empty_classes": [5],
                "seed": 2,
            }
        },
        "loss": {"kind": "tests.support.faulty:flaky_cross_entropy"},
        "engine": {"block_rows": 1},  # every class alone: see faulty.py
    }
    for name, values in sections.items():
        mine[name] = {**mine.get(name, {}), **values}
    job = small_job(url, **mine)
    if plan_dir is not None:
        env = dict(job["cluster"].get("runtime_env", {}).get("env_vars", {}))
        env[faulty.ENV] = plan_dir
        job["cluster"]["runtime_env"] = {**job["cluster"].get("runtime_env", {}), "env_vars": env}
    return job


def repo_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def write_job(path: Path, job: dict) -> str:
    path.write_text(yaml.safe_dump(job))
    return str(path)


def load_scale() -> float:
    """How many times its quiet time a wait may take now: the machine's load per core (1-minute
    average), at least 1. The tests' timeouts are for a quiet machine; under a load of 10-12 on 2
    cores a test runs about 7 times slower (benchmarks/RESULTS.md, "The suite under load")."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def classgrad_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI run to its end; ``timeout`` (a quiet machine's) stretched by ``load_scale``."""
    proc = subprocess.Popen(
        [*CLI, *args],
        cwd=REPO,
        env=env or repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout * load_scale())
    finally:
        kill_session(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_cli(*args: str, env: dict[str, str] | None = None, output: Path | None = None) -> subprocess.Popen:
    """The CLI in the background. Its output goes to pipes (read them with ``communicate``), or
    with ``output`` to the files ``output.stdout`` and ``output.stderr`` (for chatty runs whose
    output would fill a pipe that is read only at the end)."""
    if output is None:
        return subprocess.Popen(
            [*CLI, *args],
            cwd=REPO,
            env=env or repo_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    with open(f"{output}.stdout", "wb") as out, open(f"{output}.stderr", "wb") as err:
        return subprocess.Popen(
            [*CLI, *args], cwd=REPO, env=env or repo_env(), stdout=out, stderr=err, start_new_session=True
        )


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process's group: a driver and the local Ray it started (gcs, raylet, agents).
    Ray's worker processes (the actors) have groups of their own: they exit by themselves within
    seconds of their raylet, after finishing the task at hand."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("classgrad:")]


def wait_for(
    predicate: Callable[[], object],
    timeout_s: float,
    what: str,
    *,
    every_s: float = 0.1,
    alive: subprocess.Popen | None = None,
):
    """Poll ``predicate`` until it returns a true value (returned); fail after ``timeout_s`` (a
    quiet machine's, stretched by ``load_scale``). With ``alive``, also fail as soon as that
    process has exited."""
    timeout_s *= load_scale()
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            out, err = alive.communicate()  # None when its output goes to files
            raise AssertionError(
                f"process ended while waiting for {what}: rc {alive.returncode}\n"
                f"{(out or '')[-2000:]}\n{(err or '')[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def shards_done(url: str, **options) -> int:
    try:
        return int(open_store(url, **options).shard_done.sum())
    except StoreError:
        return 0


def store_arrays(url: str, **options) -> dict[str, np.ndarray]:
    store = open_store(url, **options)
    ids = np.arange(store.num_classes)
    return {"rows": store.rows(ids), "loss": store.loss(ids), "count": store.count(ids)}


def assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name in ("rows", "loss", "count"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def reference_rows(config_path: str | Path, overrides: list[str]) -> torch.Tensor:
    """Rows of the float64 reference engine for the job's model (without its sleep, where it is a
    ``slow_models`` one with ``delay_s``) and data. ``config_path`` is relative to the repository
    root (or absolute)."""
    from classgrad.config import load_config
    from classgrad.workers.actor_runtime.factory import build_model, build_probe
    from classgrad.workers.gradients import per_class_gradients

    config = load_config(REPO / config_path, overrides)
    kwargs = {**config.model.kwargs, **({"delay_s": 0.0} if "delay_s" in config.model.kwargs else {})}
    model = build_model(config.model.factory, kwargs, mode=config.model.mode).double()
    # The whole probe set in one batch: a job's small batch may only exist to slow it down, and
    # the reference loop would pay it once per class (rows do not depend on it).
    probe = build_probe(config.data.factory, config.data.kwargs, batch_size=4096)
    return per_class_gradients(
        model,
        probe,
        num_classes=config.loss.num_classes,
        loss=config.loss.kind,
        params=list(config.params.include),
        engine="reference",
    )


def uninterrupted(config: JobConfig) -> dict[str, np.ndarray]:
    """Run every shard of ``config`` once, in order, in this process (no Ray, no faults)."""
    from classgrad.service.driver_runtime.preparation import prepare_store
    from classgrad.workers.actor_runtime.actor import GradientWorker

    threads = torch.get_num_threads()
    try:
        store = prepare_store(config).store
        worker = GradientWorker(config.model_dump(mode="json"), num_threads=config.cluster.num_cpus_per_worker)
        for shard in range(store.num_shards):
            worker.compute_shard(shard)
    finally:
        torch.set_num_threads(threads)
    return store_arrays(config.store.url, storage_options=config.store.storage_options)


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *, readonly: bool = False) -> Iterator[Path]:
    """A real filesystem of ``size`` (e.g. "200k") mounted at ``path`` for the block; skips the
    test where this machine does not allow mounting (needs root or CAP_SYS_ADMIN). Unmounted
    lazily at the end, so files a killed actor still holds open cannot keep it mounted."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0777" + (",ro" if readonly else "")
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here ({mount.stderr.strip() or mount.returncode})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def trusted_state(url: str, config: JobConfig | None = None) -> str:
    """What a rerun (or a reader) would trust at ``url`` after a failed job, checked:

    - "none": nothing there;
    - "refused": something a reader refuses and a rerun recreates (a store left half-created);
    - "resumable, N done": a store whose N done shards hold the right rows: the job's engine
      run here in float64 on those classes only (the reference engine would evaluate every
      class, bad ones included) within the engine contract (normwise relative error <= 1e-6,
      as in tests/unit/test_engines.py; not bit-identical, because this process's convolutions
      may pick other kernels than an actor's), zero rows exactly where that is zero, and
      exactly the counts.
    Anything else fails the calling test.
    """
    if not os.path.exists(url) or (os.path.isdir(url) and not os.listdir(url)):
        return "none"
    try:
        store = open_store(url)
    except StoreError as exc:
        assert "not fully created" in str(exc), f"a store a rerun cannot handle: {exc}"
        return "refused"
    done = np.flatnonzero(store.shard_done)
    if done.size:
        assert config is not None, "done shards but no config to check them against"
        from classgrad.workers.actor_runtime.factory import build_model, build_probe
        from classgrad.workers.gradients import per_class_gradients
        from tests.support.engine_cases import max_relative_error

        model = build_model(
            config.model.factory, config.model.kwargs, config.model.checkpoint, config.model.mode
        ).double()
        probe = build_probe(config.data.factory, config.data.kwargs, config.data.batch_size)
        ids = np.concatenate([np.arange(*store.shard_range(int(s))) for s in done])
        ref = per_class_gradients(
            model,
            probe,
            num_classes=store.num_classes,
            classes=ids.tolist(),
            loss=config.loss.kind,
            params=list(config.params.include) or None,
            engine=config.engine.kind,
        )
        rows = torch.from_numpy(store.rows(ids))
        zero = (ref == 0).all(dim=1)
        assert bool((rows[zero] == 0).all())
        if not bool(zero.all()):
            assert max_relative_error(rows, ref) <= 1e-6
        counts = torch.bincount(probe.targets.long(), minlength=store.num_classes)[ids]
        np.testing.assert_array_equal(store.count(ids), counts.numpy())
    return f"resumable, {done.size} done"


def ray_processes(*roots: int, marker: str | None = None) -> list:
    """psutil processes of a Ray instance: the given root pids, or every process whose command
    line mentions ``marker`` (a temp dir), together with all their descendants."""
    import psutil

    found: dict[int, psutil.Process] = {}
    tops = [psutil.Process(pid) for pid in roots]
    if marker is not None:
        tops += [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    for top in tops:
        try:
            for p in [top, *top.children(recursive=True)]:
                found[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def listening(processes: list) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket those processes listen on."""
    import psutil

    out = []
    for p in processes:
        try:
            out += [
                (c.laddr.ip, c.laddr.port, p.name())
                for c in p.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            ]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
WILDCARD = ("0.0.0.0", "::")


def job_api_without_token(port: int) -> str:
    """What ``GET http://127.0.0.1:port/api/jobs/`` without a token gets: "refused (401)",
    "metrics" (a Prometheus exporter, which answers any path with its read-only metrics),
    "not http", or "SERVED <status>" (a job API open to anyone)."""
    import http.client
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/jobs/", timeout=5) as response:
            kind = response.headers.get("Content-Type", "")
            return "metrics" if "version=0.0.4" in kind else f"SERVED {response.status}"
    except urllib.error.HTTPError as exc:
        return f"refused ({exc.code})" if exc.code in (401, 403) else f"SERVED {exc.code}"
    except (OSError, ValueError, http.client.HTTPException):  # not HTTP (gRPC, ...), or closed
        return "not http"


@contextlib.contextmanager
def fresh_ray_auth_afterwards() -> Iterator[None]:
    """Leave this process's Ray auth state as a new process would find it: ``ray.init`` sets
    ``RAY_AUTH_MODE`` in ``os.environ`` and caches the token it used, and both outlive
    ``ray.shutdown``; a later test that talks to another cluster, or checks what a client
    without a token gets, would otherwise send the stale token."""
    before = os.environ.get("RAY_AUTH_MODE")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before
        try:  # Ray's own helper for exactly this (it resets the config and the token cache)
            from ray._private.authentication_test_utils import reset_auth_token_state
        except ImportError:
            return
        reset_auth_token_state()

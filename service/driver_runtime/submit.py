"""Ray Jobs submission: run a job file on a Ray cluster, follow it, query it, stop it.

Holds:

- ``JobSubmitError`` / ``JobFailedError``: the one-line errors of this module (the CLI exits 2
  for the first, 3 for a job that ended FAILED or STOPPED);
- ``resolve_address``: the job server URL from ``--address`` or the environment;
- ``find_token``: the Ray auth token a client sends, looked up the way Ray looks it up;
- ``connect``: a ``JobSubmissionClient`` that authenticates, with every failure one line;
- ``Submission`` and ``prepare_submission``: the entrypoint and runtime env for one job file
  (the config is validated here, before anything is uploaded), ``DEFAULT_EXCLUDES``;
- ``submit``, ``job_info``, ``job_logs``, ``follow_logs``, ``stop_job``, ``list_jobs``,
  ``failure_line``: thin wrappers over the SDK that turn its exceptions into ``JobSubmitError``;
- ``is_job_not_found``: whether an SDK error is the job server's "no such job".

How a submitted job runs (see deploy/README.md): the working directory (the project, minus
``DEFAULT_EXCLUDES``, .gitignore'd and .rayignore'd files) is uploaded as the job's
``working_dir``; every process of the job (the entrypoint and all actors, on every node) starts
in its own copy of it, with it first on ``sys.path``. The entrypoint is
``python -m classgrad run CONFIG --set ... --set cluster.address=auto``:

- ``python -m classgrad`` rather than the ``classgrad`` console script, because a console
  script does not put the working directory on ``sys.path``, while ``-m`` puts it first: the
  user's own modules in the working dir (factories, losses) import as they do locally, and
  ``classgrad`` itself comes from the classgrad installed in the image (the repository keeps
  the package's code under ``src/``, ``service/`` and ``workers/``, which are not importable
  as ``classgrad`` without an install). ``python`` is whatever
  the cluster's PATH gives (the image's Python; on a test cluster, the venv's); ``--python``
  changes it.
- ``cluster.address=auto`` because inside a Ray job the driver must join the cluster it runs
  in (Ray sets ``RAY_ADDRESS`` for it); an address in the job file was written for some other
  place. An explicit ``--set cluster.address=...`` still wins.
- ``STOP_ENV`` in the job's env: stopping the job sends the driver SIGINT (handled like Ctrl-C:
  the run is recorded as interrupted and the store's lease released) instead of Ray's default
  SIGTERM, which kills it without a record.

Authentication: Ray 2.60 clusters run with token auth (``RAY_AUTH_MODE=token``). The token is
sent as ``Authorization: Bearer`` and taken from, in Ray's order: ``RAY_AUTH_TOKEN``, the file
named by ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``. It is sent whenever one is found and
``RAY_AUTH_MODE`` is not ``disabled`` (Ray 2.60's own client sends it only when
``RAY_AUTH_MODE=token`` is set in the client's environment too; Ray 2.61 sends it always).
The token is never logged, printed or put into the job's runtime env.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from classgrad.config import load_config
from classgrad.config.redaction import is_secret_key, redact_text
from classgrad.errors import ClassgradError, first_line
from classgrad.store import local_path

if TYPE_CHECKING:  # Ray is imported only when a client is made (``classgrad --help`` stays fast)
    from ray.job_submission import JobDetails, JobSubmissionClient

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Ray's own precedence for the job server address when none is given explicitly.
ADDRESS_ENV_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
# Never uploaded with the working dir (gitignore syntax, relative to it): environments, VCS data,
# caches, build outputs and gradient stores, any of which can be large or private.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    "*.egg-info",
    "build",
    "dist",
    "stores",
    "*.zarr",
    "benchmarks/out",
    ".whl",
    ".gl",
)
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# How Ray stops the job (`classgrad jobs stop`, KubeRay deleting a RayJob): SIGINT, which the
# driver handles like Ctrl-C (cancels its shards, records the run as interrupted, releases the
# store's lease), with time to do so before Ray's SIGKILL. Ray's default is SIGTERM and 3 s,
# which kill the driver without a record. Read by Ray's job supervisor from the job's env.
STOP_ENV: dict[str, str] = {"RAY_JOB_STOP_SIGNAL": "SIGINT", "RAY_JOB_STOP_WAIT_TIME_S": "30"}
_FOLLOW_POLL_S = 1.0
# A quoted library message is cut to this many characters: a job's failure text can be a whole log.
_LINE_MAX = 300


class JobSubmitError(ClassgradError):
    """The job server cannot be reached, refuses us, or does not know the job (one line)."""


class JobFailedError(ClassgradError):
    """A followed job ended FAILED or STOPPED; the message names the job and why."""

    exit_code = 3


# --------------------------------------------------------------------------- address and token


def resolve_address(address: str | None) -> str:
    """The job server URL: ``address``, else ``RAY_API_SERVER_ADDRESS``/``RAY_ADDRESS``, else
    ``http://127.0.0.1:8265``. A bare ``host:port`` gets ``http://``; ``ray://`` stays as is."""
    if not address:
        address = next((os.environ[v] for v in ADDRESS_ENV_VARS if os.environ.get(v)), DEFAULT_ADDRESS)
    address = address.strip().rstrip("/")
    if "://" not in address:
        address = f"http://{address}"
    scheme = address.split("://", 1)[0]
    if scheme not in ("http", "https", "ray"):
        raise JobSubmitError(
            f"--address {address!r}: expected http://HOST:8265 (the Ray dashboard), https://... or ray://HOST:10001"
        )
    return address


def find_token() -> tuple[str | None, str]:
    """(token or None, where it came from) in Ray's order of precedence."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None, "RAY_AUTH_MODE=disabled"
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    path_env = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path_env:
        try:
            token = Path(path_env).expanduser().read_text().strip()
        except OSError as exc:
            raise JobSubmitError(
                f"RAY_AUTH_TOKEN_PATH={path_env}: cannot read the token file ({exc.strerror or exc})"
            ) from None
        if not token:
            raise JobSubmitError(f"RAY_AUTH_TOKEN_PATH={path_env}: the token file is empty")
        return token, "RAY_AUTH_TOKEN_PATH"
    default = Path.home() / ".ray" / "auth_token"
    try:
        token = default.read_text().strip()
    except OSError:
        return None, "none found"
    return (token or None), str(default)


@contextlib.contextmanager
def _hidden_env(names: Sequence[str]) -> Iterator[None]:
    """Hide env vars for a moment: Ray's client lets RAY_ADDRESS override an explicit address,
    which would silently send a job to another cluster than the one the user named."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# --------------------------------------------------------------------------- errors


def is_job_not_found(exc: BaseException) -> bool:
    """Whether ``exc`` is the job server answering that the job asked about does not exist. Ray's
    ``JobSubmissionClient`` turns every HTTP error into a plain ``RuntimeError("Request failed with
    status code 404: Job ... does not exist.")``, keeping neither the response nor its status, so
    the text is the only signal."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (" 404" in text or "does not exist" in text)


@contextlib.contextmanager
def _sdk_errors(address: str, job_id: str | None = None) -> Iterator[None]:
    """Turn the SDK's exceptions (ConnectionError, RuntimeError with an HTTP status inside,
    AuthenticationError, requests errors) into one-line ``JobSubmitError``s."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except JobSubmitError:
        raise
    except AuthenticationError as exc:
        text = str(exc)
        if text.startswith("Authentication failed"):
            why = "it rejected our token (a token from another cluster?)"
        else:
            why = "no auth token was sent"
        raise JobSubmitError(
            f"the Ray cluster at {address} refused the request: {why}; put the cluster's token in "
            f"RAY_AUTH_TOKEN, a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token"
        ) from None
    except (ConnectionError, requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        raise JobSubmitError(
            f"cannot reach the Ray job server at {address} ({first_line(exc, limit=_LINE_MAX)}); "
            f"is the cluster up and the dashboard port reachable?"
        ) from None
    except requests.exceptions.RequestException as exc:
        raise JobSubmitError(f"Ray job server at {address}: {first_line(exc, limit=_LINE_MAX)}") from None
    except RuntimeError as exc:
        if job_id is not None and is_job_not_found(exc):
            raise JobSubmitError(
                f"no job {job_id!r} on the Ray cluster at {address} (see `classgrad jobs list --address {address}`)"
            ) from None
        raise JobSubmitError(f"Ray job server at {address}: {first_line(str(exc), limit=_LINE_MAX)}") from None


# --------------------------------------------------------------------------- client


def connect(address: str | None = None) -> JobSubmissionClient:
    """A job client for ``address`` (see ``resolve_address``) that sends the auth token."""
    url = resolve_address(address)
    from ray.job_submission import JobSubmissionClient

    token, source = find_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    log.debug("job server %s, auth token from %s", url, source)
    hide = ADDRESS_ENV_VARS if address else ()
    with _sdk_errors(url), _hidden_env(hide):
        try:
            return JobSubmissionClient(url, headers=headers)
        except ValueError as exc:  # a malformed URL
            raise JobSubmitError(f"--address {url!r}: {first_line(exc, limit=_LINE_MAX)}") from None


def address_of(client: JobSubmissionClient) -> str:
    return getattr(client, "_address", "the Ray cluster")


# --------------------------------------------------------------------------- submission


@dataclass(frozen=True)
class Submission:
    """What one ``classgrad submit`` sends: the shell entrypoint and the runtime env."""

    entrypoint: str
    runtime_env: dict[str, Any]
    config_path: str  # relative to the working dir, as the entrypoint names it
    metadata: dict[str, str] = field(default_factory=dict)


def _check_store_url(url: str) -> None:
    """Refuse store locations that cannot work on a cluster, before anything is uploaded."""
    if url.startswith("memory://"):
        raise JobSubmitError(
            f"store.url {url!r}: a memory:// store lives in one process; a cluster "
            f"job needs s3://... or a path every node shares"
        )

    path = local_path(url)  # as written, so a relative path is caught before it is made absolute
    if path is None:
        return
    if not os.path.isabs(os.path.expanduser(path)):
        raise JobSubmitError(
            f"store.url {url!r} is a relative path: on a cluster it would land in the job's temporary "
            f"copy of the working dir on each node; use s3://bucket/path or an absolute path on a "
            f"filesystem every node mounts (--set store.url=...)"
        )
    log.warning("store.url %s is a local path: every node of the cluster must mount it at that path", url)


def _check_overrides_hold_no_secret(overrides: Sequence[str]) -> None:
    """Refuse a secret in a ``--set``: it would travel in the job's entrypoint, which the cluster
    shows to everyone who can list its jobs (``classgrad jobs status``, the dashboard)."""

    for item in overrides:
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if "env_vars" in parts[:-1] or any(is_secret_key(p) for p in parts) or redact_text(value) != value:
            raise JobSubmitError(
                f"--set {key.strip()}=...: a secret given with --set would be shown in the job's entrypoint "
                f"on the cluster; put it in the job file (uploaded with the working dir) or the nodes' environment"
            )


def prepare_submission(
    config: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    working_dir: str | os.PathLike = ".",
    excludes: Sequence[str] = (),
    python: str = "python",
    preflight: bool = True,
) -> Submission:
    """Validate the job file with its overrides and build the entrypoint and runtime env
    (``preflight``: False passes ``--no-preflight`` to the job's ``classgrad run``).

    The config must lie inside ``working_dir`` (it travels with it); its store must be usable
    from every node (object storage, or an absolute path on a shared filesystem).
    """

    job = load_config(config, list(overrides))  # every config error surfaces here, locally
    _check_store_url(job.store.url)
    wd = Path(working_dir).expanduser().resolve()
    if not wd.is_dir():
        raise JobSubmitError(f"--working-dir {working_dir}: not a directory")
    cfg = Path(config).expanduser().resolve()
    try:
        rel = cfg.relative_to(wd).as_posix()
    except ValueError:
        raise JobSubmitError(
            f"config {config} is outside the working dir {wd}: it must travel with it "
            f"(move it in, or pass --working-dir)"
        ) from None
    _check_overrides_hold_no_secret(overrides)
    args = [python, "-m", "classgrad", "run", rel, *([] if preflight else ["--no-preflight"])]
    for item in overrides:
        args += ["--set", item]
    if not any(o.split("=", 1)[0].strip() == "cluster.address" for o in overrides):
        args += ["--set", "cluster.address=auto"]
    runtime_env = {
        "working_dir": str(wd),
        "excludes": list(DEFAULT_EXCLUDES) + list(excludes),
        "env_vars": dict(STOP_ENV),
    }
    return Submission(
        entrypoint=shlex.join(args),
        runtime_env=runtime_env,
        config_path=rel,
        metadata={"classgrad_config": rel, "classgrad_fingerprint": job.fingerprint()},
    )


def submit(client: JobSubmissionClient, submission: Submission, *, job_id: str | None = None) -> str:
    """Submit; returns the job id (Ray's submission id)."""
    with _sdk_errors(address_of(client)):
        try:
            return client.submit_job(
                entrypoint=submission.entrypoint,
                runtime_env=submission.runtime_env,
                metadata=submission.metadata,
                submission_id=job_id,
            )
        except ValueError as exc:  # e.g. the packaged working dir is too large
            raise JobSubmitError(f"cannot package the working dir: {first_line(exc, limit=_LINE_MAX)}") from None


# --------------------------------------------------------------------------- queries


def job_info(client: JobSubmissionClient, job_id: str) -> JobDetails:
    with _sdk_errors(address_of(client), job_id):
        return client.get_job_info(job_id)


def job_logs(client: JobSubmissionClient, job_id: str) -> str:
    with _sdk_errors(address_of(client), job_id):
        return client.get_job_logs(job_id)


def list_jobs(client: JobSubmissionClient) -> list[JobDetails]:
    with _sdk_errors(address_of(client)):
        return client.list_jobs()


def stop_job(client: JobSubmissionClient, job_id: str) -> bool:
    """Ask the job to stop; False if it had already ended."""
    with _sdk_errors(address_of(client), job_id):
        return bool(client.stop_job(job_id))


def follow_logs(client: JobSubmissionClient, job_id: str, write: Callable[[str], Any]) -> JobDetails:
    """Stream the job's logs to ``write`` until it ends; return its final details.

    Uses the job server's log websocket; if that drops (proxies often cut websockets), it falls
    back to polling the full log and writing only what is new.
    """
    job_info(client, job_id)  # an unknown id is a clean error, not a websocket failure
    written = 0

    async def tail() -> None:
        nonlocal written
        async for chunk in client.tail_job_logs(job_id):
            write(chunk)
            written += len(chunk)

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - any websocket trouble: fall back to polling
        log.info("log stream of job %s ended (%s); polling instead", job_id, first_line(exc, limit=_LINE_MAX))
    while True:
        info = job_info(client, job_id)
        text = job_logs(client, job_id)
        if len(text) > written:
            write(text[written:])
            written = len(text)
        if str(info.status) in TERMINAL:
            return info
        time.sleep(_FOLLOW_POLL_S)


_CLASSGRAD_ERROR = re.compile(r"^classgrad: (?:internal )?error: .*$", re.MULTILINE)


def failure_line(info: JobDetails, logs: str = "") -> str:
    """One line saying why a job did not succeed: classgrad's own error line from the logs when
    there is one (it names the field, shard or store), else the first line of Ray's message."""
    found = _CLASSGRAD_ERROR.findall(logs or "")
    if found:
        return found[-1].strip()
    return first_line(info.message or "", limit=_LINE_MAX) or f"job {info.status}"

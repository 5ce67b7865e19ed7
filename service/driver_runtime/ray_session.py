"""One way to get a Ray session, shared by the job driver and ``classgrad similarity``.

Holds:
- ``resolve_ray_address``: the address to join and where it came from (the caller's option, or
  ``RAY_ADDRESS`` when the option is unset or ``auto``, as ``ray.init`` itself reads it), or
  None for a new local Ray;
- ``check_reachable``: a one-line ``ClassgradError`` when nothing listens at a GCS ``host:port``
  (``ray.init`` alone would retry for minutes);
- ``ray_session``: a context manager that uses the Ray this process already has, or joins the
  resolved address, or starts a local Ray with the given CPUs and GPUs; it shuts down only a
  session it opened itself.

Ray's token authentication stays on and is left to Ray: ``ray.init`` reads ``RAY_AUTH_MODE`` and
the token from the environment as usual, and nothing here sets or logs them. For a new local
Ray with ``RAY_AUTH_MODE`` unset, Ray turns token auth on and logs, on every run, "Token
authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ...":
that one line is filtered out (``_quiet_token_notice``), since it is what we want and nothing
the user must act on; every other Ray warning, the one about auth being disabled included, stays.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from classgrad.errors import ClassgradError, first_line

log = logging.getLogger(__name__)

ADDRESS_ENV = "RAY_ADDRESS"


def resolve_ray_address(address: str | None, option: str = "address") -> tuple[str | None, str]:
    """(address to join, where it came from), or (None, "") for a new local Ray.

    ``option`` names the setting ``address`` came from (``cluster.address``, ``--address``), for
    error messages. Like ``ray.init``, an unset address or ``auto`` means ``RAY_ADDRESS`` when
    that is set (inside a Ray job, Ray sets it to the cluster the job runs on).
    """
    address = (address or "").strip() or None
    from_env = os.environ.get(ADDRESS_ENV, "").strip()
    if from_env and address in (None, "auto"):
        return from_env, ADDRESS_ENV
    return (address, option) if address else (None, "")


def check_reachable(address: str, source: str, timeout_s: float = 10.0) -> None:
    """Fail in one line when nothing listens at a GCS ``host:port``; ``auto``, ``local`` and URLs
    (``ray://...``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClassgradError(f"cannot reach the Ray cluster at {address} ({source}): {first_line(exc)}") from None


_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TOKEN_NOTICE)


def _quiet_token_notice() -> None:
    """Drop Ray's notice that it enabled token auth for a new local Ray (once per process)."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropTokenNotice) for f in logger.filters):
        logger.addFilter(_DropTokenNotice())


@contextmanager
def ray_session(
    address: str | None = None,
    *,
    option: str = "address",
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> Iterator[ModuleType]:
    """The ``ray`` module with a session open: the one this process already has, or one joined
    at ``address`` (see ``resolve_ray_address``), or a new local Ray with ``num_cpus`` CPUs
    (default: this machine's) and ``num_gpus`` GPUs (default: Ray's detection); ``runtime_env``
    is the session's (the job's) when it opens one. A session opened here is shut down on exit
    (for a joined cluster that only disconnects this process)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    target, source = resolve_ray_address(address, option)
    if target is None:
        cpus = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
        # Ray turns token auth on for a new local Ray (RAY_AUTH_MODE unset) and warns on every run
        # that it did: the warning is dropped, the token auth kept.
        _quiet_token_notice()
        ray.init(
            num_cpus=cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env=runtime_env,
        )
    else:
        check_reachable(target, source)
        log.debug("joining the Ray cluster at %s (%s)", target, source)
        ray.init(address=target, logging_level=logging.WARNING, runtime_env=runtime_env)
    try:
        yield ray
    finally:
        ray.shutdown()

"""The user's own code beside the job file, shipped to every actor on every node.

Holds ``actor_runtime_env`` (the actors' Ray runtime environment: the config's
``cluster.runtime_env``, plus the working directory as Ray's ``working_dir`` when a factory,
loss or collate function of the job was imported from there and nothing else puts it on the
actors' path) and ``actor_config`` (the config as the actors get it: with the working directory
shipped, actors start in their own copy of it, so the store's local path and the checkpoint are
made absolute first).

A module importable as the driver's ``sys.path`` stands (an installed package, or a project run
with ``python -m``/``PYTHONPATH``) is left alone, as before: on a local Ray the actors start in
the driver's directory; a ``classgrad submit`` job already runs in its uploaded working dir.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from classgrad.service.runtime.submit import DEFAULT_EXCLUDES
from classgrad.workers.imports import from_working_dir

log = logging.getLogger(__name__)

__all__ = ["actor_config", "actor_runtime_env", "ships_working_dir"]


def ships_working_dir(runtime_env: dict[str, Any], current_env: dict[str, Any] | None = None) -> bool:
    """Whether the working directory goes to the actors: some module came from it only, and neither
    the config's ``runtime_env`` nor the Ray job this driver runs in already ships code."""
    if not from_working_dir():
        return False
    shipped = ("working_dir", "py_modules")
    return not any(runtime_env.get(k) for k in shipped) and not any((current_env or {}).get(k) for k in shipped)


def actor_runtime_env(runtime_env: dict[str, Any], current_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """The actors' runtime environment (``current_env``: that of the Ray job the driver runs in)."""
    env = dict(runtime_env)
    if ships_working_dir(runtime_env, current_env):
        cwd = os.getcwd()
        log.info(
            "shipping the working directory %s to the actors (module(s) %s live there)",
            cwd,
            ", ".join(sorted(from_working_dir())),
        )
        env["working_dir"] = cwd
        env["excludes"] = list(DEFAULT_EXCLUDES) + list(env.get("excludes", []))
    return env


def _absolute(path: str | None) -> str | None:
    if not path or "://" in path or os.path.isabs(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def actor_config(config: dict[str, Any], ships: bool) -> dict[str, Any]:
    """The config dict the actors get: local paths absolute when they start in a copied directory."""
    if not ships:
        return config
    out = {**config, "store": dict(config["store"]), "model": dict(config["model"])}
    out["store"]["url"] = _absolute(out["store"]["url"])
    out["model"]["checkpoint"] = _absolute(out["model"].get("checkpoint"))
    return out

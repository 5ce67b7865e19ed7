"""The user's own code beside the job file, shipped to every actor on every node.

Holds ``working_dir_env`` (the Ray runtime environment that ships the working directory as
``working_dir``, minus ``submit.DEFAULT_EXCLUDES``, when a factory, loss or collate function of the
job was imported from there only; None otherwise) and ``actor_config`` (the config as the
actors get it: with the working directory shipped, actors start in their own copy of it, so the
store's local path and the checkpoint are made absolute first).

Ray uploads a local directory only at the job level (``ray.init``), so the driver passes this
when it starts or joins Ray itself. A module importable as the driver's ``sys.path`` stands (an
installed package, or a project run with ``python -m`` or ``PYTHONPATH``) is left alone, as
before; a ``classgrad submit`` job already runs in its uploaded working dir.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from classgrad.service.driver_runtime.submit import DEFAULT_EXCLUDES
from classgrad.workers.imports import from_working_dir

log = logging.getLogger(__name__)

__all__ = ["actor_config", "working_dir_env"]


def working_dir_env() -> dict[str, Any] | None:
    """``{"working_dir": cwd, "excludes": [...]}`` when some module of the job came from the working
    directory only (see ``classgrad.workers.imports``); None otherwise."""
    modules = from_working_dir()
    if not modules:
        return None
    cwd = os.getcwd()
    log.info(
        "shipping the working directory %s to the actors (module(s) %s live there)", cwd, ", ".join(sorted(modules))
    )
    return {"working_dir": cwd, "excludes": list(DEFAULT_EXCLUDES)}


def _absolute(path: str | None) -> str | None:
    if not path or "://" in path or os.path.isabs(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def actor_config(config: dict[str, Any], shipped: bool) -> dict[str, Any]:
    """The config dict the actors get: local paths absolute when they start in a copied directory."""
    if not shipped:
        return config
    out = {**config, "store": dict(config["store"]), "model": dict(config["model"])}
    out["store"]["url"] = _absolute(out["store"]["url"])
    out["model"]["checkpoint"] = _absolute(out["model"].get("checkpoint"))
    return out

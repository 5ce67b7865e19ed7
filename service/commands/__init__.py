"""One module per ``classgrad`` subcommand: ``add_arguments(parser)`` and ``main(args) -> int``.

Command modules import nothing heavy at module level, so ``classgrad --help`` stays instant;
the work happens inside ``main``. Shared argument helpers live here.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

import yaml

from classgrad.errors import ConfigError


def add_store_arguments(parser: argparse.ArgumentParser, *, log: bool = False) -> None:
    """The STORE positional and ``--storage-option`` for commands that read a store (``log``: or
    a training log, which the command tells apart)."""
    what = "store location: a path, file://, s3://bucket/path"
    parser.add_argument("store", metavar="STORE", help=what + ("; or a training log (GradLog)" if log else ""))
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for the store (repeatable), e.g. endpoint_url=http://127.0.0.1:9000; "
        "credentials come from the environment (AWS_ACCESS_KEY_ID, ...)",
    )


def storage_options(args: argparse.Namespace) -> dict:
    """``--storage-option`` values as a dict (values parsed as YAML scalars)."""
    options: dict = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            # Not "KEY=VALUE": the CLI's redaction reads that as a secret-looking pair and masks it.
            raise ConfigError(f"--storage-option {item!r}: expected NAME=VALUE")
        options[key] = yaml.safe_load(value) if value else ""
    return options


def given_options(args: argparse.Namespace, *names: str) -> dict:
    """The options among ``names`` that were given on the command line (not None), as keyword
    arguments: the library function's own defaults apply to the rest."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def first_given(args: argparse.Namespace, options: tuple[tuple[str, str], ...]) -> str | None:
    """The flag of the first ``(dest, flag)`` of ``options`` given on the command line (not None):
    what a command names when an option does not apply to what it was given."""
    return next((flag for dest, flag in options if getattr(args, dest) is not None), None)


def refuse_log_only(flag: str, urls: list[str], options: dict, why: str = "") -> NoReturn:
    """Refuse ``flag``, an option for a training log, given stores that are not logs. Each store
    is opened first: a mistyped path gets the reader's own error (no store there), not this one."""
    from classgrad.store import open_store

    for url in urls:
        open_store(url, storage_options=options or None)
    raise ConfigError(f"{flag} is for a training log; {urls[0]} is not one{why}")

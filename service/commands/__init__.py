"""One module per ``classgrad`` subcommand: ``add_arguments(parser)`` and ``main(args) -> int``.

Command modules import nothing heavy at module level, so ``classgrad --help`` stays instant;
the work happens inside ``main``. Shared argument helpers live here.
"""

from __future__ import annotations

import argparse

import yaml

from classgrad.errors import ConfigError


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The STORE positional and ``--storage-option`` for commands that read a store."""
    parser.add_argument("store", metavar="STORE", help="store location: a path, file://, s3://bucket/path")
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
            raise ConfigError(f"--storage-option {item!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value) if value else ""
    return options


def given_options(args: argparse.Namespace, *names: str) -> dict:
    """The options among ``names`` that were given on the command line (not None), as keyword
    arguments: the library function's own defaults apply to the rest."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}

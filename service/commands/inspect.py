"""``classgrad inspect STORE``: shape, layout, completion and gradient-norm summaries."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands import add_store_arguments, storage_options

HELP = "show a store's shape, dtype, parameter layout, completion and gradient norms"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--top", type=int, default=5, metavar="N", help="classes with the largest gradient norms to list (default 5)"
    )
    parser.add_argument(
        "--block-rows", type=int, metavar="N", help="rows read at once (a multiple of the store's row_chunk)"
    )


def main(args: argparse.Namespace) -> int:
    from classgrad.errors import ConfigError
    from classgrad.service.analysis.inspect import format_report, inspect_store
    from classgrad.store import open_store

    if args.top < 0:
        raise ConfigError(f"--top must be >= 0, got {args.top}")
    store = open_store(args.store, storage_options=storage_options(args))
    info = inspect_store(store, top=args.top, block_rows=args.block_rows)
    print(json.dumps(info, indent=2, default=str) if args.json else format_report(info))
    return 0

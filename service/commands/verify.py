"""``classgrad verify STORE [--repair]``: completeness, checksums and shard-record digests, NaN/Inf,
metadata; the exit code says what failed (bit flags, see ``classgrad.service.analysis.verify``);
``--repair`` unmarks the damaged shards so that the next run recomputes them."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands import add_store_arguments, storage_options

HELP = (
    "check a store: completeness, every chunk's checksum, NaN/Inf, metadata; exit code 0 "
    "if sound, else the OR of 4 incomplete, 8 corrupt chunk, 16 NaN/Inf, 32 metadata"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="unmark the done shards whose chunks are damaged, so that the next `classgrad run` recomputes them",
    )


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis.verify import verify_store

    report = verify_store(args.store, storage_options=storage_options(args), repair=args.repair)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return report.code

"""``classgrad estimate CONFIG``: store size, memory per actor, rows/s and wall time with start-up, before a job."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands.run import add_config_arguments, add_preflight_argument

HELP = "estimate a job's store size, memory per actor, rows/s (with actors sharing cores) and wall time with start-up"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--sample-rows",
        type=int,
        default=None,
        metavar="N",
        help="classes to time (default: max(2 x store.row_chunk, 64), spread over all classes)",
    )
    parser.add_argument(
        "--device", default=None, help="measure on this torch device instead of the job's (e.g. cpu on a laptop)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_preflight_argument(parser)


def main(args: argparse.Namespace) -> int:
    from classgrad.config import load_config
    from classgrad.errors import ConfigError
    from classgrad.service.driver_runtime.estimate import estimate_job

    if args.sample_rows is not None and args.sample_rows <= 0:
        raise ConfigError(f"--sample-rows must be > 0, got {args.sample_rows}")
    config = load_config(args.config, args.overrides)
    result = estimate_job(config, sample_rows=args.sample_rows, device=args.device, preflight=not args.no_preflight)
    print(json.dumps(result.to_dict(), indent=2) if args.json else "\n".join(result.lines()))
    return 0

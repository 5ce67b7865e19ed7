"""``classgrad run CONFIG``: compute a job's per-class gradients into its store (resumable)."""

from __future__ import annotations

import argparse

HELP = "compute the per-class gradients of a job into its store (reruns resume)"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="job file (YAML), e.g. configs/demo.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set cluster.num_workers=4 (repeatable)",
    )


def add_preflight_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the resource preflight (each actor's and the driver's memory, the GPU's, the store's "
        "disk space, checked on the driver's node before the store is created): for clusters whose nodes "
        "differ from the driver's",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_preflight_argument(parser)


def main(args: argparse.Namespace) -> int:
    from classgrad.config import load_config
    from classgrad.service.driver_runtime.driver import JobDriver
    from classgrad.service.driver_runtime.stopping import install_stop_handlers, restore_handlers

    # `classgrad jobs stop` (SIGINT), pod deletion and `kill` (SIGTERM): stop as cleanly as on
    # Ctrl-C, so the run is recorded as interrupted and its lease released, also in a driver that
    # inherited SIGINT ignored or blocked (see classgrad.service.driver_runtime.stopping).
    before = install_stop_handlers()
    try:
        config = load_config(args.config, args.overrides)
        summary = JobDriver(config, preflight=not args.no_preflight).run()
    finally:
        restore_handlers(before)
    print("\n".join(summary.lines()))
    print(f"store: {config.store.url}")
    return 0

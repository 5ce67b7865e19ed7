"""``classgrad submit CONFIG --address URL``: run a job file on a Ray cluster as a Ray job.

The working directory travels as the job's ``working_dir``; the job runs
``python -m classgrad run CONFIG --set ... --set cluster.address=auto`` on the head node (see
``classgrad.service.driver_runtime.submit`` for why). Prints the job id on stdout (alone on its line, so scripts can
capture it); with ``--follow`` the job's logs follow and the exit code is the job's: 0 if it
succeeded, 3 if it failed or was stopped.
"""

from __future__ import annotations

import argparse
import sys

from classgrad.service.commands.jobs import add_address_argument, finish_followed, quiet_ray_logging
from classgrad.service.commands.run import add_config_arguments, add_preflight_argument

HELP = "submit a job file to a Ray cluster as a Ray job (prints the job id)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_address_argument(parser)
    add_preflight_argument(parser)  # the job's `classgrad run` on the head node runs the preflight there
    parser.add_argument(
        "--follow", "-f", action="store_true", help="print the job's logs until it ends; exit 3 if it did not succeed"
    )
    parser.add_argument(
        "--working-dir",
        default=".",
        metavar="DIR",
        help="directory uploaded as the job's working_dir; must contain CONFIG (default: the current directory)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="more paths to leave out of the upload (gitignore syntax, repeatable); "
        ".venv, .git, stores, *.zarr, caches and .gitignore'd files are always left out",
    )
    parser.add_argument(
        "--job-id",
        default=None,
        metavar="ID",
        help="the job's id (default: one Ray makes up); must be new on the cluster",
    )
    parser.add_argument(
        "--python",
        default="python",
        metavar="EXE",
        help="the Python the entrypoint runs on the cluster (default: python on its PATH)",
    )


def main(args: argparse.Namespace) -> int:
    from classgrad.service.driver_runtime import submit

    submission = submit.prepare_submission(
        args.config,
        args.overrides,
        working_dir=args.working_dir,
        excludes=args.exclude,
        python=args.python,
        preflight=not args.no_preflight,
    )
    quiet_ray_logging(args)
    client = submit.connect(args.address)
    job_id = submit.submit(client, submission, job_id=args.job_id)
    print(job_id, flush=True)
    address = submit.address_of(client)
    if not args.follow:
        print(
            f"classgrad: submitted; follow with: classgrad jobs logs {job_id} --follow --address {address}",
            file=sys.stderr,
        )
        return 0
    return finish_followed(client, job_id)

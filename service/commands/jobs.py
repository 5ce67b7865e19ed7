"""``classgrad jobs status|logs|stop|list``: look after jobs submitted to a Ray cluster.

Also holds ``add_address_argument``, the ``--address`` option shared with ``classgrad submit``.
Every failure (cluster unreachable, token missing or wrong, unknown job id) is one line and a
non-zero exit code; see ``classgrad.service.driver_runtime.submit`` for how the address and the auth token are found.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from datetime import datetime, timezone

HELP = "status, logs, stop or list of jobs submitted to a Ray cluster (classgrad submit)"


def add_address_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=None,
        metavar="URL",
        help="the cluster's job server (Ray dashboard), e.g. http://HEAD:8265; default: "
        "$RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, or http://127.0.0.1:8265. The auth token comes from "
        "$RAY_AUTH_TOKEN, the file $RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    status = sub.add_parser("status", help="a job's status, entrypoint and times")
    status.add_argument("job_id", metavar="ID", help="job id printed by classgrad submit")
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    logs = sub.add_parser("logs", help="a job's logs (stdout and stderr of its driver)")
    logs.add_argument("job_id", metavar="ID", help="job id printed by classgrad submit")
    logs.add_argument(
        "--follow", "-f", action="store_true", help="keep printing until the job ends; exit 3 if it did not succeed"
    )
    stop = sub.add_parser("stop", help="stop a running job (finished shards stay saved)")
    stop.add_argument("job_id", metavar="ID", help="job id printed by classgrad submit")
    stop.add_argument("--wait", action="store_true", help="wait until the job has stopped")
    sub.add_parser("list", help="every job the cluster knows, newest first")
    for p in (status, logs, stop, sub.choices["list"]):
        add_address_argument(p)
        p.set_defaults(_parser=p)  # an option it does not know is refused with its usage (cli.parse)


def quiet_ray_logging(args: argparse.Namespace) -> None:
    """Keep Ray's client chatter (packaging steps, websocket closes, the notice that .git and
    .venv are not uploaded, which we exclude on purpose) out of the output unless -v."""
    import ray  # noqa: F401 - Ray sets its loggers' levels when imported; ours must come after

    if not getattr(args, "verbose", False):
        logging.getLogger("ray").setLevel(logging.WARNING)
        logging.getLogger("ray._private.runtime_env.working_dir").setLevel(logging.ERROR)


def _time(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="seconds")


def _details(info) -> dict:
    from classgrad.config.redaction import redact

    # A job submitted by other means may carry a credential in its entrypoint or metadata.
    return redact(
        {
            "job_id": info.submission_id or info.job_id,
            "status": str(info.status),
            "message": info.message,
            "entrypoint": info.entrypoint,
            "start": _time(info.start_time),
            "end": _time(info.end_time),
            "metadata": info.metadata or {},
        }
    )


def finish_followed(client, job_id: str) -> int:
    """Follow a job's logs to stdout; 0 if it succeeded, else JobFailedError (exit 3)."""
    from classgrad.service.driver_runtime import submit

    def write(chunk: str) -> None:
        sys.stdout.write(chunk)
        sys.stdout.flush()

    try:
        info = submit.follow_logs(client, job_id, write)
    except KeyboardInterrupt:
        print(
            f"classgrad: stopped following; job {job_id} keeps running "
            f"(classgrad jobs stop {job_id} --address {submit.address_of(client)})",
            file=sys.stderr,
        )
        return 130
    if str(info.status) != "SUCCEEDED":
        line = submit.failure_line(info, submit.job_logs(client, job_id))
        raise submit.JobFailedError(f"job {job_id} {info.status}: {line}")
    print(f"classgrad: job {job_id} SUCCEEDED", file=sys.stderr)
    return 0


def main(args: argparse.Namespace) -> int:
    from classgrad.service.driver_runtime import submit

    quiet_ray_logging(args)
    client = submit.connect(args.address)
    action = args.jobs_command
    if action == "list":
        jobs = sorted(submit.list_jobs(client), key=lambda j: j.start_time or 0, reverse=True)
        for info in jobs:
            d = _details(info)
            print(
                f"{d['job_id']}  {d['status']:<9}  {d['start']}  "
                f"{d['metadata'].get('classgrad_config', d['entrypoint'])}"
            )
        return 0
    job_id = args.job_id
    if action == "status":
        d = _details(submit.job_info(client, job_id))
        if args.json:
            print(json.dumps(d, indent=2))
            return 0
        print(f"job         {d['job_id']}: {d['status']}")
        print(f"message     {d['message']}")
        print(f"entrypoint  {d['entrypoint']}")
        print(f"started     {d['start']}   ended {d['end']}")
        return 0
    if action == "logs":
        if args.follow:
            return finish_followed(client, job_id)
        sys.stdout.write(submit.job_logs(client, job_id))
        return 0
    if action == "stop":
        if not submit.stop_job(client, job_id):
            print(f"job {job_id}: had already ended")
            return 0
        if not args.wait:
            print(
                f"job {job_id}: stop requested (its driver gets SIGINT, and SIGKILL if still running "
                f"{submit.STOP_ENV['RAY_JOB_STOP_WAIT_TIME_S']} s later); "
                f"`classgrad jobs stop {job_id} --wait` waits until it has stopped"
            )
            return 0
        print(stop_outcome(client, job_id))
        return 0
    raise AssertionError(action)


def stop_outcome(client, job_id: str) -> str:
    """Wait until a job asked to stop has ended (Ray marks it STOPPED once every process of its
    driver has exited, on the signal or by SIGKILL), and say which: "stopped" only when the
    driver stopped itself, having recorded the run and released the store's lease."""
    from classgrad.service.driver_runtime import submit
    from classgrad.service.driver_runtime.stopping import INTERRUPTED_LINE

    while (status := str(submit.job_info(client, job_id).status)) not in submit.TERMINAL:
        time.sleep(1.0)
    if status != "STOPPED":
        return f"job {job_id}: ended {status} before it stopped"
    if INTERRUPTED_LINE in submit.job_logs(client, job_id)[-20_000:]:
        return (
            f"job {job_id}: stopped: its driver recorded the run as interrupted and released the store's "
            f"lease; submit the same job again to resume"
        )
    return (
        f"job {job_id}: stopped by force: its driver did not stop on SIGINT within "
        f"{submit.STOP_ENV['RAY_JOB_STOP_WAIT_TIME_S']} s and was killed, so the run is not recorded and the "
        f"store's lease stays until it expires (run.lease_ttl_s); a resubmitted job takes it over then"
    )

"""``classgrad status STORE``: how far a job has got (shards done, missing rows, runs, lease).

The lease is shown with its state: live, expired (no heartbeat within its TTL) or its holder's
process gone (a driver on this host whose pid no longer exists); a rerun takes over the last two.
"""

from __future__ import annotations

import argparse
import json
import time

from classgrad.errors import first_line
from classgrad.service.commands import add_store_arguments, storage_options

HELP = "show a store's progress: shards done, missing rows, last runs"
SHOWN_NOTES = 3  # engine notes in the text; --json has every one the run recorded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def status_of(store) -> dict:
    from classgrad.service.analysis import completion
    from classgrad.store import lease_state

    runs = store.runs
    lease = store.lease.info()
    state, why = lease_state(lease, time.time()) if lease else (None, None)
    return {
        "store": store.url,
        "num_classes": store.num_classes,
        "dim": store.dim,
        "dtype": store.dtype,
        **completion(store),  # shards_done, shards_total, rows_done, complete, missing_ranges
        "last_run": runs[-1] if runs else None,
        # A rerun of a finished store computes nothing: the run that computed rows says how.
        "last_computing_run": next((r for r in reversed(runs) if r.get("rows")), None),
        "runs": len(runs),
        "lease": lease,
        "lease_state": state,  # null (no lease) | live | expired | holder_gone
        "lease_state_detail": why,
        "chunks_checked": False,  # done marks only: `classgrad verify` reads the chunks
    }


def main(args: argparse.Namespace) -> int:
    from classgrad.config.redaction import redact
    from classgrad.store import open_store

    store = open_store(args.store, storage_options=storage_options(args))
    info = redact(status_of(store))  # a run's error recorded by an older classgrad may quote a credential
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    pct = 100.0 * info["rows_done"] / info["num_classes"] if info["num_classes"] else 100.0
    print(f"store     {info['store']}  ({info['num_classes']} x {info['dim']} {info['dtype']})")
    print(
        f"progress  {info['shards_done']}/{info['shards_total']} shards, {info['rows_done']}/"
        f"{info['num_classes']} rows ({pct:.1f}%){'  complete' if info['complete'] else ''}"
    )
    # status reads the done marks only: what it calls complete, verify may still fail.
    print("          (done marks only; `classgrad verify` reads every chunk against its shard's record)")
    if info["missing_ranges"]:
        shown = ", ".join(f"{a}-{b - 1}" for a, b in info["missing_ranges"][:5])
        more = " ..." if len(info["missing_ranges"]) > 5 else ""
        print(f"missing   rows {shown}{more}")
    run, computing = info["last_run"], info["last_computing_run"]
    if run:
        retries = f"{run.get('retries', 0)} retries (of {info['runs']} runs)"
        # Nothing left: every shard was done when it started (a failed run may also have 0 rows).
        nothing_left = bool(run.get("shards_total")) and run.get("shards_skipped") == run.get("shards_total")
        if not nothing_left or computing is None:
            print(f"last run  {run.get('run_id')}: {run.get('status')}, {_timing(run)}, {retries}")
            _print_run_details(run)
        else:  # a rerun with nothing left to compute: the rows' run after it
            print(f"last run  {run.get('run_id')}: {run.get('status')}, nothing left to compute, {retries}")
            if run.get("error"):
                print(f"          error: {first_line(run['error'], limit=400)}")
            print(f"rows by   {computing.get('run_id')}: {computing.get('status')}, {_timing(computing)}")
            _print_run_details(computing)
    if info["lease"]:
        lease = info["lease"]
        print(f"lease     held by run {lease.get('run_id')} on {lease.get('host')} (pid {lease.get('pid')})")
        state = {"live": "live", "expired": "EXPIRED", "holder_gone": "HOLDER GONE"}[info["lease_state"]]
        rerun = "" if info["lease_state"] == "live" else "; a rerun takes it over"
        print(f"          {state}: {info['lease_state_detail']}{rerun}")
    return 0


def _print_run_details(run: dict) -> None:
    notes = run.get("engine_notes") or []
    for note in notes[:SHOWN_NOTES]:
        print(f"          engine: {note}")
    if len(notes) > SHOWN_NOTES:
        print(f"          engine: +{len(notes) - SHOWN_NOTES} more notes (--json)")
    if run.get("error"):  # one line: a record of an older classgrad may hold a whole dump
        print(f"          error: {first_line(run['error'], limit=400)}")


def _timing(run: dict) -> str:
    """The run's rows and times: compute and start-up apart (runs recorded before the split give
    their total alone)."""
    rows = run.get("rows", 0)
    if "compute_s" not in run:
        return f"{rows} rows in {run.get('seconds', 0):.1f} s"
    return (
        f"{rows} rows in {run['compute_s']:.1f} s of compute ({run.get('rows_per_s', 0):.1f} rows/s), "
        f"start-up {run.get('startup_s', 0):.1f} s"
    )

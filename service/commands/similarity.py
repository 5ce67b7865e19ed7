"""``classgrad similarity STORE``: the class similarity matrix and top-k neighbours, on Ray."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands import add_store_arguments, given_options, storage_options

HELP = "compute the C x C class similarity (cosine or dot) and top-k neighbours into the store"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    # Defaults live in SimilarityConfig; None here means "not given" (the help repeats them).
    parser.add_argument(
        "--top-k", type=int, metavar="K", help="neighbours kept per class, self excluded (default 10; 0: none)"
    )
    parser.add_argument(
        "--metric", choices=["cosine", "dot"], help="cosine similarity of rows, or their dot products (default cosine)"
    )
    parser.add_argument(
        "--block-rows",
        type=int,
        metavar="N",
        help="rows per task (a multiple of the store's row_chunk); default: as "
        "many as keep a task's output strip within --block-mb, with >= 2 tasks per CPU",
    )
    parser.add_argument(
        "--band-cols",
        type=int,
        metavar="N",
        help="columns read at once (default: all, unless a block would exceed --block-mb)",
    )
    parser.add_argument(
        "--block-mb",
        type=float,
        metavar="MIB",
        help="memory budget of one row block and of one output strip (default 64)",
    )
    parser.add_argument(
        "--precision", choices=["float32", "float64"], help="arithmetic of the products (default float32)"
    )
    parser.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster to join (default: $RAY_ADDRESS when set, else start a local Ray for this command)",
    )
    parser.add_argument("--num-cpus", type=float, metavar="N", help="CPUs reserved per Ray task (default 1)")
    parser.add_argument(
        "--local", action="store_true", help="run the tasks one after another in this process instead of on Ray"
    )
    parser.add_argument("--json", action="store_true", help="print the run summary as JSON")


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis import fmt_bytes
    from classgrad.service.analysis.similarity import compute_similarity

    summary = compute_similarity(
        args.store,
        storage_options=storage_options(args),
        executor="local" if args.local else "ray",
        **given_options(
            args, "metric", "top_k", "block_rows", "band_cols", "block_mb", "precision", "address", "num_cpus"
        ),
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print(
        f"similarity  {summary['metric']} of {summary['num_classes']} classes x {summary['dim']} "
        f"written to {summary['store']} (top-{summary['top_k']} neighbours per class)"
    )
    print(
        f"tasks       {summary['tasks']} of <= {summary['block_rows']} rows, bands of "
        f"{summary['band_cols']} columns, {summary['executor']}, {summary['seconds']:.1f} s, "
        f"{fmt_bytes(summary['read_bytes'])} read"
    )
    print(
        f"memory      peak per task +{fmt_bytes(summary['peak_task_rss_added_bytes'])} "
        f"(bound {fmt_bytes(summary['memory_bound_bytes'])})"
    )
    return 0

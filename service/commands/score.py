"""``classgrad score STORE [STORE ...] --queries QUERY.yaml``: the classes each query example
leans on: its row in the stores' space scored against every class's row (dot, cosine or TRAK),
top-k per query, optionally every score into a Zarr output; prints a sample with class names."""

from __future__ import annotations

import argparse
import json
from typing import Any

from classgrad.service.commands import given_options, storage_options

HELP = (
    "score query examples against every class's gradient row (dot, cosine or trak): the top-k classes "
    "per query, optionally all Q x C scores into a resumable Zarr output (--out)"
)
SAMPLE_QUERIES = 5
SAMPLE_CLASSES = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "stores",
        metavar="STORE",
        nargs="+",
        help="store location(s); several stores of one job (checkpoints) have their scores summed (--weights)",
    )
    parser.add_argument(
        "--queries",
        required=True,
        metavar="QUERY.yaml",
        help="the query set: a YAML file with a job's 'data' section (factory, kwargs, batch_size, label_field, "
        "collate, pad_values), and optionally 'fn' (loss | margin | module:function) and 'group_field'",
    )
    # Defaults live in ScoreConfig; None here means "not given" (the help repeats them).
    parser.add_argument("--method", choices=["dot", "cosine", "trak"], help="the score (default trak)")
    parser.add_argument("--top-k", type=int, metavar="K", help="classes kept per query, best first (default 10)")
    parser.add_argument(
        "--out",
        metavar="URL",
        help="a Zarr location for the results (top-k, and with --all-scores every score); "
        "a rerun of the same command resumes it",
    )
    parser.add_argument(
        "--all-scores",
        dest="full",
        action="store_const",
        const=True,
        help="also write every query x class score to --out",
    )
    parser.add_argument(
        "--weights", metavar="W,W,...", help="one weight per store (e.g. each checkpoint's learning rate); default 1"
    )
    parser.add_argument("--damping", type=float, metavar="L", help="trak: the absolute lambda")
    parser.add_argument(
        "--damping-fraction",
        type=float,
        metavar="F",
        help="trak: lambda as a fraction of the Gram matrix's mean eigenvalue (default 0.1)",
    )
    parser.add_argument(
        "--fn", metavar="FN", help="the query function: loss (default), margin, or module:function (overrides the file)"
    )
    parser.add_argument("--device", metavar="DEV", help="device of the query rows' model (default: the store's job's)")
    parser.add_argument("--block-rows", type=int, metavar="N", help="queries per task (default: from --task-mb)")
    parser.add_argument("--task-mb", type=float, metavar="MIB", help="memory budget of one task (default 512)")
    parser.add_argument(
        "--precond-mb", type=float, metavar="MIB", help="trak: the largest preconditioner accepted (default 1024)"
    )
    parser.add_argument(
        "--recompute-preconditioner",
        action="store_const",
        const=True,
        help="trak: compute and save the stores' Gram matrices again",
    )
    parser.add_argument(
        "--overwrite", action="store_const", const=True, help="replace an --out made by another request"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--local", action="store_true", help="run the tasks in this process (default: Ray for large work)"
    )
    where.add_argument("--ray", action="store_true", help="run the tasks on Ray whatever the size")
    parser.add_argument(
        "--address", metavar="ADDR", help="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray)"
    )
    parser.add_argument("--num-cpus", type=float, metavar="N", help="CPUs reserved per Ray task (default 1)")
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for the stores and --out (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the run summary as JSON")


def _weights(text: str | None) -> list[float] | None:
    from classgrad.errors import ConfigError

    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise ConfigError(f"--weights {text!r}: expected numbers separated by commas") from None


def sample_lines(result, shown_queries: int = SAMPLE_QUERIES, shown: int = SAMPLE_CLASSES) -> list[str]:
    """The best classes of the first queries: "query I: ID (NAME) score, ..."."""
    n = min(shown_queries, len(result))
    k = int(result.class_ids.shape[1])
    lines = [f"top         {k} classes of each query ({result.method}), first {n} queries:"]
    for q in range(n):
        parts = []
        for r in range(min(shown, k)):
            name = f" ({result.class_names[q][r]})" if result.class_names else ""
            parts.append(f"{int(result.class_ids[q, r])}{name} {float(result.scores[q, r]):.3g}")
        more = f", +{k - shown} more" if k > shown else ""
        lines.append(f"  query {q}: {', '.join(parts)}{more}")
    return lines


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis.score_api import load_query_file, query_data, score
    from classgrad.units import fmt_bytes

    spec = load_query_file(args.queries)
    data, groups = query_data(spec)
    options: dict[str, Any] = given_options(
        args,
        "method",
        "top_k",
        "full",
        "damping",
        "damping_fraction",
        "block_rows",
        "task_mb",
        "precond_mb",
        "recompute_preconditioner",
        "overwrite",
        "address",
        "num_cpus",
    )
    if args.local or args.ray:
        options["executor"] = "local" if args.local else "ray"
    result = score(
        args.stores,
        None,
        data,
        fn=args.fn or spec.fn,
        groups=groups,
        weights=_weights(args.weights),
        out=args.out,
        storage_options=storage_options(args),
        device=args.device,
        batch_size=spec.data.batch_size,
        label_field=spec.data.label_field,
        collate=spec.data.collate,
        pad_values=spec.data.pad_values,
        **options,
    )
    info = result.info
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    form = f", {info['form']} form, lambda {info['damping']}" if info.get("form") else ""
    print(
        f"score       {info['method']}{form} of {info['num_queries']} queries x {info['num_classes']} classes x "
        f"{info['dim']} over {len(info['stores'])} store(s)" + (f", written to {args.out}" if args.out else "")
    )
    skipped = f", {info['blocks_skipped']} done before (resumed)" if info["blocks_skipped"] else ""
    print(
        f"tasks       {info['tasks']} of <= {info['block_rows']} queries{skipped}, class blocks of "
        f"{info['stream_rows']}, {info['executor']}, {info['seconds']:.1f} s; peak per task "
        f"+{fmt_bytes(info['peak_task_rss_added_bytes'])} (bound {fmt_bytes(info['memory_bound_bytes'])})"
    )
    for line in sample_lines(result):
        print(line)
    return 0

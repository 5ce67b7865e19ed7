"""``classgrad similarity STORE``: the class similarity matrix and top-k neighbours, or the
top-k neighbours alone (never C x C) for large C, on Ray; prints a sample of the neighbours.
``classgrad similarity LOG --window W``: the same of one window of a training log, in this
process (``log_similarity``), the matrix into ``--out FILE.npy``."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands import (
    add_store_arguments,
    first_given,
    given_options,
    refuse_log_only,
    storage_options,
)

HELP = (
    "compute each class's top-k most similar classes (cosine or dot) into the store, with the "
    "C x C matrix when it takes at most 1 GiB (or --dense); or those of one window of a training log (--window)"
)
# Options of a job's store that a training log does not take, and those only a log takes (dest, flag).
STORE_ONLY = (("task_mb", "--task-mb"), ("address", "--address"), ("num_cpus", "--num-cpus"))
LOG_ONLY = (("window", "--window"), ("out", "--out"))
# Classes and neighbours per class shown in the printed sample.
SAMPLE_ROWS = 5
SAMPLE_NEIGHBOURS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, log=True)
    # Defaults live in SimilarityConfig; None here means "not given" (the help repeats them).
    parser.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="neighbours kept per class, self excluded (default 10; 0: none, with the matrix only)",
    )
    parser.add_argument(
        "--metric", choices=["cosine", "dot"], help="cosine similarity of rows, or their dot products (default cosine)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--dense",
        action="store_const",
        const=True,
        help="also store the C x C matrix (refused above 16 GiB, about 65,000 classes); "
        "default: only when it takes at most 1 GiB (about 16,000 classes)",
    )
    mode.add_argument(
        "--top-k-only",
        dest="dense",
        action="store_const",
        const=False,
        help="store the top-k table only, never the C x C matrix, whatever C is",
    )
    parser.add_argument(
        "--block-rows",
        type=int,
        metavar="N",
        help="rows per task (a multiple of the store's row_chunk); default: dense, as "
        "many as keep a task's output strip within --block-mb; top-k only, as many as keep "
        "its query block within half of --task-mb; both with >= 2 tasks per CPU",
    )
    parser.add_argument(
        "--band-cols",
        type=int,
        metavar="N",
        help="columns read at once (default: all, unless a block would exceed --block-mb, or, top-k only, --task-mb)",
    )
    parser.add_argument(
        "--block-mb",
        type=float,
        metavar="MIB",
        help="dense: memory budget of one row block and of one output strip (default 64)",
    )
    parser.add_argument(
        "--task-mb",
        type=float,
        metavar="MIB",
        help="top-k only: memory budget of one task (query block, stream block, scores, "
        "running top-k), which sizes its blocks (default 512.0)",
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
    log = parser.add_argument_group("a training log (GradLog) instead of a store: STORE is the log")
    log.add_argument(
        "--window",
        metavar="W",
        help="the window whose rows (each class's row summed over the window's steps) are compared "
        "(default: the last done one); computed in this process, the log is not written",
    )
    log.add_argument(
        "--out",
        metavar="FILE.npy",
        help="write the window's C x C matrix there (a local .npy file, written strip by strip; needs the "
        "matrix: at most 1 GiB, or --dense); default: only the neighbours are printed",
    )


def sample_lines(store, summary: dict, rows: int = SAMPLE_ROWS, shown: int = SAMPLE_NEIGHBOURS) -> list[str]:
    """The nearest classes of the first ``rows`` classes, as stored: "class ID (NAME): ID (NAME)
    value, ..." (names when the store has them), at most ``shown`` neighbours each."""
    k = summary["top_k"]
    if not k:
        return []
    n = min(rows, store.num_classes)
    index, value = store.similarity_neighbours(range(n))
    return neighbour_lines(index, value, store.class_ids, store.class_names, summary, shown)


def neighbour_lines(index, value, ids, names, summary: dict, shown: int = SAMPLE_NEIGHBOURS) -> list[str]:
    """``sample_lines`` of the neighbour table's first rows ``index``/``value``."""
    k, n = summary["top_k"], len(index)
    if not k:
        return []

    def label(row: int) -> str:
        return f"{ids[row]}" + (f" ({names[row]})" if names else "")

    lines = [f"nearest     top-{k} of each class ({summary['metric']}), first {n} classes:"]
    for r in range(n):
        named = [(int(j), v) for j, v in zip(index[r, :shown], value[r, :shown], strict=True) if j >= 0]
        near = ", ".join(f"{label(j)} {v:.3g}" for j, v in named) or "none (no samples in this window)"
        extra = int((index[r, shown:] >= 0).sum())  # a log's row may have fewer than k neighbours
        more = f", +{extra} more" if extra else ""
        lines.append(f"  {label(r)}: {near}{more}")
    return lines


def main_log(args: argparse.Namespace) -> int:
    """``classgrad similarity LOG``: one window's similarity (``log_similarity.window_similarity``)."""
    from classgrad.errors import ConfigError
    from classgrad.service.analysis.log_similarity import window_similarity
    from classgrad.units import fmt_bytes

    flag = first_given(args, STORE_ONLY)
    if flag:
        raise ConfigError(f"{flag} is for a job's store; {args.store} is a training log, compared in this process")
    result = window_similarity(
        args.store,
        args.window,
        out=args.out,
        storage_options=storage_options(args),
        **given_options(args, "metric", "top_k", "dense", "block_rows", "band_cols", "block_mb", "precision"),
    )
    summary = result.summary
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    C, (a, b) = summary["num_classes"], summary["steps"]
    what = (
        f"the {C:,} x {C:,} matrix and the top-{summary['top_k']} neighbours per class"
        if summary["dense"]
        else f"the top-{summary['top_k']} neighbours per class (no {C:,} x {C:,} matrix)"
    )
    where = f", matrix written to {summary['out']}" if summary["out"] else ""
    print(
        f"similarity  {summary['metric']} of {C} classes x {summary['dim']}, window {summary['window']} (steps "
        f"{a}-{b - 1}) of {args.store}: {what}{where}"
    )
    print(
        f"strips      {summary['tasks']} of <= {summary['block_rows']} rows, bands of {summary['band_cols']} columns, "
        f"in this process, {summary['seconds']:.1f} s, {fmt_bytes(summary['read_bytes'])} read"
    )
    if summary["empty_classes"]:
        print(
            f"empty       {summary['empty_classes']:,} classes had no samples in this window: no neighbours, "
            "and no class's neighbour (their rows in the matrix are 0)"
        )
    n = min(SAMPLE_ROWS, C)
    for line in neighbour_lines(result.index[:n], result.value[:n], range(C), None, summary):
        print(line)
    return 0


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis.similarity import compute_similarity
    from classgrad.store import open_store
    from classgrad.store.training_log.log_store import is_log
    from classgrad.units import fmt_bytes

    if is_log(args.store, storage_options=storage_options(args)):
        return main_log(args)
    flag = first_given(args, LOG_ONLY)
    if flag:
        refuse_log_only(flag, [args.store], storage_options(args))
    summary = compute_similarity(
        args.store,
        storage_options=storage_options(args),
        executor="local" if args.local else "ray",
        **given_options(
            args,
            "metric",
            "top_k",
            "dense",
            "block_rows",
            "band_cols",
            "block_mb",
            "task_mb",
            "precision",
            "address",
            "num_cpus",
        ),
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    C = summary["num_classes"]
    what = (
        f"the {C:,} x {C:,} matrix and the top-{summary['top_k']} neighbours per class"
        if summary["dense"]
        else f"the top-{summary['top_k']} neighbours per class (top-k only: no {C:,} x {C:,} matrix)"
    )
    print(f"similarity  {summary['metric']} of {C} classes x {summary['dim']}: {what}, written to {summary['store']}")
    stream = (
        ""
        if summary["dense"]
        else f", streamed {summary['stream_rows']} rows at a time, each row read {summary['passes']} times"
    )
    print(
        f"tasks       {summary['tasks']} of <= {summary['block_rows']} rows{stream}, bands of "
        f"{summary['band_cols']} columns, {summary['executor']}, {summary['seconds']:.1f} s, "
        f"{fmt_bytes(summary['read_bytes'])} read"
    )
    print(
        f"memory      peak per task +{fmt_bytes(summary['peak_task_rss_added_bytes'])} "
        f"(bound {fmt_bytes(summary['memory_bound_bytes'])})"
    )
    for line in sample_lines(open_store(args.store, storage_options=storage_options(args)), summary):
        print(line)
    return 0

"""``classgrad plot STORE --out DIR``: PNGs of the class similarity and the gradient norms; of a
training log (``log_plot``): its class x window norms, the largest classes' norms over training
and the class similarity at chosen windows."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands import add_store_arguments, given_options, refuse_log_only, storage_options

HELP = (
    "write PNGs: similarity heatmap of the top-N classes (clustered), histogram of class "
    "gradient norms, per-parameter norms; of a training log: class x window norms, norms over training, "
    "similarity at --windows"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, log=True)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the PNGs")
    parser.add_argument(
        "--top-n",
        type=int,
        metavar="N",
        help="classes in the heatmap, those with the largest gradient norms (default 40); a training log: "
        "also the rows of its class x window heatmap",
    )
    parser.add_argument(
        "--metric",
        choices=["cosine", "dot"],
        help="heatmap metric when it must be computed (default: the stored one, else cosine)",
    )
    parser.add_argument("--dpi", type=int, help="pixels per inch (default 100)")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.add_argument(
        "--windows",
        metavar="W",
        help="a training log: the windows whose class similarity is drawn, as indices and ranges such as 0-3,7, "
        "all or last (default: last); the norms are drawn for every done window (for these windows when "
        "a window of the log is missing)",
    )


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis.plot import plot_store
    from classgrad.store.training_log.log_store import is_log

    options = given_options(args, "top_n", "metric", "dpi")
    log = is_log(args.store, storage_options=storage_options(args))
    if log:
        from classgrad.service.analysis.log_plot import plot_log

        result = plot_log(args.store, args.out, windows=args.windows, storage_options=storage_options(args), **options)
    elif args.windows is not None:
        refuse_log_only("--windows", [args.store], storage_options(args))
    else:
        result = plot_store(args.store, args.out, storage_options=storage_options(args), **options)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for name, path in result["files"].items():
        w, h = result["sizes"][name]
        print(f"wrote {path} ({w} x {h})")
    if log:
        for w, drawn in result["similarity"].items():
            print(f"window {w}: {len(drawn['heatmap_rows'])} classes, {drawn['metric']} similarity (computed)")
        return 0
    if "similarity_source" in result:
        print(
            f"heatmap: {len(result['heatmap_rows'])} classes, {result['metric']} similarity "
            f"({result['similarity_source']})"
        )
    if "note" in result:
        print(f"note: {result['note']}")
    return 0

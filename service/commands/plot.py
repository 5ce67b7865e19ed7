"""``classgrad plot STORE --out DIR``: PNGs of the class similarity and the gradient norms."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands import add_store_arguments, given_options, storage_options

HELP = (
    "write PNGs: similarity heatmap of the top-N classes (clustered), histogram of class "
    "gradient norms, per-parameter norms"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the PNGs")
    parser.add_argument(
        "--top-n",
        type=int,
        metavar="N",
        help="classes in the heatmap, those with the largest gradient norms (default 40)",
    )
    parser.add_argument(
        "--metric",
        choices=["cosine", "dot"],
        help="heatmap metric when it must be computed (default: the stored one, else cosine)",
    )
    parser.add_argument("--dpi", type=int, help="pixels per inch (default 100)")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis.plot import plot_store

    result = plot_store(
        args.store, args.out, storage_options=storage_options(args), **given_options(args, "top_n", "metric", "dpi")
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for name, path in result["files"].items():
        w, h = result["sizes"][name]
        print(f"wrote {path} ({w} x {h})")
    if "similarity_source" in result:
        print(
            f"heatmap: {len(result['heatmap_rows'])} classes, {result['metric']} similarity "
            f"({result['similarity_source']})"
        )
    if "note" in result:
        print(f"note: {result['note']}")
    return 0

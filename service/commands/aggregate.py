"""``classgrad aggregate STORE --weights mean|FILE --out grad.safetensors``: a weighted
combination of rows, written as a state-dict-shaped gradient."""

from __future__ import annotations

import argparse
import json

from classgrad.service.commands import add_store_arguments, given_options, storage_options

HELP = (
    "combine rows (mean, or per-class weights from a file) into one gradient shaped like the "
    "model's parameters, saved as safetensors or a torch state dict (by the suffix of --out)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument(
        "--weights", metavar="mean|FILE", help="'mean' (default), or a .npy / .txt / .csv file of one weight per row"
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="output file: .safetensors (with the summary as metadata), or .pt/.pth (a torch state dict)",
    )
    parser.add_argument(
        "--clip-norm", type=float, metavar="X", help="scale the result down to L2 norm X if it is larger"
    )
    parser.add_argument(
        "--block-rows", type=int, metavar="N", help="rows read at once (a multiple of the store's row_chunk)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis.aggregate import aggregate

    summary = aggregate(
        args.store,
        args.out,
        storage_options=storage_options(args),
        **given_options(args, "weights", "clip_norm", "block_rows"),
    )
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    clipped = f", clipped to {summary['final_norm']:.6g} (x{summary['scale']:.4g})" if summary["scale"] != 1.0 else ""
    print(
        f"wrote {summary['out']}: {summary['tensors']} tensors, {summary['numbers']:,} numbers, "
        f"weights {summary['weights']} (sum {summary['weights_sum']:.6g}), norm "
        f"{summary['norm']:.6g}{clipped}"
    )
    return 0

"""``classgrad score STORE [STORE ...] --queries QUERY.yaml``: the classes each query example
leans on: its row in the stores' space scored against every class's row (dot, cosine or TRAK),
top-k per query, optionally every score into a Zarr output; prints a sample with class names.
``classgrad score LOG --queries QUERY.yaml --model module:function``: the same from a training
log (``log_score``: TracIn, the log's learning-rate-weighted window sums against the query rows
at the model's one checkpoint)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from classgrad.service.commands import first_given, given_options, refuse_log_only, storage_options

HELP = (
    "score query examples against every class's gradient row (dot, cosine or trak): the top-k classes "
    "per query, optionally all Q x C scores into a resumable Zarr output (--out); or against a training "
    "log's windows (TracIn: --model, --windows)"
)
# Options of a job's store that a training log does not take, and those only a log takes (dest, flag).
STORE_ONLY = (
    ("out", "--out"),
    ("full", "--all-scores"),
    ("weights", "--weights"),
    ("damping", "--damping"),
    ("damping_fraction", "--damping-fraction"),
    ("precond_mb", "--precond-mb"),
    ("recompute_preconditioner", "--recompute-preconditioner"),
    ("overwrite", "--overwrite"),
    ("address", "--address"),
    ("num_cpus", "--num-cpus"),
)
LOG_ONLY = (
    ("windows", "--windows"),
    ("model", "--model"),
    ("model_kwargs", "--model-kwargs"),
    ("checkpoint", "--checkpoint"),
)
SAMPLE_QUERIES = 5
SAMPLE_CLASSES = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "stores",
        metavar="STORE",
        nargs="+",
        help="store location(s); several stores of one job (checkpoints) have their scores summed (--weights); "
        "or one training log (GradLog), scored by TracIn: the sum over --windows of the query rows' dot "
        "products with the windows' learning-rate-weighted class sums (lr_grads), the query rows at --model",
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
    log = parser.add_argument_group("a training log (GradLog) instead of a store")
    log.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="the factory of the logged model (required: a log records the model's class and parameters, not how "
        "to build it); the query rows are taken at its weights (--checkpoint), in eval mode, fp32",
    )
    log.add_argument("--model-kwargs", metavar="YAML", help="keyword arguments of --model, a YAML mapping")
    log.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="weights loaded into --model (.pt/.pth: a state dict, or one under 'model' or 'state_dict'; "
        ".safetensors): the one checkpoint of the query side",
    )
    log.add_argument(
        "--windows",
        metavar="W",
        help="the log's windows summed: all (default), last, or indices and ranges such as 0-3,7 (each done)",
    )


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


def _query_options(args: argparse.Namespace, spec: Any, groups: Any) -> dict[str, Any]:
    """What both scores take of the query file and the command line: the query function, the
    groups, how the query data is read, where and on which device."""
    data = spec.data
    return {
        "fn": args.fn or spec.fn,
        "groups": groups,
        "storage_options": storage_options(args),
        "device": args.device,
        "batch_size": data.batch_size,
        "label_field": data.label_field,
        "collate": data.collate,
        "pad_values": data.pad_values,
    }


def _model_kwargs(text: str | None) -> dict | None:
    from classgrad.errors import ConfigError

    if text is None:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"--model-kwargs {text!r}: expected a YAML mapping such as '{{num_classes: 10}}'")
    return value


def main_log(args: argparse.Namespace) -> int:
    """``classgrad score LOG``: TracIn over the log's windows (``log_score.score_log``)."""
    from classgrad.errors import ConfigError
    from classgrad.service.analysis.log_score import score_log
    from classgrad.service.analysis.score_api import load_query_file, query_data

    if len(args.stores) != 1:
        raise ConfigError(
            f"classgrad score: one training log at a time, got {len(args.stores)} locations "
            "(a log already sums its windows; several checkpoints' stores add up with --weights)"
        )
    flag = first_given(args, STORE_ONLY) or ("--ray" if args.ray else None)
    if flag is None and args.method not in (None, "dot"):
        flag = f"--method {args.method}"
    if flag:
        raise ConfigError(
            f"{flag} is for a job's store; {args.stores[0]} is a training log, scored by TracIn (dot products "
            "summed over windows) in this process"
        )
    if args.model is None:
        raise ConfigError(
            f"{args.stores[0]} is a training log: give --model module:function (a log records the model's class "
            "and parameters, not how to build it) and its --checkpoint"
        )
    spec = load_query_file(args.queries)
    data, groups = query_data(spec)
    result = score_log(
        args.stores[0],
        args.model,
        data,
        windows=args.windows,
        model_kwargs=_model_kwargs(args.model_kwargs),
        checkpoint=args.checkpoint,
        **_query_options(args, spec, groups),
        **given_options(args, "top_k", "block_rows", "task_mb"),
    )
    info = result.info
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    at = f"at {args.checkpoint}" if args.checkpoint else "at the factory's weights"
    print(
        f"score       tracin of {info['num_queries']} queries x {info['num_classes']} classes x {info['dim']}: "
        f"lr-weighted class sums of windows {info['windows_text']} (steps {info['steps'][0]}-"
        f"{info['steps'][1] - 1}), query rows ({info['fn']}) {at}"
    )
    for line in sample_lines(result):
        print(line)
    return 0


def main(args: argparse.Namespace) -> int:
    from classgrad.service.analysis.score_api import load_query_file, query_data, score
    from classgrad.store.training_log.log_store import is_log
    from classgrad.units import fmt_bytes

    if any(is_log(s, storage_options=storage_options(args)) for s in args.stores):
        return main_log(args)
    flag = first_given(args, LOG_ONLY)
    if flag:
        refuse_log_only(flag, args.stores, storage_options(args), " (a store's model is its job's)")
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
        weights=_weights(args.weights),
        out=args.out,
        **_query_options(args, spec, groups),
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

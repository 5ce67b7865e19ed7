"""classgrad's engines next to the usual alternatives, on the same model, probe set, classes and
precision, timed in one run (issue 6).

Sections (each model: ``--models``, default the small CNN and the MLP of ``classgrad.workers.zoo``):

1. **partitioned** (mean cross-entropy per class, ``--classes`` C, ``--spc`` samples per class):
   the seed-style ``.backward(retain_graph=True)`` loop, the ``autograd.grad`` loop, batched
   one-hot VJPs (``is_grads_batched``), ``torch.func.jacrev(chunk_size=...)``, TRAK-style
   per-sample ``vmap(grad)`` summed by label, Opacus-style per-sample hooks summed by label,
   the floor (one forward+backward of the summed loss), and classgrad's partitioned and dense
   engines.
2. **tiny**: many tiny classes (each class keeps a random 1..4 samples), ``--tiny-classes`` C.
3. **dense** (``--dense-losses``, default ``logit``, ``bce`` and ``log_softmax``: every sample
   touches every row) on a probe set of ``--dense-samples`` samples: the loops, batched one-hot
   VJPs, jacrev, the floor (C single-row VJPs) and classgrad's dense engine, once with the
   table's micro-batches and once with one batch of all samples (the graph memory the loops
   use, since they keep every micro-batch's graph). The three losses take the engine's three
   paths: ``logit`` (linear in the outputs) rows from a basis of F VJPs through the model's
   final Linear layer; ``bce`` (each L_c sees output column c only) one VJP per row starting at
   that layer's input; ``log_softmax`` (a user's loss that sees every column) one VJP per row
   through the whole model. Block sizes of per-row VJPs are measured automatically.
4. **scaling**: the seed-style loop against the partitioned engine at C = ``--scaling-classes``.

On a partitioned loss, methods whose cost is C backward passes (the loops, batched VJPs,
jacrev, classgrad's dense engine) are timed on an evenly spaced subset of classes and
extrapolated per row: forward once + C/k x the time of the k rows (the subset size is printed
next to the time). On the dense loss every method computes every row. Every method's rows
are checked against classgrad's with ``allclose`` (subset rows for subset methods).

All methods of a table are timed round-robin, ``--reps`` times after one warm-up; the best time
is the figure (this machine is shared: the best run is the least disturbed), medians are in
the JSON. ``--threads`` (default 1: one thread, as each Ray actor uses) applies to all.

    .venv/bin/python -m benchmarks.alternatives            # C = 256, 8/class, tiny C = 1000, scaling 256..10000
    .venv/bin/python -m benchmarks.alternatives --quick    # smaller: a few minutes on 2 cores

Prints tables and the targets, and writes ``benchmarks/out/alternatives.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import Case, fmt_s, interleaved, make_case, print_table

OUT = common.OUT_DIR / "alternatives.json"
ALTERNATIVES = ("seed_loop", "grad_loop", "batched_onehot", "jacrev", "trak_vmap", "opacus_hooks")


def subset(num_classes: int, k: int) -> list[int]:
    """``k`` evenly spaced class ids (all of them when k >= C)."""
    if k >= num_classes:
        return list(range(num_classes))
    return sorted({round(i * (num_classes - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


def run_table(
    case: Case, methods: dict[str, tuple[Callable, dict, str]], reference: str, reps: int, warmup: bool = True
) -> dict[str, Any]:
    """Time ``methods`` (name -> (callable, holder, note)), check rows against ``reference``."""
    timings = interleaved({n: m[0] for n, m in methods.items()}, reps, case.device, warmup=warmup)
    ref_holder = methods[reference][1]
    ref_rows, ref_classes = common.held_rows(ref_holder), ref_holder["classes"]
    results: dict[str, Any] = {}
    for name, (_, holder, note) in methods.items():
        entry: dict[str, Any] = {
            "seconds": timings[name].best,
            "median_s": timings[name].median,
            "times_s": timings[name].times,
            "note": timings[name].note or note,
        }
        if timings[name].note.startswith("failed"):
            entry["error"] = timings[name].note
            results[name] = entry
            continue
        entry["rows_per_s"] = case.num_classes / entry["seconds"]
        if "rows" in holder or "blocks" in holder:
            ok, err = common.compare(common.held_rows(holder), holder["classes"], ref_rows, ref_classes, case.precision)
            entry["allclose"], entry["max_rel_err"] = ok, err
        if "engine" in holder:
            entry["engine_notes"] = list(holder["engine"].stats.notes)
            entry["block_rows"] = holder["engine"].block_rows
        results[name] = entry
    return results


def add(methods: dict, name: str, maker: Callable, note: str = "") -> None:
    holder: dict = {}
    methods[name] = (maker(holder), holder, note)


def partitioned_methods(
    case: Case,
    args,
    engine_subset: list[int] | None = None,
    with_dense: bool = True,
    alternatives: tuple[str, ...] = ALTERNATIVES,
) -> dict:
    C = case.num_classes
    loop_k = subset(C, args.loop_classes)
    alt_k = subset(C, args.alt_rows)
    m: dict = {}
    if "seed_loop" in alternatives:
        add(m, "seed_loop", lambda h: common.seed_loop(case, loop_k, h), f"{len(loop_k)} of {C} rows, extrapolated")
    if "grad_loop" in alternatives:
        add(m, "grad_loop", lambda h: common.grad_loop(case, loop_k, h), f"{len(loop_k)} of {C} rows, extrapolated")
    if "batched_onehot" in alternatives:
        for chunk in args.chunks:
            add(
                m,
                f"batched_onehot[{chunk}]",
                lambda h, chunk=chunk: common.batched_onehot(case, alt_k, h, chunk),
                f"{len(alt_k)} of {C} rows, extrapolated" if len(alt_k) < C else "",
            )
    if "jacrev" in alternatives:
        for chunk in args.chunks:
            add(
                m,
                f"jacrev[{chunk}]",
                lambda h, chunk=chunk: common.func_jacrev(case, alt_k, h, chunk),
                f"{len(alt_k)} of {C} rows, extrapolated" if len(alt_k) < C else "",
            )
    if "trak_vmap" in alternatives:
        add(m, "trak_vmap", lambda h: common.trak_vmap(case, h))
    if "opacus_hooks" in alternatives:
        add(m, "opacus_hooks", lambda h: common.opacus_hooks(case, h))
    add(m, "floor", lambda h: common.floor_partitioned(case), "writes no rows")
    if case.x.dim() == 4 and args.channels_last:
        # Channels-last inputs make this CNN's convolutions and pooling faster on a CPU; the
        # partitioned engine picks the faster format itself, so the floor and the per-sample
        # alternatives get it too (each method's best is what counts).
        cl = dataclasses.replace(case, x=case.x.contiguous(memory_format=torch.channels_last))
        add(m, "floor[channels_last]", lambda h: common.floor_partitioned(cl), "writes no rows")
        if "trak_vmap" in alternatives:
            add(m, "trak_vmap[channels_last]", lambda h: common.trak_vmap(cl, h))
        if "opacus_hooks" in alternatives:
            add(m, "opacus_hooks[channels_last]", lambda h: common.opacus_hooks(cl, h))
    if with_dense:
        add(
            m,
            "classgrad_dense",
            lambda h: common.classgrad(case, h, "dense", alt_k),
            f"{len(alt_k)} of {C} rows, extrapolated" if len(alt_k) < C else "",
        )
    # Rows of all C classes are kept for the check unless they would take more than 2 GiB.
    keep = None if C * case.dim * 4 <= 2 << 30 else loop_k
    add(
        m,
        "classgrad_partitioned",
        lambda h: common.classgrad(case, h, "partitioned", engine_subset, keep=keep),
        f"{len(engine_subset)} of {C} rows, extrapolated" if engine_subset else "",
    )
    return m


def dense_methods(case: Case, args) -> dict:
    C = case.num_classes
    # Every row, like every other method here: a dense row costs a loop about what it costs the
    # engine, and the best of a few short (extrapolated) runs is biased low against the best of
    # a few long ones (a run of 16 rows swings far more than a run of 256).
    m: dict = {}
    add(m, "seed_loop", lambda h: common.seed_loop(case, range(C), h), "every row")
    add(m, "grad_loop", lambda h: common.grad_loop(case, range(C), h), "every row")
    for chunk in args.chunks + [C]:
        add(m, f"batched_onehot[{chunk}]", lambda h, chunk=chunk: common.batched_onehot(case, range(C), h, chunk))
    for chunk in args.chunks:
        add(m, f"jacrev[{chunk}]", lambda h, chunk=chunk: common.func_jacrev(case, range(C), h, chunk))
    add(m, "floor", lambda h: common.floor_dense(case), "C single-row VJPs (one timed, x C)")
    add(
        m,
        "classgrad_dense",
        lambda h: common.classgrad(case, h, "dense"),
        "rows from a basis through the head" if case.loss.linear_in_outputs else "block size measured automatically",
    )
    # The loops keep the graph of every micro-batch until their last row (L sums them); the
    # engine keeps one micro-batch's graph at a time. Given the loops' memory (one batch of
    # all samples), the engine needs one VJP per row instead of one per micro-batch.
    add(
        m,
        "classgrad_dense[one batch]",
        lambda h: common.classgrad(case, h, "dense", batch_size=case.n),
        "batch_size = all samples: the loops' graph memory",
    )
    return m


def summarise(case: Case, results: dict, engine: str, memcpy_s: float) -> dict[str, Any]:
    t_eng = results[engine]["seconds"]
    alts = {n: r["seconds"] for n, r in results.items() if n.split("[")[0] in ALTERNATIVES}
    best_alt = min(alts, key=alts.get) if alts else None
    floors = {n: r["seconds"] for n, r in results.items() if n.split("[")[0] == "floor"}
    best_floor = min(floors, key=floors.get)
    t_floor = floors[best_floor]
    out = {
        "engine": engine,
        "engine_s": t_eng,
        "floor": best_floor,
        "floor_s": t_floor,
        "engine_over_floor": t_eng / t_floor,
        "engine_over_floor_as_given": t_eng / floors["floor"],
        "memcpy_s": memcpy_s,
        "memcpy_over_floor": memcpy_s / t_floor,
        "engine_over_floor_plus_memcpy": t_eng / (t_floor + memcpy_s),
    }
    if best_alt:
        out.update(
            best_alternative=best_alt,
            best_alternative_s=alts[best_alt],
            speedup_vs_best_alternative=alts[best_alt] / t_eng,
        )
    if "seed_loop" in results:
        out["speedup_vs_seed_loop"] = results["seed_loop"]["seconds"] / t_eng
    return out


def floor_detail(summ: dict) -> str:
    text = (
        f"best floor: {summ['floor']}; memcpy of the output = {summ['memcpy_over_floor']:.2f}x floor; "
        f"engine/(floor+memcpy) = {summ['engine_over_floor_plus_memcpy']:.2f}"
    )
    if summ["floor"] != "floor":
        text += f"; vs the floor as given (NCHW) {summ['engine_over_floor_as_given']:.2f}"
    return text


def show(title: str, case: Case, results: dict, engine: str, summary: dict) -> None:
    t_eng = results[engine]["seconds"]
    print(f"\n== {title}: {case.name}, D = {case.dim:,}, {case.n:,} samples, {case.precision}, loss {case.loss.name}")
    table = []
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["seconds"]):
        check = "-" if "allclose" not in r else ("ok" if r["allclose"] else "DIFFERS") + f" ({r['max_rel_err']:.1e})"
        table.append(
            [name, fmt_s(r["seconds"]), f"{r['rows_per_s']:,.0f}", f"{r['seconds'] / t_eng:.2f}x", check, r["note"]]
        )
    print_table(["method", "time (best)", "rows/s", f"vs {engine}", "allclose", "note"], table)
    print(
        f"memcpy of the C x D float32 output ({case.num_classes * case.dim * 4 / 2**20:,.0f} MiB): "
        f"{fmt_s(summary['memcpy_s'])} = {summary['memcpy_over_floor']:.2f}x the floor; "
        f"{engine} / (floor + memcpy) = {summary['engine_over_floor_plus_memcpy']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and 2 repetitions")
    parser.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp")
    parser.add_argument("--classes", type=int, help="C for the partitioned and dense tables (default 256)")
    parser.add_argument("--spc", type=int, help="samples per class (default 8)")
    parser.add_argument("--tiny-classes", type=int, help="C of the tiny-classes table (default 1000, quick 512)")
    parser.add_argument("--tiny-max", type=int, default=4, help="tiny classes keep 1..this many samples")
    parser.add_argument("--dense-samples", type=int, help="probe samples of the dense table (default 512, quick 256)")
    parser.add_argument(
        "--dense-losses",
        default="logit,bce,log_softmax",
        help="comma-separated dense losses, one table each: logit (a basis through the head), "
        "bce (per-row VJPs from the head's input), log_softmax (per-row VJPs through the "
        "whole model)",
    )
    parser.add_argument(
        "--scaling-classes", help="C values of the loop-vs-engine table (default 256,1000,10000; quick 256,1000)"
    )
    parser.add_argument("--scaling-spc", type=int, default=2, help="samples per class in the scaling table")
    parser.add_argument(
        "--engine-rows",
        type=int,
        default=None,
        help="scaling table: the engine computes at most this many rows (extrapolated); default all (quick 1024)",
    )
    parser.add_argument("--loop-classes", type=int, help="rows the loops are timed on (default 16, quick 8)")
    parser.add_argument(
        "--alt-rows", type=int, help="rows of batched VJPs/jacrev on partitioned losses (default 64, quick 32)"
    )
    parser.add_argument("--chunks", default="16,64", help="chunk sizes for batched VJPs and jacrev")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--image-size", type=int, default=16, help="CNN input size (zoo default 16)")
    parser.add_argument("--width", type=int, default=8, help="CNN width (zoo default 8)")
    parser.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    parser.add_argument("--sections", default="partitioned,tiny,dense,scaling")
    parser.add_argument(
        "--no-channels-last",
        dest="channels_last",
        action="store_false",
        help="CNN: do not also time the floor and per-sample alternatives on channels-last inputs",
    )
    parser.add_argument("--reps", type=int, help="timed repetitions after a warm-up (default 3, quick 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every method")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--clock",
        default="auto",
        choices=["auto", "cpu", "wall"],
        help="auto: process CPU time with one CPU thread (stable on a shared machine), wall time otherwise",
    )
    parser.add_argument("--out", default=str(OUT), help="JSON output path")
    args = parser.parse_args()
    q = args.quick
    C = args.classes or 256
    spc = args.spc or 8
    tiny_C = args.tiny_classes or (512 if q else 1000)
    dense_n = args.dense_samples or (256 if q else 512)
    scaling = [int(s) for s in (args.scaling_classes or ("256,1000" if q else "256,1000,10000")).split(",")]
    engine_rows = args.engine_rows if args.engine_rows is not None else (1024 if q else 0)
    args.loop_classes = args.loop_classes or (8 if q else 16)
    args.alt_rows = args.alt_rows or (32 if q else 64)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    reps = args.reps or (2 if q else 3)
    models = args.models.split(",")
    sections = set(args.sections.split(","))
    torch.set_num_threads(args.threads)
    clock = common.set_clock(args.clock, args.device, args.threads)
    print(f"clock: {clock} time; {args.threads} torch thread(s); best of {reps} after a warm-up")
    kw = dict(
        precision=args.precision, device=args.device, image_size=args.image_size, width=args.width, hidden=args.hidden
    )

    report: dict[str, Any] = {
        "machine": common.machine_info(),
        "args": vars(args) | {"reps": reps},
        "clock": clock,
        "sections": {},
        "targets": [],
    }
    targets = report["targets"]

    def target(name: str, value: float, goal: str, met: bool, detail: str = "") -> None:
        targets.append({"name": name, "value": value, "goal": goal, "met": met, "detail": detail})

    def save() -> None:  # after every table, so a long run that dies keeps what it measured
        common.write_report(args.out, report)

    def table(section: str, model: str, title: str, case: Case, methods: dict, engine: str) -> tuple[dict, dict]:
        """Time and check one table's methods, summarise against ``engine``, print, record."""
        res = run_table(case, methods, engine, reps)
        methods.clear()  # drop the rows they hold before the memcpy is timed
        summ = summarise(case, res, engine, common.memcpy_seconds(case.num_classes, case.dim, args.device))
        show(title, case, res, engine, summ)
        report["sections"].setdefault(section, {})[model] = {
            "case": case.name,
            "dim": case.dim,
            "results": res,
            "summary": summ,
        }
        return res, summ

    for model in models:
        if "partitioned" in sections:
            case = make_case(model, C, spc, **kw)
            _, summ = table(
                "partitioned", model, "partitioned loss", case, partitioned_methods(case, args), "classgrad_partitioned"
            )
            target(
                f"{model}: partitioned >= 2x the fastest alternative ({summ['best_alternative']})",
                summ["speedup_vs_best_alternative"],
                ">= 2",
                summ["speedup_vs_best_alternative"] >= 2,
            )
            target(
                f"{model}: partitioned within 1.3x of the floor",
                summ["engine_over_floor"],
                "<= 1.3",
                summ["engine_over_floor"] <= 1.3,
                floor_detail(summ),
            )
            if C == 256:
                target(
                    f"{model}: partitioned >= 100x the seed-style loop at C=256",
                    summ["speedup_vs_seed_loop"],
                    ">= 100",
                    summ["speedup_vs_seed_loop"] >= 100,
                    "loop extrapolated per row",
                )
            del case
            save()
        if "tiny" in sections:
            case = make_case(model, tiny_C, args.tiny_max, tiny=True, **kw)
            methods = partitioned_methods(
                case, args, with_dense=False, alternatives=("seed_loop", "trak_vmap", "opacus_hooks")
            )
            _, summ = table(
                "tiny", model, f"tiny classes (1..{args.tiny_max} samples)", case, methods, "classgrad_partitioned"
            )
            target(
                f"{model}: tiny classes within 1.3x of the floor",
                summ["engine_over_floor"],
                "<= 1.3",
                summ["engine_over_floor"] <= 1.3,
                floor_detail(summ),
            )
            del case
            save()
        for dense_loss in args.dense_losses.split(",") if "dense" in sections else []:
            dense_C = args.classes or (128 if q else 256)
            case = make_case(
                model, dense_C, max(spc, -(-dense_n // dense_C)), loss=dense_loss, max_samples=dense_n, **kw
            )
            section = "dense" if dense_loss == "logit" else f"dense_{dense_loss}"
            res, summ = table(
                section, model, f"dense loss ({dense_loss})", case, dense_methods(case, args), "classgrad_dense"
            )
            how = "; ".join(n for n in res["classgrad_dense"].get("engine_notes", []) if n.startswith("dense:"))
            target(
                f"{model}: dense ({dense_loss}) at least as fast as the fastest alternative "
                f"({summ['best_alternative']})",
                summ["speedup_vs_best_alternative"],
                ">= 1",
                summ["speedup_vs_best_alternative"] >= 1,
                f"block size: {res['classgrad_dense'].get('block_rows')}; {how}",
            )
            same = summ["best_alternative_s"] / res["classgrad_dense[one batch]"]["seconds"]
            target(
                f"{model}: dense ({dense_loss}) with the loops' graph memory (one batch) vs {summ['best_alternative']}",
                same,
                ">= 1",
                same >= 1,
                f"block size: {res['classgrad_dense[one batch]'].get('block_rows')}",
            )
            del case
            save()
        if "scaling" in sections:
            rows_out = []
            for sc in scaling:
                case = make_case(model, sc, args.scaling_spc, **kw)
                sub = subset(sc, engine_rows) if engine_rows and engine_rows < sc else None
                loop_args = argparse.Namespace(
                    **{**vars(args), "loop_classes": min(args.loop_classes, 8 if sc > 1000 else 16)}
                )
                methods = partitioned_methods(
                    case, loop_args, engine_subset=sub, with_dense=False, alternatives=("seed_loop",)
                )
                big = sc > 1000  # one run, no warm-up: minutes each, and one-off costs are negligible there
                res = run_table(case, methods, "classgrad_partitioned", 1 if big else reps, warmup=not big)
                t_loop, t_eng, t_floor = (res[k]["seconds"] for k in ("seed_loop", "classgrad_partitioned", "floor"))
                memcpy_s = common.memcpy_seconds(len(sub) if sub else sc, case.dim, args.device, reps=2) * (
                    sc / len(sub) if sub else 1
                )
                entry = {
                    "classes": sc,
                    "dim": case.dim,
                    "samples": case.n,
                    "seed_loop_s": t_loop,
                    "engine_s": t_eng,
                    "floor_s": t_floor,
                    "memcpy_s": memcpy_s,
                    "speedup_vs_seed_loop": t_loop / t_eng,
                    "engine_over_floor": t_eng / t_floor,
                    "allclose": res["seed_loop"].get("allclose"),
                    "loop_note": res["seed_loop"]["note"],
                    "engine_note": res["classgrad_partitioned"]["note"],
                }
                rows_out.append(entry)
                if sc == 256 and "partitioned" not in sections:
                    target(
                        f"{model}: partitioned >= 100x the seed-style loop at C=256",
                        entry["speedup_vs_seed_loop"],
                        ">= 100",
                        entry["speedup_vs_seed_loop"] >= 100,
                        "loop extrapolated per row",
                    )
                del case
            print(f"\n== seed-style loop vs partitioned engine, {model}, {args.scaling_spc} samples/class")
            print_table(
                ["C", "D", "seed loop", "engine", "floor", "memcpy", "loop/engine", "engine/floor", "allclose", "note"],
                [
                    [
                        f"{e['classes']:,}",
                        f"{e['dim']:,}",
                        fmt_s(e["seed_loop_s"]),
                        fmt_s(e["engine_s"]),
                        fmt_s(e["floor_s"]),
                        fmt_s(e["memcpy_s"]),
                        f"{e['speedup_vs_seed_loop']:,.0f}x",
                        f"{e['engine_over_floor']:.2f}",
                        "ok" if e["allclose"] else "DIFFERS",
                        e["loop_note"] + ("; engine " + e["engine_note"] if e["engine_note"] else ""),
                    ]
                    for e in rows_out
                ],
            )
            report["sections"].setdefault("scaling", {})[model] = rows_out
            save()

    common.print_targets(targets)
    bad = [
        n
        for s in report["sections"].values()
        for m in s.values()
        if isinstance(m, dict)
        for n, r in m["results"].items()
        if r.get("allclose") is False
    ]
    if bad:
        print(f"\nrows that differ from classgrad's: {bad}")
    save()


if __name__ == "__main__":
    main()

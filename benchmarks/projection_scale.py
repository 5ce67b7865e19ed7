"""Compact rows at the class counts users bring (issue 24): every projection structure, cold.

For each model and class count, each setting runs in a fresh process (what a user's first call
sees: the engine's one-off choices, hashes and allocations included), through the public
``per_class_gradients(model, samples, num_classes=C, projection=...)``:

- ``floor``: one forward+backward of the summed loss over the probe set (micro-batches of
  ``--batch-size``) plus one fill of a C x k float32 buffer (the stored rows), best of 2;
- ``cold`` / ``warm``: the first call of the process and a second identical one, over the floor
  (timed after them, so that nothing runs on the model before the first call); with ``--repeat
  N``, N floors and N warm calls alternate after the first call and the best of each is taken
  (on a VM whose load moves within a run, one floor against one call says little);
- ``cold/2nd``: the first call over the second identical one (the issue's measure); with
  ``--processes N`` the median and range over N fresh processes (one first call is one sample);
  ``GC apart``: the same with the garbage collector's seconds in each call taken out of it
  (``common.GcClock``: a full collection of a process that imported transformers, 100-170 ms,
  lands on whichever call crosses its threshold), said beside, never instead;
- ``peak``: the process's peak RSS growth during the first call (``ru_maxrss``);
- quality on ``--quality-classes`` classes (the first ones): pairwise cosine error of the
  projected rows against the exact rows (median, p99) and recall@10 of each class's 10 nearest
  neighbours, beside the same figures for a CountSketch (s = 4) of the exact rows and, where
  C x D x k is small enough (``--dense-limit``), a dense Rademacher projection of them.

Models: ``hf_resnet`` (``ResNetForImageClassification``, hidden sizes 16-32-64-256, head 256 x C,
32 px) and ``bag_text`` (``EmbeddingBag`` 2,000 x 128 mean, Linear 256 + LayerNorm, head 256 x C),
2 samples per class; the seven models of ``benchmarks.real_model_cases`` (1-4 per class); and
``torch_encoder`` (torch's own ``nn.TransformerEncoder``, 2 layers of hidden 128 on 16 tokens, 1-4
per class: its attention is ``nn.MultiheadAttention``, not Linear layers); ``wide_mlp`` (MLP
512-1,024-1,024-C, 2 per class: wide layers at few classes, D = 1.7M at C = 128).
Settings: ``default`` (``{"dim": k}``: tensorsketch), ``kronecker``, ``kronecker_lr``
(``low_rank: kronecker``), ``sketch``, ``dense`` (only where small enough) and ``full``
(unprojected: the real models, ``torch_encoder`` and ``wide_mlp``).

    .venv/bin/python -m benchmarks.projection_scale --models hf_resnet,bag_text --classes 2000,10000
    .venv/bin/python -m benchmarks.projection_scale --models real --classes 1000
    .venv/bin/python -m benchmarks.projection_scale --models real --classes 1000 --settings default \
        --quality-classes 0 --processes 5   # first call / second call: median of 5 fresh processes
    .venv/bin/python -m benchmarks.projection_scale --models ln_mlp,bert --classes 1000 \
        --settings default --width 256   # wider layers (hidden 64 by default), same k
    .venv/bin/python -m benchmarks.projection_scale --models wide_mlp --classes 128 --settings default,full \
        --quality-classes 100 --repeat 3 --processes 5   # wide layers, few classes
    .venv/bin/python -m benchmarks.projection_scale --quick          # C = 200, two models
    .venv/bin/python -m benchmarks.projection_scale --job --classes 10000   # classgrad run, 2 actors
    .venv/bin/python -m benchmarks.projection_scale --models hf_resnet,bag_text --classes 10000 \
        --settings default --repeat 3   # floors and warm calls alternated: best of 3 each
    .venv/bin/python -m benchmarks.projection_scale --models hf_resnet --classes 10000 \
        --settings default --quality-classes 0 --profile 25   # the cold call's costliest functions

Targets (issue 24, 2-core CPU): the default at most 1.5x its floor at C = 10,000 (goal 1.2x), its
ratio at 10,000 at most 1.25x that at 2,000, cosine errors within 1.25x (median) / 1.5x (p99) of
the CountSketch's; on the real models at C = 1,000: at most 1.3x the floor, never slower than
``full``, errors within 1.25x / 1.5x of dense Rademacher's (CountSketch's where dense is
skipped), recall@10 within 0.03; cold at most 1.2x warm. Prints ratios, asserts nothing.
Writes ``benchmarks/out/projection_scale.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

from benchmarks import common

OUT = common.OUT_DIR / "projection_scale.json"
SCALE_MODELS = ("hf_resnet", "bag_text")
WIDE_MLP = "wide_mlp"  # MLP 512-1024-1024-C, 2 samples per class
TORCH_ENCODER = "torch_encoder"  # torch's own nn.TransformerEncoder (attention: nn.MultiheadAttention)
REAL = ("bert", "gpt2", "lstm", "ln_mlp", "resnet", "vit", "llama")
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "kronecker": {"structure": "kronecker"},
    "kronecker_lr": {"structure": "kronecker", "low_rank": "kronecker"},
    "sketch": {"structure": "sketch"},
    "dense": {"structure": "dense"},
}


class BagText(nn.Module):
    """Bag of tokens: ``EmbeddingBag`` (mean) -> Linear 256 + LayerNorm -> head."""

    def __init__(self, num_classes: int, vocab: int = 2000, width: int = 128):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, width, mode="mean")
        self.body = nn.Sequential(nn.Linear(width, 256), nn.LayerNorm(256), nn.ReLU())
        self.head = nn.Linear(256, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.bag(tokens)))


def build(name: str, classes: int, width: int | None = None) -> tuple[nn.Module, Any, torch.Tensor]:
    """``(model, samples, labels)`` with seeded weights and data (``width``: a real model's
    hidden size, ``real_model_cases.WIDTH`` when None)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name in REAL:
        from benchmarks.real_model_cases import WIDTH, build_case
        from benchmarks.real_models import Samples

        case = build_case(name, classes, width=width or WIDTH)
        return case.model, Samples(case.samples), case.labels
    if name == TORCH_ENCODER:  # 2 layers, 4 heads, hidden 128 (or width), 1-4 samples per class
        from classgrad.workers.zoo import tiny_transformer

        labels = torch.repeat_interleave(torch.arange(classes), torch.randint(1, 5, (classes,), generator=g))
        model = tiny_transformer(classes, vocab=512, dim=width or 128, heads=4, layers=2, max_len=16).eval()
        return model, (torch.randint(0, 512, (len(labels), 16), generator=g), labels), labels
    labels = torch.arange(classes).repeat_interleave(2)
    if name == WIDE_MLP:  # few classes, wide layers: D = 1.7M at C = 128 (issue 57)
        model = nn.Sequential(
            nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, classes)
        ).eval()
        return model, (torch.randn(len(labels), 512, generator=g), labels), labels
    if name == "bag_text":
        return BagText(classes).eval(), (torch.randint(0, 2000, (len(labels), 16), generator=g), labels), labels
    return resnet_model(classes), resnet_data(classes), labels


def resnet_model(num_classes: int) -> nn.Module:
    """The ``hf_resnet`` case's model, as a job's ``model.factory`` (seeded weights)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 256],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=num_classes,
    )
    return tf.ResNetForImageClassification(config).eval()


def resnet_data(num_classes: int) -> list[dict[str, torch.Tensor]]:
    """The ``hf_resnet`` case's samples (2 per class), as a job's ``data.factory``: each factory
    builds only its own part (the job's driver and every actor call both)."""
    labels = torch.arange(num_classes).repeat_interleave(2)
    images = torch.randn(len(labels), 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return [{"pixel_values": images[i], "labels": labels[i]} for i in range(len(labels))]


def job(spec: dict[str, Any]) -> dict[str, Any]:
    """``classgrad run`` of the ``hf_resnet`` case with 2 actors, beside the engine alone (the
    same ``per_class_gradients`` call) and the floor, in this process."""
    import tempfile

    from classgrad import per_class_gradients
    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.driver import JobDriver

    torch.set_num_threads(spec["threads"])
    classes, dim = spec["classes"], spec["dim"]
    model, samples, _ = build("hf_resnet", classes)
    floor = _floor(model, samples, classes, dim, spec["batch_size"])
    t0 = time.perf_counter()
    per_class_gradients(model, samples, num_classes=classes, batch_size=spec["batch_size"], projection={"dim": dim})
    engine = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        config = JobConfig.model_validate(
            {
                "model": {"factory": "benchmarks.projection_scale:resnet_model", "kwargs": {"num_classes": classes}},
                "data": {
                    "factory": "benchmarks.projection_scale:resnet_data",
                    "kwargs": {"num_classes": classes},
                    "batch_size": spec["batch_size"],
                },
                "loss": {"num_classes": classes},
                "projection": {"dim": dim},
                "sharding": {"shard_rows": 512},
                "store": {"url": f"{tmp}/store.zarr", "row_chunk": 64},
                "cluster": {"num_workers": 2, "num_cpus_per_worker": 1},
                "run": {"progress": "log", "log_every_s": 30.0},
            }
        )
        t0 = time.perf_counter()
        JobDriver(config).run()
        wall = time.perf_counter() - t0
    return {**spec, "floor_s": floor, "engine_s": engine, "job_s": wall}


def _floor(
    model: nn.Module, samples: Any, classes: int, dim: int, batch_size: int, device: str | torch.device = "cpu"
) -> float:
    """One forward and backward of the summed loss over the samples, plus writing C x dim rows on
    the host: best of 2, on ``device`` (the model is moved there, as the engine under test had it)."""
    from classgrad.workers.gradients import build_engine

    eng = build_engine(model, samples, num_classes=classes, batch_size=batch_size, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    best = float("inf")
    for _ in range(2):
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        t0 = time.perf_counter()
        for start in range(0, len(eng.probe), batch_size):
            idx = torch.arange(start, min(len(eng.probe), start + batch_size))
            x, y = eng.probe.batch(idx, eng.device, eng.compute_dtype)
            with eng.precision.float32_arithmetic(eng.device):  # as the engine computes: no TF32 in fp32
                loss = eng.loss.batch_losses(eng.io(x), eng.loss.labels(y), eng.norm).sum()
                torch.autograd.grad(loss, params, allow_unused=True)
        torch.empty(classes, dim).fill_(1.0)  # writing the stored rows
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        best = min(best, time.perf_counter() - t0)
    return best


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(spec: dict[str, Any]) -> dict[str, Any]:
    """One (model, C, setting) in this process: floor, cold and warm call, quality."""
    from classgrad import per_class_gradients

    torch.set_num_threads(spec["threads"])
    name, classes, dim, setting = spec["model"], spec["classes"], spec["dim"], spec["setting"]
    model, samples, _ = build(name, classes, spec.get("width"))
    projection = None if setting == "full" else {"dim": dim, **SETTINGS[setting]}
    kw = {"num_classes": classes, "batch_size": spec["batch_size"], "projection": projection, "progress": False}
    rss0 = _rss_mib()
    profiler = cProfile.Profile() if spec.get("profile") else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    with common.GcClock() as cold_gc:
        rows = per_class_gradients(model, samples, **kw)
    if profiler is not None:
        profiler.disable()
    cold = time.perf_counter() - t0
    peak = _rss_mib() - rss0
    t0 = time.perf_counter()
    with common.GcClock() as warm_gc:
        per_class_gradients(model, samples, **kw)
    warm = time.perf_counter() - t0
    # After the calls: the cold call is the process's first work on the model, as a user's is
    # (after the floor's two passes its time had moved by up to 1.1 s at HF ResNet C = 10,000).
    # With --repeat, floors and warm calls alternate, the best of each kept: a VM whose load
    # moves within the run then moves both alike.
    floors, warms, repeat = [], [warm], spec.get("repeat", 1)
    for r in range(repeat):
        floors.append(_floor(model, samples, classes, dim, spec["batch_size"]))
        if r + 1 < repeat:
            t0 = time.perf_counter()
            per_class_gradients(model, samples, **kw)
            warms.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        **spec, "floor_s": min(floors), "cold_s": cold, "warm_s": min(warms), "peak_rss_mib": peak,
        "floor_runs": floors, "warm_runs": warms, "gc_s": [cold_gc.seconds, warm_gc.seconds],
        "gc_full": [cold_gc.full, warm_gc.full],
    }  # fmt: skip
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(spec.get("profile_sort", "tottime")).print_stats(spec["profile"])
        out["profile"] = text.getvalue()
    q = min(spec["quality_classes"], classes)
    if q >= 12 and projection is not None:
        exact = per_class_gradients(model, samples, classes=list(range(q)), **{**kw, "projection": None})
        out["quality"] = quality(rows[:q], exact, dim, spec["dense_limit"])
    return out


def _cosines(rows: torch.Tensor) -> torch.Tensor:
    r = rows.double()
    r = r / r.norm(dim=1, keepdim=True).clamp(min=1e-300)
    return r @ r.t()


def _errors(projected: torch.Tensor, exact_cos: torch.Tensor) -> dict[str, float]:
    cos = _cosines(projected)
    n = cos.shape[0]
    mask = ~torch.eye(n, dtype=torch.bool)
    err = (cos - exact_cos)[mask].abs()
    k = min(10, n - 1)
    true_nn = exact_cos.masked_fill(~mask, -2).topk(k, dim=1).indices
    got_nn = cos.masked_fill(~mask, -2).topk(k, dim=1).indices
    recall = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(true_nn, got_nn)) / (n * k)
    return {"median": float(err.median()), "p99": float(err.quantile(0.99)), "recall10": recall}


def quality(projected: torch.Tensor, exact: torch.Tensor, dim: int, dense_limit: float) -> dict[str, Any]:
    """Cosine errors and recall@10 of ``projected`` and of two projections of ``exact``."""
    from classgrad.workers.projection import Projector, SparseSignSketch

    exact_cos = _cosines(exact)
    out = {"classgrad": _errors(projected, exact_cos)}
    # Another seed than the jobs' (0): an independent map of the same kind.
    out["countsketch"] = _errors(SparseSignSketch(exact.shape[1], dim, nonzeros=4, seed=99).project(exact), exact_cos)
    if exact.shape[0] * exact.shape[1] * dim <= dense_limit:
        out["dense"] = _errors(Projector(exact.shape[1], dim, seed=99).project(exact), exact_cos)
    return out


def run_one(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.projection_scale", "--one", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"over {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {**spec, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(lines[-1])


def _fmt(r: dict[str, Any]) -> list[Any]:
    if "error" in r:
        return [r["model"], r["classes"], r["setting"], r["error"], "", "", "", "", "", "", "", ""]
    q = r.get("quality", {})
    mine, cs, dense = q.get("classgrad", {}), q.get("countsketch", {}), q.get("dense", {})

    def e(d: dict) -> str:
        return f"{d['median']:.4f}/{d['p99']:.4f}/{d['recall10']:.2f}" if d else "-"

    name = r["model"] if r.get("width") is None else f"{r['model']} w{r['width']}"
    return [
        name, r["classes"], r["setting"],
        f"{r['cold_s'] / r['floor_s']:.2f}x", f"{r['warm_s'] / r['floor_s']:.2f}x",
        f"{r['cold_s'] / r['warm_s']:.2f}", _second(r.get("cold_second", [])),
        _second(r.get("cold_second_gc", [])), f"{r['peak_rss_mib']:.0f}",
        e(mine), e(cs), e(dense),
    ]  # fmt: skip


def _second(ratios: list[float]) -> str:
    """Cold over the second call: the median of the processes, with their range."""
    if len(ratios) < 2:
        return f"{ratios[0]:.2f}" if ratios else "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="hf_resnet,bag_text", help="comma list; 'real' = the seven real models")
    ap.add_argument("--classes", default="2000,10000")
    ap.add_argument("--settings", default="default,kronecker,kronecker_lr,sketch,dense,full")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quality-classes", type=int, default=150)
    ap.add_argument("--dense-limit", type=float, default=2e11, help="largest q x D x k for the dense baseline")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per setting")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="floors and warm calls alternated N times after the first call (best of each)",
    )
    ap.add_argument("--processes", type=int, default=1, help="fresh processes per setting for cold/2nd (median, range)")
    ap.add_argument("--width", type=int, help="hidden size of the real models (default: real_model_cases.WIDTH)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--job", action="store_true", help="one classgrad run of hf_resnet (2 actors), last --classes")
    ap.add_argument(
        "--profile", type=int, default=0, help="print the cold call's N costliest functions (cProfile: slows that call)"
    )
    ap.add_argument("--profile-sort", default="tottime", choices=("tottime", "cumulative"), help="order of --profile")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    if args.job:
        spec = {"classes": int(args.classes.split(",")[-1]), "dim": args.dim, "threads": args.threads}
        r = job({**spec, "batch_size": args.batch_size})
        common.print_table(
            ["C", "floor", "engine alone", "job (2 actors)", "job / engine", "job / floor"],
            [[r["classes"], common.fmt_s(r["floor_s"]), common.fmt_s(r["engine_s"]), common.fmt_s(r["job_s"]),
              f"{r['job_s'] / r['engine_s']:.2f}x", f"{r['job_s'] / r['floor_s']:.2f}x"]],
        )  # fmt: skip
        common.write_report(common.OUT_DIR / "projection_scale_job.json", r)
        return
    if args.quick:
        args.classes, args.settings, args.dim = "200", "default,kronecker_lr,sketch", 512
    models = [m for part in args.models.split(",") for m in (REAL if part == "real" else (part,))]
    results = []
    for name in models:
        for classes in map(int, args.classes.split(",")):
            for setting in args.settings.split(","):
                if setting == "full" and name not in (*REAL, TORCH_ENCODER, WIDE_MLP):
                    continue  # full rows of a 10k-class head do not fit: the reason for this benchmark
                if setting == "dense" and classes * 3e6 * args.dim > 4e14:
                    continue  # C x D x k: hours
                spec = {
                    "model": name, "classes": classes, "setting": setting, "dim": args.dim, "threads": args.threads,
                    "batch_size": args.batch_size, "quality_classes": args.quality_classes,
                    "dense_limit": args.dense_limit, "profile": args.profile, "profile_sort": args.profile_sort,
                    "repeat": args.repeat, "width": args.width,
                }  # fmt: skip
                r = run_one(spec, args.timeout)
                more = [run_one({**spec, "quality_classes": 0}, args.timeout) for _ in range(args.processes - 1)]
                if "error" not in r:  # the measure: a first call against the second identical one
                    done = [x for x in [r, *more] if "error" not in x]
                    r["cold_second"] = [x["cold_s"] / x["warm_runs"][0] for x in done]
                    # The same without the garbage collector's time in either call (GcClock).
                    r["cold_second_gc"] = [
                        (x["cold_s"] - x["gc_s"][0]) / (x["warm_runs"][0] - x["gc_s"][1]) for x in done
                    ]
                results.append(r)
                common.print_table(HEADERS, [_fmt(r)])
                if r.get("profile"):
                    print(r.pop("profile"))
    print("\n== all")
    common.print_table(HEADERS, [_fmt(r) for r in results])
    common.write_report(OUT, {"machine": common.machine_info(), "args": vars(args), "results": results})


HEADERS = [
    "model", "C", "setting", "cold/floor", "warm/floor", "cold/warm", "cold/2nd", "cold/2nd, GC apart", "peak MiB",
    "err med/p99/recall", "countsketch", "dense",
]  # fmt: skip


if __name__ == "__main__":
    main()

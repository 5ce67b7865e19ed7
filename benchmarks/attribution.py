"""Does ``classgrad score`` attribute anything? A synthetic 100-class image task with planted
confusable class pairs, a small CNN trained here, and three checks per method (dot, cosine, trak).

The task. Each class has a random 3 x 8 x 8 prototype; a sample is its class's prototype plus
unit Gaussian noise. ``--pairs`` pairs of classes (0, 1), (2, 3), ... are planted confusable: the
second prototype is the first plus a small perturbation. ``small_cnn`` (width 8, about 6,800
parameters) is trained with Adam on ``--per-class`` samples per class; its per-class gradient
rows (mean cross-entropy over each class's training samples) are stored by a classgrad job run
in this process (full rows, and with ``--dim`` a projected store too); held-out queries
(``--queries-per-class`` per class) are scored with ``classgrad.score`` (every class ranked).

The checks, per method:

- ``own first``: of the correctly classified queries, how many rank their own class first;
- ``pair partner``: for the queries of planted-pair classes, how often the class of largest score
  in magnitude other than their own is the planted partner (chance: 1 / 99), and the partner's
  mean sign (a confusable class is an opponent: its row pushes the query's own logit down);
- ``LDS`` (class-level linear datamodeling score): ``--subsets`` random halves of the classes are
  kept and the model retrained from the same initialisation on their samples only; for each
  query, the Spearman correlation over the subsets between the predicted change of its loss
  (the sum of its scores over the removed classes: removing a class whose gradient aligns with
  the query's raises the query's loss) and the measured loss; averaged over queries. ``LDS own
  kept``: the same over only the subsets that keep the query's own class (what the other classes'
  scores explain).

    .venv/bin/python -m benchmarks.attribution            # 100 classes, 50 retrained subsets
    .venv/bin/python -m benchmarks.attribution --quick    # 20 classes, 8 subsets (a smoke run)

Prints a table and writes ``benchmarks/out/attribution.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from classgrad.workers.zoo import small_cnn

OUT = Path(__file__).resolve().parent / "out" / "attribution.json"
METHODS = ("dot", "cosine", "trak")


def make_task(num_classes: int, pairs: int, per_class: int, seed: int = 0, *, split: str = "train"):
    """(images [N, 3, 8, 8], labels [N]) of the synthetic task; ``split`` picks other noise."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(num_classes, 3, 8, 8, generator=g)
    for i in range(pairs):  # planted confusable pairs: (2i, 2i + 1)
        protos[2 * i + 1] = protos[2 * i] + 0.25 * torch.randn(3, 8, 8, generator=g)
    noise = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
    y = torch.arange(num_classes).repeat_interleave(per_class)
    x = protos[y] + torch.randn(len(y), 3, 8, 8, generator=noise)
    return x, y


def train_set(num_classes: int = 100, pairs: int = 10, per_class: int = 16, seed: int = 0):
    """The job's data factory: the training samples (the probe set of the per-class rows)."""
    return make_task(num_classes, pairs, per_class, seed)


def cnn(num_classes: int = 100) -> torch.nn.Module:
    return small_cnn(num_classes=num_classes, width=8, seed=0)


def train(x, y, num_classes: int, epochs: int, seed: int = 0) -> torch.nn.Module:
    """``cnn`` trained from its fixed initialisation (Adam, batches of 64, a fixed order per seed),
    on one thread (the model is tiny: more threads only add overhead on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(x, y, num_classes, epochs, seed)
    finally:
        torch.set_num_threads(threads)


def _train(x, y, num_classes: int, epochs: int, seed: int) -> torch.nn.Module:
    model = cnn(num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def query_losses(model, x, y) -> np.ndarray:
    with torch.no_grad():
        return F.cross_entropy(model(x), y, reduction="none").numpy()


def make_store(workdir: Path, model, args, projection: dict | None) -> str:
    """Per-class rows of ``model`` on the training set, stored by a classgrad job run here."""
    from safetensors.torch import save_file

    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.preparation import prepare_store
    from classgrad.workers.actor_runtime.actor import GradientWorker

    checkpoint = workdir / "model.safetensors"
    save_file(model.state_dict(), str(checkpoint))
    name = "full" if projection is None else f"dim{projection['dim']}"
    C = args.classes
    config = JobConfig.model_validate(
        {
            "model": {
                "factory": "benchmarks.attribution:cnn",
                "kwargs": {"num_classes": C},
                "checkpoint": str(checkpoint),
            },
            "data": {
                "factory": "benchmarks.attribution:train_set",
                "kwargs": {"num_classes": C, "pairs": args.pairs, "per_class": args.per_class},
            },
            "loss": {"num_classes": C},
            "sharding": {"shard_rows": 32},
            "store": {"url": str(workdir / f"{name}.zarr"), "row_chunk": 16},
            **({"projection": projection} if projection else {}),
        }
    )
    prepared = prepare_store(config)
    worker = GradientWorker(config.model_dump(mode="json"))
    for shard in prepared.shards:
        worker.compute_shard(shard.index)
    return config.store.url


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else 0.0


def full_scores(result, C: int) -> np.ndarray:
    """The Q x C score matrix from a top-C result (every class ranked)."""
    out = np.empty((len(result), C))
    np.put_along_axis(out, result.rows.numpy(), result.scores.double().numpy(), axis=1)
    return out


def evaluate(S: np.ndarray, yq: np.ndarray, correct: np.ndarray, pairs: int, kept: np.ndarray, measured: np.ndarray):
    own_first = float((S.argmax(axis=1) == yq)[correct].mean())
    # A confusable class is the strongest *opponent* of a query (its rows push the query's own
    # logit down): the partner is looked for as the largest score in magnitude besides its own.
    others = np.abs(S)
    others[np.arange(len(yq)), yq] = -np.inf
    partner = yq ^ 1  # (2i, 2i + 1)
    in_pair = yq < 2 * pairs
    top = others.argmax(axis=1)
    pair_rate = float((top == partner)[in_pair].mean()) if in_pair.any() else float("nan")
    partner_sign = float(np.sign(S[np.arange(len(yq)), partner])[in_pair].mean()) if in_pair.any() else float("nan")
    # predicted change of each query's loss for each subset: its scores summed over the removed classes
    predicted = S @ (~kept).T.astype(np.float64)  # [Q, subsets]
    lds = float(np.mean([spearman(predicted[q], measured[:, q]) for q in range(len(yq))]))
    # The same over only the subsets that keep the query's own class: what the other classes explain.
    own_kept = [
        spearman(predicted[q, kept[:, yq[q]]], measured[kept[:, yq[q]], q])
        for q in range(len(yq))
        if kept[:, yq[q]].sum() >= 5
    ]
    lds_kept = float(np.mean(own_kept)) if own_kept else float("nan")
    return {
        "own_first": own_first,
        "pair_partner": pair_rate,
        "partner_sign": partner_sign,
        "lds": lds,
        "lds_own_kept": lds_kept,
    }


def main(argv: list[str] | None = None) -> int:
    import classgrad

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 classes, 3 pairs, 8 subsets")
    parser.add_argument("--classes", type=int, help="C (default 100)")
    parser.add_argument("--pairs", type=int, help="planted confusable pairs (default 10)")
    parser.add_argument("--per-class", type=int, default=16, help="training samples per class")
    parser.add_argument("--queries-per-class", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--subsets", type=int, help="retrained subsets for the LDS (default 50)")
    parser.add_argument("--dim", type=int, default=256, help="also a store projected to this dim (0: none)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.classes = args.classes or (20 if args.quick else 100)
    args.pairs = args.pairs if args.pairs is not None else (3 if args.quick else 10)
    subsets = args.subsets or (8 if args.quick else 50)
    C = args.classes
    t0 = time.perf_counter()
    x, y = train_set(C, args.pairs, args.per_class)
    xq, yq = make_task(C, args.pairs, args.queries_per_class, split="test")
    model = train(x, y, C, args.epochs)
    with torch.no_grad():
        correct = (model(xq).argmax(dim=1) == yq).numpy()
    t_train = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    kept = np.zeros((subsets, C), dtype=bool)
    measured = np.empty((subsets, len(yq)))
    t1 = time.perf_counter()
    for s in range(subsets):
        kept[s, rng.permutation(C)[: C // 2]] = True
        mask = torch.from_numpy(kept[s])[y]
        measured[s] = query_losses(train(x[mask], y[mask], C, args.epochs), xq, yq)
    t_retrain = time.perf_counter() - t1
    workdir = Path(tempfile.mkdtemp(prefix="classgrad-bench-attr-"))
    report: dict = {
        "classes": C,
        "pairs": args.pairs,
        "per_class": args.per_class,
        "queries": len(yq),
        "accuracy": float(correct.mean()),
        "subsets": subsets,
        "train_s": t_train,
        "retrain_s": t_retrain,
        "stores": {},
    }
    try:
        stores = {"full": make_store(workdir, model, args, None)}
        if args.dim:
            stores[f"dim {args.dim}"] = make_store(workdir, model, args, {"dim": args.dim})
        for name, url in stores.items():
            for method in METHODS:
                t = time.perf_counter()
                result = classgrad.score(url, model, (xq, yq), method=method, top_k=C, executor="local")
                S = full_scores(result, C)
                row = evaluate(S, yq.numpy(), correct, args.pairs, kept, measured)
                row["seconds"] = time.perf_counter() - t
                row["form"] = result.info.get("form")
                report["stores"].setdefault(name, {})[method] = row
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"attribution: {C} classes ({args.pairs} planted pairs), {args.per_class} training samples per class, "
        f"{len(yq)} queries, accuracy {report['accuracy']:.3f}; LDS over {subsets} retrained halves "
        f"(train {t_train:.1f} s, retrain {t_retrain:.1f} s)"
    )
    header = f"{'store':<10} {'method':<7} {'own first':>9} {'pair partner':>12} {'partner sign':>12} {'LDS':>7}"
    print(header + f" {'LDS own kept':>12}")
    for name, rows in report["stores"].items():
        for method, r in rows.items():
            print(
                f"{name:<10} {method:<7} {r['own_first']:>9.3f} {r['pair_partner']:>12.3f} "
                f"{r['partner_sign']:>12.2f} {r['lds']:>7.3f} {r['lds_own_kept']:>12.3f}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

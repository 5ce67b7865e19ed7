"""How well each projection keeps the geometry of per-class gradients, at equal stored width (issue 18).

For each model (a Hugging Face ViT (hidden 96, 4 layers), a BERT (hidden 128, 2 layers), a
ResNet-18 on 16x16 images with its second stage (two blocks, 128 channels) and the head
selected), at random
initialisation and after ``--steps`` Adam steps on a synthetic training set (so gradients are not
isotropic), and for classes of 1 to 4 samples and of 50 samples, the exact rows (the partitioned
engine, float32) are compared with rows projected to ``k`` columns by:

- ``kronecker``: ``projection.structure: kronecker`` (the engine's own rows, split by measured
  gradient norm; the parameters outside the Kronecker layers projected densely);
- ``kronecker + sketch rest``: the same with ``rest: sketch`` (the rest by a sparse sign sketch
  with ``--sketch-nonzeros`` nonzeros per parameter, default the config's 4);
- ``sketch s=N`` (``--sketch``): the whole row by a sparse sign sketch with N nonzeros per
  parameter (what the sketch alone does to the geometry, against dense Rademacher);
- ``dense rademacher`` / ``dense gaussian``: one ``Projector`` over the whole row;
- ``dense per-param``: ``projection.per_param`` with ``k // P`` columns per parameter (P selected
  parameters, so its width is at most ``k``);
- ``kronecker 4k`` (``--wider``): kronecker at 4 times the width, not an equal-width comparison:
  what spending its cheaper columns buys back.

Reported: median and 99th percentile of the absolute error of pairwise cosines and of pairwise
inner products (divided by the product of the two rows' norms, so models and classes compare),
and recall@10 (mean share of each class's 10 nearest classes by cosine that the projected rows
find). One seed per method; every parameter of the ViT and the BERT is selected (LayerNorm and
embeddings join the dense rest of a kronecker projection), for every method alike.

    .venv/bin/python -m benchmarks.projection_quality            # C = 48, k = 512, 100 steps
    .venv/bin/python -m benchmarks.projection_quality --quick    # C = 32, k = 256, 40 steps
    .venv/bin/python -m benchmarks.projection_quality --nonzeros-sweep 6   # s of the sketch, 6 seeds

``--nonzeros-sweep N`` (the choice of ``sketch_nonzeros``): whole rows of the 1-4 regime
projected by dense Rademacher and by the sketch with each s of ``--sketch`` (default 1 2 4 8),
N seeds each, cosine errors pooled over seeds: median, p99, p99.9 and max (the tail that heavy
coordinates, such as a head's bias, put on a sketch with few nonzeros).

Prints a table and writes ``benchmarks/out/projection_quality.json``.
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks import common
from benchmarks.common import print_table
from benchmarks.hf_models import bert, vit
from classgrad.workers.model_io import logits_of

OUT = common.OUT_DIR / "projection_quality.json"


def models(num_classes: int) -> dict[str, tuple[nn.Module, dict[str, Any], list[str]]]:
    """name -> (model, synthetic_probe kwargs, selected parameter names)."""
    from classgrad.workers.zoo import resnet18

    out = {
        "vit": (vit(num_classes, hidden=96, layers=4, heads=3, intermediate=384), {"input_shape": (3, 32, 32)}, None),
        "bert": (bert(num_classes), {"kind": "tokens", "seq_len": 16}, None),
        "resnet18 stage2+fc": (
            resnet18(num_classes),
            {"input_shape": (3, 16, 16)},
            ["layers.2.*", "layers.3.*", "fc.*"],
        ),
    }
    result = {}
    for name, (model, data, include) in out.items():
        names = [n for n, _ in model.named_parameters()]
        if include is None:
            chosen = names
        else:
            chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in include)]
        result[name] = (model, data, chosen)
    return result


def train(model: nn.Module, data: dict[str, Any], num_classes: int, steps: int) -> None:
    """``steps`` Adam steps (lr 1e-3, batch 32) on a synthetic set of another seed; eval mode after."""
    from classgrad.workers.zoo import synthetic_probe

    x, y = synthetic_probe(num_classes, 32, seed=11, **data)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(y), (32,), generator=g)
        loss = nn.functional.cross_entropy(logits_of(model(x[idx])), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def metrics(exact: np.ndarray, proj: np.ndarray, top: int = 10) -> dict[str, float]:
    e, p = exact.astype(np.float64), proj.astype(np.float64)
    ne, np_ = np.linalg.norm(e, axis=1), np.linalg.norm(p, axis=1)
    keep = (ne > 0) & (np_ > 0)
    e, p, ne, np_ = e[keep], p[keep], ne[keep], np_[keep]
    ip_e, ip_p = e @ e.T, p @ p.T
    outer = np.outer(ne, ne)
    cos_e, cos_p = ip_e / outer, ip_p / np.outer(np_, np_)
    iu = np.triu_indices(len(e), 1)
    cos_err = np.abs(cos_p - cos_e)[iu]
    ip_err = (np.abs(ip_p - ip_e) / outer)[iu]
    n = len(e)
    np.fill_diagonal(cos_e, -np.inf)
    np.fill_diagonal(cos_p, -np.inf)
    t = min(top, n - 1)
    near_e = np.argsort(-cos_e, axis=1)[:, :t]
    near_p = np.argsort(-cos_p, axis=1)[:, :t]
    recall = np.mean([len(set(a) & set(b)) / t for a, b in zip(near_e, near_p)])
    return {
        "cos_median": float(np.median(cos_err)),
        "cos_p99": float(np.quantile(cos_err, 0.99)),
        "ip_median": float(np.median(ip_err)),
        "ip_p99": float(np.quantile(ip_err, 0.99)),
        f"recall@{t}": float(recall),
    }


def compare(
    model: nn.Module,
    data: tuple,
    chosen: list[str],
    classes: int,
    k: int,
    wider: tuple[int, ...] = (),
    sketch: tuple[int, ...] = (),
    sketch_nonzeros: int = 4,
) -> dict[str, dict]:
    from classgrad.workers.gradients import per_class_gradients
    from classgrad.workers.projection import Projector
    from classgrad.workers.projection.sketch.row_sketch import SparseSignSketch

    t0 = time.perf_counter()
    exact = per_class_gradients(model, data, num_classes=classes, params=chosen)
    t_exact = time.perf_counter() - t0
    D = exact.shape[1]
    out: dict[str, dict] = {}
    t0 = time.perf_counter()
    kron = per_class_gradients(
        model, data, num_classes=classes, params=chosen, projection={"structure": "kronecker", "dim": k, "seed": 0}
    )
    out["kronecker"] = {**metrics(exact.numpy(), kron.numpy()), "width": k, "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    proj = {"structure": "kronecker", "dim": k, "seed": 0, "rest": "sketch", "sketch_nonzeros": sketch_nonzeros}
    rows = per_class_gradients(model, data, num_classes=classes, params=chosen, projection=proj)
    out["kronecker + sketch rest"] = {**metrics(exact.numpy(), rows.numpy()), "width": k}
    out["kronecker + sketch rest"]["seconds"] = time.perf_counter() - t0
    for times in wider:  # not equal width: what a wider Kronecker projection buys back
        t0 = time.perf_counter()
        proj = {"structure": "kronecker", "dim": times * k, "seed": 0}
        rows = per_class_gradients(model, data, num_classes=classes, params=chosen, projection=proj)
        out[f"kronecker {times}k"] = {**metrics(exact.numpy(), rows.numpy()), "width": times * k}
        out[f"kronecker {times}k"]["seconds"] = time.perf_counter() - t0
    named = dict(model.named_parameters())
    sizes = [named[n].numel() for n in chosen]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    per = max(1, k // len(chosen))
    projectors: dict[str, Projector | SparseSignSketch] = {
        "dense rademacher": Projector(D, k, kind="rademacher", seed=0),
        "dense gaussian": Projector(D, k, kind="gaussian", seed=0),
        "dense per-param": Projector(D, per, kind="rademacher", seed=0, groups=list(zip(offsets, sizes))),
    }
    for s in sketch:
        projectors[f"sketch s={s}"] = SparseSignSketch(D, k, nonzeros=s, seed=0)
    for name, projector in projectors.items():
        t0 = time.perf_counter()
        rows = projector.project(exact)
        seconds = t_exact + time.perf_counter() - t0
        width = projector.out_dim if isinstance(projector, Projector) else projector.dim
        out[name] = {**metrics(exact.numpy(), rows.numpy()), "width": width, "seconds": seconds}
    out["_"] = {"D": D, "exact_seconds": t_exact}
    return out


def nonzeros_sweep(classes: int, k: int, steps: int, seeds: int, nonzeros: list[int], only: list[str] | None) -> None:
    """Cosine errors of dense Rademacher and of the sketch for each s, pooled over ``seeds``."""
    from classgrad.workers.gradients import per_class_gradients
    from classgrad.workers.projection import Projector
    from classgrad.workers.projection.sketch.row_sketch import SparseSignSketch
    from classgrad.workers.zoo import synthetic_probe

    table, results = [], []
    for name, (model, data, chosen) in models(classes).items():
        if only and name not in only:
            continue
        for state in ("init", f"{steps} steps"):
            if state != "init":
                train(model, data, classes, steps)
            probe = synthetic_probe(classes, seed=0, samples_per_class=2, imbalance=0.3, **data)
            exact = per_class_gradients(model, probe, num_classes=classes, params=chosen).numpy()
            e = exact[np.linalg.norm(exact, axis=1) > 0].astype(np.float64)
            e /= np.linalg.norm(e, axis=1, keepdims=True)
            iu = np.triu_indices(len(e), 1)
            D = exact.shape[1]
            for s in [0, *nonzeros]:  # 0: dense Rademacher
                errs = []
                for seed in range(seeds):
                    proj = Projector(D, k, seed=seed) if s == 0 else SparseSignSketch(D, k, nonzeros=s, seed=seed)
                    p = proj.project(torch.from_numpy(exact)).numpy()[np.linalg.norm(exact, axis=1) > 0]
                    p = p.astype(np.float64) / np.linalg.norm(p, axis=1, keepdims=True)
                    errs.append(np.abs(p @ p.T - e @ e.T)[iu])
                err = np.concatenate(errs)
                q = [float(np.median(err)), *(float(np.quantile(err, x)) for x in (0.99, 0.999)), float(err.max())]
                method = "dense rademacher" if s == 0 else f"sketch s={s}"
                results.append({"model": name, "state": state, "method": method, "cos": q, "seeds": seeds})
                table.append([name, state, method, *(f"{v:.4f}" for v in q)])
                print(f"{name} {state} {method}: done", flush=True)
    print(f"\n== sketch nonzeros: |dcos| pooled over {seeds} seeds, k = {k}, C = {classes}, 1-4 samples per class")
    print_table(["model", "state", "method", "med", "p99", "p99.9", "max"], table)
    common.write_report(
        str(common.OUT_DIR / "sketch_nonzeros.json"),
        {"machine": common.machine_info(), "classes": classes, "dim": k, "rows": results},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--classes", type=int)
    parser.add_argument("--dim", type=int, help="stored width k (every method)")
    parser.add_argument("--steps", type=int, help="training steps of the trained state")
    parser.add_argument("--models", nargs="*", help="subset of: vit bert 'resnet18 stage2+fc'")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--wider", type=int, nargs="*", default=[4], help="also kronecker at these multiples of k (not equal width)"
    )
    parser.add_argument("--sketch", type=int, nargs="*", default=[1, 4], help="also whole rows sketched, these s")
    parser.add_argument("--sketch-nonzeros", type=int, default=4, help="s of kronecker + sketch rest")
    parser.add_argument("--nonzeros-sweep", type=int, metavar="SEEDS", help="only the sweep of the sketch's s")
    args = parser.parse_args()
    classes = args.classes or (32 if args.quick else 48)
    k = args.dim or (256 if args.quick else 512)
    steps = args.steps if args.steps is not None else (40 if args.quick else 100)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if args.nonzeros_sweep:
        nonzeros = args.sketch if args.sketch != [1, 4] else [1, 2, 4, 8]
        nonzeros_sweep(classes, k, steps, args.nonzeros_sweep, nonzeros, args.models)
        return
    from classgrad.workers.zoo import synthetic_probe

    results: list[dict[str, Any]] = []
    table = []
    for name, (model, data, chosen) in models(classes).items():
        if args.models and name not in args.models:
            continue
        for state in ("init", f"{steps} steps"):
            if state != "init":
                train(model, data, classes, steps)
            for regime, kwargs in (
                ("1-4", {"samples_per_class": 2, "imbalance": 0.3}),
                ("50", {"samples_per_class": 50}),
            ):
                probe = synthetic_probe(classes, seed=0, **kwargs, **data)
                found = compare(
                    model, probe, chosen, classes, k, tuple(args.wider), tuple(args.sketch), args.sketch_nonzeros
                )
                meta = found.pop("_")
                for method, m in found.items():
                    results.append({"model": name, "state": state, "samples": regime, "method": method, **meta, **m})
                    recall = next(v for key, v in m.items() if key.startswith("recall@"))
                    table.append(
                        [
                            name,
                            state,
                            regime,
                            method,
                            m["width"],
                            f"{m['cos_median']:.4f}",
                            f"{m['cos_p99']:.4f}",
                            f"{m['ip_median']:.4f}",
                            f"{m['ip_p99']:.4f}",
                            f"{recall:.2f}",
                        ]
                    )
                print(f"{name} {state} {regime}: D = {meta['D']:,} done", flush=True)
    print(f"\n== projection quality at equal stored width k = {k}, C = {classes}, 1 seed")
    headers = ["model", "state", "samples/class", "method", "width", "|dcos| med", "|dcos| p99"]
    headers += ["|dip|/(|x||y|) med", "p99", "recall@10"]
    print_table(headers, table)
    common.write_report(
        args.out, {"machine": common.machine_info(), "classes": classes, "dim": k, "steps": steps, "rows": results}
    )


if __name__ == "__main__":
    main()

"""The partitioned engine on tiny Hugging Face models against the per-class loop and the floor.

Holds the measurement of issue 16 item 2 ("no model falls off a cliff"): BERT with padded inputs
and an attention mask, and GPT-2 with right padding (Llama and ViT with ``--models``; all from
tiny configs in ``tests/support/hf_models.py``, wrapped to return ``.logits``), at C classes with 1 to 4 probe
samples each (uniformly drawn, seeded), on ``--threads`` CPU threads. For each case it times:

- **classgrad**: a fresh partitioned engine computing every row (its once-per-process spot
  check done in a warm-up run), and the path line it logged;
- **no hooks**: the same with the hook path ruled out: vmap where it can batch the whole model
  (ViT), else the last resort, one forward per pack of classes and a backward per class
  (``partitioned.loop_path``: BERT, GPT-2 and Llama, whose masks vmap cannot run);
- **per-class loop**: one forward over all probe samples, then
  ``torch.autograd.grad(L_c, params, retain_graph=True)`` per class into a C x D buffer, timed
  on ``--loop-classes`` classes and extrapolated per row (forward + C/k x their time);
- **floor**: one forward+backward of the summed loss over the probe set (batch by batch) plus a
  plain fill of a C x D float32 tensor (writing the rows once).

Best of ``--repeats`` runs each. Prints a table, writes ``benchmarks/out/hf_paths.json``. Nothing
is asserted on time.

    .venv/bin/python -m benchmarks.hf_paths                 # C = 200 and 1000, BERT and GPT-2
    .venv/bin/python -m benchmarks.hf_paths --quick         # C = 200 only, one repeat
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from unittest import mock

import torch

from benchmarks.common import machine_info, print_table, write_report
from classgrad.workers.engines import build_engine
from classgrad.workers.engines.partitioned import hook_plan
from classgrad.workers.losses import create_loss
from tests.support.hf_models import HF_BUILDERS, VOCAB

SEQ_LEN = 12
BATCH = 256


def probe(name: str, num_classes: int, seed: int = 0) -> tuple[dict | torch.Tensor, torch.Tensor]:
    """1 to 4 samples per class; right-padded token ids (1 to SEQ_LEN real tokens) and a mask,
    or 3x8x8 images for ViT."""
    g = torch.Generator().manual_seed(seed)
    per_class = torch.randint(1, 5, (num_classes,), generator=g)
    labels = torch.repeat_interleave(torch.arange(num_classes), per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    n = len(labels)
    if name == "vit":
        return torch.randn(n, 3, 8, 8, generator=g), labels
    lengths = torch.randint(1, SEQ_LEN + 1, (n,), generator=g)
    mask = (torch.arange(SEQ_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask}, labels


def best(fn: Callable[[], float | None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        extra = fn()
        times.append(time.perf_counter() - t0 if extra is None else extra)
    return min(times)


def engine_rows(model, data, num_classes: int, notes: list[str], rows: int | None = None) -> Callable[[], None]:
    def run() -> None:
        eng = build_engine(model, data, num_classes=num_classes, engine="partitioned", batch_size=BATCH)
        for _ in eng.iter_blocks(range(num_classes if rows is None else rows)):
            pass
        notes[:] = eng.stats.notes

    return run


def per_class_loop(model, data, num_classes: int, k: int) -> Callable[[], float]:
    x, y = data
    params = [p for p in model.parameters() if p.requires_grad]
    dim = sum(p.numel() for p in params)
    loss = create_loss("cross_entropy", num_classes)
    norm = loss.norm(y)

    def run() -> float:
        t0 = time.perf_counter()
        L = loss.batch_losses(model(x), y, norm)  # [C]: mean loss of each class's samples
        t_fwd = time.perf_counter() - t0
        rows = torch.empty(k, dim)
        t1 = time.perf_counter()
        for c in range(k):
            g = torch.autograd.grad(L[c], params, retain_graph=True, allow_unused=True)
            torch.cat(
                [(torch.zeros_like(p) if gi is None else gi).reshape(-1) for p, gi in zip(params, g)], out=rows[c]
            )
        return t_fwd + (time.perf_counter() - t1) * num_classes / k

    return run


def floor(model, data, num_classes: int) -> Callable[[], None]:
    x, y = data
    params = [p for p in model.parameters() if p.requires_grad]
    dim = sum(p.numel() for p in params)
    loss = create_loss("cross_entropy", num_classes)
    norm = loss.norm(y)

    def run() -> None:
        for i in range(0, len(y), BATCH):
            xb = {key: v[i : i + BATCH] for key, v in x.items()} if isinstance(x, dict) else x[i : i + BATCH]
            part = loss.batch_losses(model(xb), y[i : i + BATCH], norm).sum()
            torch.autograd.grad(part, params, allow_unused=True)
        torch.empty(num_classes, dim).fill_(1.0)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", default="200,1000", help="comma-separated C values")
    parser.add_argument("--models", default="bert,gpt2", help=f"comma-separated, of {sorted(HF_BUILDERS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-classes", type=int, default=40, help="classes the per-class loop is timed on")
    parser.add_argument("--quick", action="store_true", help="C = 200 only, one repeat")
    parser.add_argument("--out", default="benchmarks/out/hf_paths.json")
    args = parser.parse_args()
    if args.quick:
        args.classes, args.repeats = "200", 1
    torch.set_num_threads(args.threads)
    logging.getLogger("classgrad").setLevel(logging.WARNING)
    table, results = [], []
    for name in args.models.split(","):
        for num_classes in (int(c) for c in args.classes.split(",")):
            model = HF_BUILDERS[name](num_classes)
            data = probe(name, num_classes)
            dim = sum(p.numel() for p in model.parameters())
            notes: list[str] = []
            engine_rows(model, data, num_classes, [], rows=8)()  # warm-up: the once-per-process spot check
            t_engine = best(engine_rows(model, data, num_classes, notes), args.repeats)
            with mock.patch.object(hook_plan.HookPlan, "plan", classmethod(lambda cls, *a, **kw: None)):
                resort_notes: list[str] = []
                t_resort = best(engine_rows(model, data, num_classes, resort_notes), 1)
            t_loop = best(per_class_loop(model, data, num_classes, min(args.loop_classes, num_classes)), args.repeats)
            t_floor = best(floor(model, data, num_classes), args.repeats)
            n = len(data[1])
            table.append(
                [
                    name,
                    num_classes,
                    n,
                    dim,
                    f"{t_engine:.3f}",
                    f"{t_resort:.3f}",
                    f"{t_loop:.3f}",
                    f"{t_floor:.3f}",
                    f"{t_engine / t_floor:.2f}x",
                    f"{t_loop / t_engine:.1f}x",
                    f"{t_loop / t_resort:.2f}x",
                ]
            )
            results.append(
                dict(
                    model=name,
                    classes=num_classes,
                    samples=n,
                    dim=dim,
                    classgrad_s=t_engine,
                    no_hooks_s=t_resort,
                    per_class_loop_s=t_loop,
                    floor_s=t_floor,
                    path=notes,
                    no_hooks_path=resort_notes,
                )
            )
            print(f"{name} C={num_classes}: {' | '.join(notes)}", flush=True)
    print()
    print_table(
        [
            "model",
            "C",
            "N",
            "D",
            "classgrad s",
            "no hooks s",
            "loop s",
            "floor s",
            "classgrad/floor",
            "loop/classgrad",
            "loop/no hooks",
        ],
        table,
    )
    write_report(args.out, {"machine": machine_info(), "threads": args.threads, "results": results})


if __name__ == "__main__":
    main()

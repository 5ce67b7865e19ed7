"""Shared pieces of the engine benchmarks: cases, timing, and the usual alternatives.

Holds:
- ``Case``: one model, probe set, loss and precision that every method is timed on, built by
  ``make_case`` from the zoo (``small_cnn``, ``mlp``, ``resnet18``) and ``synthetic_probe``.
- ``interleaved``: times several methods round-robin (the machines are shared and noisy: the
  methods of one table see the same disturbances), best and median kept.
- The alternatives a user would try, each returning ``(rows [k, D], classes)``: the seed-style
  ``.backward(retain_graph=True)`` loop, the ``torch.autograd.grad`` loop, batched VJPs with
  one-hot cotangents (``is_grads_batched``), ``torch.func.jacrev`` with ``chunk_size``,
  per-sample gradients by ``torch.func.vmap(grad)`` summed by label (TRAK-style), per-sample
  gradients from hooks summed by label (Opacus-style), the floor, and classgrad's engines.

Every method computes the same L (the loss object of ``classgrad.workers.losses``, micro-batch by
micro-batch, exactly as the engines do), so rows can be compared with ``allclose``.
Nothing here asserts on time.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from classgrad.workers import zoo
from classgrad.workers.gradients import build_engine
from classgrad.workers.losses import create_loss

OUT_DIR = Path(__file__).resolve().parent / "out"
AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
# fp16 alternatives scale the loss by this constant and divide the rows by it (the engines
# scale per row and recompute overflowed rows; the alternatives just check the result).
ALT_FP16_SCALE = 2.0**10


# --- machine and environment ---------------------------------------------------------------


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded (empty where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/meminfo") as fh:
            kb = int(fh.readline().split()[1])
        info["ram_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# --- clock -----------------------------------------------------------------------------------
#
# On a shared CPU machine, wall time includes the time other processes hold the cores. With one
# torch thread (the default here, and how each Ray actor runs), process CPU time is the time
# the work itself took, and ratios of it are stable under load. Wall time for GPUs and for
# several threads (where it is the only fair figure).

_CLOCK: Callable[[], float] = time.perf_counter
CLOCK_NAME = "wall"


def set_clock(kind: str, device: str = "cpu", threads: int = 1) -> str:
    """``cpu``, ``wall`` or ``auto`` (cpu time for one CPU thread, wall time otherwise)."""
    global _CLOCK, CLOCK_NAME
    if kind == "auto":
        kind = "cpu" if torch.device(device).type == "cpu" and threads == 1 else "wall"
    _CLOCK = time.process_time if kind == "cpu" else time.perf_counter
    CLOCK_NAME = kind
    return kind


def now() -> float:
    return _CLOCK()


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def kernel_time(fn, device: torch.device) -> float | None:
    """Sum of GPU kernel self times (seconds) recorded by torch.profiler over one call."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # The kernels' own events only: a CPU op's entry carries its kernels' time too, so summing
    # every entry would count each kernel twice.
    total = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total / 1e6


# --- cases -----------------------------------------------------------------------------------


@dataclass
class Case:
    """The one model/probe/loss/precision that every method of a table is timed on."""

    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    loss_kind: str | Callable = "cross_entropy"
    precision: str = "fp32"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_size: int = 256

    def __post_init__(self) -> None:
        self.model = self.model.to(self.device)
        self.x = self.x.to(self.device)
        self.y = self.y.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.dim = sum(p.numel() for p in self.params)
        self.loss = create_loss(self.loss_kind, self.num_classes)
        self.norm = self.loss.norm(self.y.cpu()).to(self.device)

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def partitioned(self) -> bool:
        return self.loss.partitioned

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST[self.precision])

    @property
    def scale(self) -> float:
        return ALT_FP16_SCALE if self.precision == "fp16" else 1.0

    def batches(self):
        for start in range(0, self.n, self.batch_size):
            yield self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]

    def loss_vector(self) -> torch.Tensor:
        """L ``[C]`` with its graph, over the whole probe set (one forward, kept)."""
        total = None
        for xb, yb in self.batches():
            with self.autocast():
                out = self.model(xb)
            part = self.loss.batch_losses(out, yb, self.norm)
            total = part if total is None else total + part
        assert total is not None
        return total


def log_softmax_mean(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A dense loss that sees every output column (L_c = -mean log-softmax of class c): no head
    path applies, so the dense engine's VJPs run through the whole model (``--dense-losses
    log_softmax``)."""
    return -F.log_softmax(outputs.float(), dim=1).mean(dim=0)


# Dense losses by the names the benchmarks take: built-in kinds, and the one above.
DENSE_LOSSES: dict[str, Any] = {"logit": "logit", "bce": "bce", "log_softmax": log_softmax_mean}


def make_model(kind: str, num_classes: int, *, width: int = 8, hidden: int = 64, seed: int = 0) -> nn.Module:
    if kind == "cnn":
        return zoo.small_cnn(num_classes, width=width, seed=seed).eval()
    if kind == "mlp":
        return zoo.mlp(num_classes, in_features=32, hidden=hidden, depth=2, seed=seed).eval()
    if kind == "resnet18":
        return zoo.resnet18(num_classes, small_inputs=True, seed=seed).eval()
    raise ValueError(f"unknown model {kind!r} (cnn, mlp, resnet18)")


def make_probe(
    kind: str,
    num_classes: int,
    samples_per_class: int,
    *,
    image_size: int = 16,
    tiny: bool = False,
    multilabel: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels, samples grouped by class. ``tiny``: each class keeps a random
    1..``samples_per_class`` of its samples (the many-tiny-classes case). ``multilabel``:
    multi-hot targets (the ``bce`` loss)."""
    if kind == "mlp":
        x, y = zoo.synthetic_probe(
            num_classes, samples_per_class, kind="vector", input_shape=(32,), multilabel=multilabel, seed=seed
        )
    else:
        size = 32 if kind == "resnet18" and image_size == 16 else image_size
        x, y = zoo.synthetic_probe(
            num_classes, samples_per_class, kind="image", input_shape=(3, size, size), multilabel=multilabel, seed=seed
        )
    if tiny:
        g = torch.Generator().manual_seed(seed + 1)
        keep_n = torch.randint(1, samples_per_class + 1, (num_classes,), generator=g)
        pos = torch.arange(len(y)) - torch.repeat_interleave(
            torch.arange(num_classes) * samples_per_class, samples_per_class
        )
        keep = pos < keep_n[y]
        x, y = x[keep], y[keep]
    return x, y


def make_case(
    model: str,
    num_classes: int,
    samples_per_class: int,
    *,
    loss: str = "cross_entropy",
    precision: str = "fp32",
    device: str = "cpu",
    tiny: bool = False,
    image_size: int = 16,
    width: int = 8,
    hidden: int = 64,
    max_samples: int | None = None,
    seed: int = 0,
) -> Case:
    x, y = make_probe(
        model, num_classes, samples_per_class, image_size=image_size, tiny=tiny, multilabel=loss == "bce", seed=seed
    )
    loss = DENSE_LOSSES.get(loss, loss)
    if max_samples is not None and len(y) > max_samples:  # dense: a probe set independent of C
        pick = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:max_samples].sort().values
        x, y = x[pick], y[pick]
    name = f"{model} C={num_classes} " + (f"{len(y)} samples" if tiny or max_samples else f"{samples_per_class}/class")
    return Case(
        name,
        make_model(model, num_classes, width=width, hidden=hidden, seed=seed),
        x,
        y,
        num_classes,
        loss_kind=loss,
        precision=precision,
        device=torch.device(device),
    )


# --- timing ----------------------------------------------------------------------------------


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def interleaved(
    methods: dict[str, Callable[[], Any]], reps: int, device: torch.device | str = "cpu", warmup: bool = True
) -> dict[str, Timing]:
    """Time every method ``reps`` times, round-robin. A method returns either nothing or
    ``{"seconds": s}`` (an extrapolated time it measured itself). A method that raises in the
    warm-up is not timed: its ``Timing`` holds one infinite time and the error as its note (a table
    of alternatives says which one failed, and still times the others)."""
    out = {name: Timing() for name in methods}
    if warmup:
        for name, fn in list(methods.items()):
            try:
                fn()
                sync(device)
            except Exception as exc:  # noqa: BLE001 - an alternative's failure is a row of the table
                out[name] = Timing([math.inf], f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                methods = {n: f for n, f in methods.items() if n != name}
    for _ in range(reps):
        for name, fn in methods.items():
            sync(device)
            t0 = now()
            result = fn()
            sync(device)
            elapsed = now() - t0
            if isinstance(result, dict) and "seconds" in result:
                elapsed = result["seconds"]
            out[name].times.append(elapsed)
    return out


def memcpy_seconds(num_rows: int, dim: int, device: torch.device | str = "cpu", reps: int = 5) -> float:
    """Best time of one plain copy of a ``[num_rows, dim]`` float32 buffer into a fresh one: the
    least any method that returns the rows pays beyond its arithmetic. Measured in chunks of at
    most 256 MiB (the engines also write group by group)."""
    rows_per_chunk = max(1, min(num_rows, (256 << 20) // max(1, 4 * dim)))
    src = torch.randn(rows_per_chunk, dim, device=device)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = now()
        done = 0
        while done < num_rows:
            k = min(rows_per_chunk, num_rows - done)
            dst = torch.empty(k, dim, device=device)
            dst.copy_(src[:k])
            done += k
        sync(device)
        best = min(best, now() - t0)
    return best


# --- the methods -----------------------------------------------------------------------------
#
# Each method maker returns a callable that computes rows for ``classes`` and keeps the last
# result in ``holder`` (for the allclose check), so timing and checking use the same code.


def flat(
    grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The gradients as one row (zeros for a missing one), written into ``out`` if given."""
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)], out=out
    )


def _timed_forward(case: Case) -> tuple[torch.Tensor, float]:
    """L, the [C] loss vector with its graph, and the seconds its forward took."""
    sync(case.device)
    t0 = now()
    L = case.loss_vector()
    sync(case.device)
    return L, now() - t0


def _per_class_loop(
    case: Case, classes: Sequence[int], holder: dict, one_row: Callable[[torch.Tensor, torch.Tensor], None]
) -> Callable[[], dict]:
    """The frame both loops share: one forward, then ``one_row(L[c], row)`` for each class in
    ``classes``; timed on that subset and extrapolated per row to all C:
    forward + C/k x (time of the k rows)."""

    def run() -> dict:
        L, t_fwd = _timed_forward(case)
        t1 = now()
        rows = torch.empty(len(classes), case.dim, device=case.device)
        for i, c in enumerate(classes):
            one_row(L[c] * case.scale, rows[i])
            if case.scale != 1:
                rows[i] /= case.scale
        sync(case.device)
        t_rows = now() - t1
        holder["rows"], holder["classes"] = rows, list(classes)
        return {"seconds": t_fwd + t_rows * case.num_classes / len(classes)}

    return run


def seed_loop(case: Case, classes: Sequence[int], holder: dict) -> Callable[[], dict]:
    """The usual first attempt: one forward, then per class ``L[c].backward(retain_graph=True)``,
    copy ``.grad``, zero it."""

    def one_row(loss: torch.Tensor, row: torch.Tensor) -> None:
        loss.backward(retain_graph=True)
        flat([p.grad for p in case.params], case.params, out=row)
        for p in case.params:
            if p.grad is not None:
                p.grad.zero_()

    timed = _per_class_loop(case, classes, holder, one_row)

    def run() -> dict:
        for p in case.params:
            p.grad = None
        try:
            return timed()
        finally:
            for p in case.params:
                p.grad = None

    return run


def grad_loop(case: Case, classes: Sequence[int], holder: dict) -> Callable[[], dict]:
    """One forward, then ``torch.autograd.grad(L[c], params, retain_graph=True)`` per class."""

    def one_row(loss: torch.Tensor, row: torch.Tensor) -> None:
        g = torch.autograd.grad(loss, case.params, retain_graph=True, allow_unused=True)
        flat(g, case.params, out=row)

    return _per_class_loop(case, classes, holder, one_row)


def batched_onehot(case: Case, classes: Sequence[int], holder: dict, chunk: int) -> Callable[[], dict]:
    """One forward, then ``torch.autograd.grad(L, params, one-hot cotangents,
    is_grads_batched=True)`` ``chunk`` rows at a time (extrapolated per row when ``classes`` is
    a subset)."""

    def run() -> dict:
        sync(case.device)
        t0 = now()
        L = case.loss_vector()
        rows = torch.empty(len(classes), case.dim, device=case.device)
        ids = torch.as_tensor(list(classes), device=case.device)
        for b0 in range(0, len(ids), chunk):
            which = ids[b0 : b0 + chunk]
            cot = torch.zeros(len(which), case.num_classes, device=case.device, dtype=L.dtype)
            cot[torch.arange(len(which), device=case.device), which] = case.scale
            g = torch.autograd.grad(
                L, case.params, grad_outputs=cot, is_grads_batched=True, retain_graph=True, allow_unused=True
            )
            block = torch.cat(
                [
                    (t if t is not None else torch.zeros(len(which), *p.shape, device=p.device)).reshape(len(which), -1)
                    for t, p in zip(g, case.params)
                ],
                dim=1,
            )
            rows[b0 : b0 + len(which)] = block / case.scale if case.scale != 1 else block
        sync(case.device)
        elapsed = now() - t0
        holder["rows"], holder["classes"] = rows, list(classes)
        return {"seconds": elapsed * max(1.0, case.num_classes / len(classes))}

    return run


def func_jacrev(case: Case, classes: Sequence[int], holder: dict, chunk: int) -> Callable[[], dict]:
    """``torch.func.jacrev`` of the selected entries of L (a functional forward over the probe
    set) with ``chunk_size`` (vmap over vjp, ``chunk`` cotangents at a time)."""
    from torch.func import functional_call, jacrev

    params = {n: p.detach() for n, p in zip(case.names, case.params)}
    ids = torch.as_tensor(list(classes), device=case.device)

    def selected_losses(p):
        total = None
        for xb, yb in case.batches():
            with case.autocast():
                out = functional_call(case.model, p, (xb,))
            part = case.loss.batch_losses(out, yb, case.norm)
            total = part if total is None else total + part
        return total[ids] * case.scale

    def run() -> dict:
        sync(case.device)
        t0 = now()
        jac = jacrev(selected_losses, chunk_size=chunk)(params)
        rows = torch.cat([jac[n].reshape(len(ids), -1) for n in case.names], dim=1)
        if case.scale != 1:
            rows /= case.scale
        sync(case.device)
        elapsed = now() - t0
        holder["rows"], holder["classes"] = rows, list(classes)
        return {"seconds": elapsed * max(1.0, case.num_classes / len(classes))}

    return run


def _present(case: Case) -> tuple[list[int], torch.Tensor]:
    """The classes that have samples (rows of the per-sample methods), and class -> row."""
    present = torch.unique(case.y).tolist()
    slot = torch.zeros(case.num_classes, dtype=torch.long, device=case.device)
    slot[torch.tensor(present, device=case.device)] = torch.arange(len(present), device=case.device)
    return present, slot


def _weights(case: Case, yb: torch.Tensor) -> torch.Tensor:
    return 1.0 / case.norm.counts[yb].clamp(min=1).float()


def trak_vmap(case: Case, holder: dict, sample_chunk: int | None = None) -> Callable[[], None]:
    """Per-sample gradients with ``torch.func.vmap(grad)`` over each micro-batch (how TRAK-style
    tools compute them), then a weighted sum by label into the rows (partitioned loss only)."""
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in zip(case.names, case.params)}

    def sample_loss(p, x1, y1):
        with case.autocast():
            out = functional_call(case.model, p, (x1.unsqueeze(0),))
        return case.loss.sample_losses(out, case.loss.labels(y1.unsqueeze(0))).sum() * case.scale

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    chunk = sample_chunk or case.batch_size
    present, slot = _present(case)

    def run() -> None:
        rows = torch.zeros(len(present), case.dim, device=case.device)
        for start in range(0, case.n, chunk):  # per-sample gradients of `chunk` samples at a time
            xb, yb = case.x[start : start + chunk], case.y[start : start + chunk]
            g = per_sample(params, xb, yb)
            flat_g = torch.cat([g[n].reshape(len(yb), -1).float() for n in case.names], dim=1)
            rows.index_add_(0, slot[yb], flat_g * (_weights(case, yb) / case.scale).unsqueeze(1))
        holder["rows"], holder["classes"] = rows, present

    return run


def opacus_hooks(case: Case, holder: dict) -> Callable[[], None]:
    """Per-sample gradients from module hooks, the way Opacus's grad samplers compute them
    (Linear: ``einsum`` of backprops and activations; Conv2d: ``unfold`` then ``einsum``), then a
    weighted sum by label into the rows. Needs every parameter to sit in a Linear or Conv2d."""
    modules = {m: n for n, m in case.model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    owned = {f"{n}.{k}" for m, n in modules.items() for k, p in m.named_parameters(recurse=False)}
    if set(case.names) - owned:
        raise ValueError("opacus-style hooks here support Linear and Conv2d parameters only")
    offsets, off = {}, 0
    for n, p in zip(case.names, case.params):
        offsets[n] = (off, p.numel())
        off += p.numel()

    present, slot = _present(case)

    def run() -> None:
        rows = torch.zeros(len(present), case.dim, device=case.device)
        for xb, yb in case.batches():
            acts: dict[nn.Module, torch.Tensor] = {}
            backs: dict[nn.Module, torch.Tensor] = {}

            def fwd_hook(mod, args, out):
                acts[mod] = args[0].detach()  # noqa: B023 - called within this iteration
                out.register_hook(lambda g, mod=mod: backs.__setitem__(mod, g.detach()))  # noqa: B023 - called within this iteration

            handles = [m.register_forward_hook(fwd_hook) for m in modules]
            try:
                with case.autocast():
                    out = case.model(xb)
            finally:
                for h in handles:
                    h.remove()
            per = case.loss.sample_losses(out, case.loss.labels(yb))
            (per * _weights(case, yb) * case.scale).sum().backward()
            per_sample = torch.empty(len(yb), case.dim, device=case.device)
            for m, name in modules.items():
                a, g = acts[m].float(), backs[m].float()
                if isinstance(m, nn.Linear):
                    gw = torch.einsum("n...i,n...j->nij", g, a)
                    gb = g.reshape(len(yb), -1, g.shape[-1]).sum(1)
                else:
                    u = F.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride)
                    gw = torch.einsum("nol,nkl->nok", g.reshape(len(yb), g.shape[1], -1), u)
                    gb = g.sum(dim=(2, 3))
                for kind, val in (("weight", gw), ("bias", gb)):
                    key = f"{name}.{kind}"
                    if key in offsets:
                        o, s = offsets[key]
                        per_sample[:, o : o + s] = val.reshape(len(yb), -1)
            rows.index_add_(0, slot[yb], per_sample / case.scale)
            for p in case.params:
                p.grad = None
        holder["rows"], holder["classes"] = rows, present

    return run


def floor_partitioned(case: Case) -> Callable[[], None]:
    """The floor of a partitioned loss: one forward+backward of the summed loss (sum over c of
    L_c) over the probe set, micro-batch by micro-batch. It writes no C x D rows."""

    def run() -> None:
        acc = None
        for xb, yb in case.batches():
            with case.autocast():
                out = case.model(xb)
            part = case.loss.batch_losses(out, yb, case.norm).sum() * case.scale
            g = torch.autograd.grad(part, case.params, allow_unused=True)
            acc = g if acc is None else [a + b if a is not None else b for a, b in zip(acc, g)]

    return run


def floor_dense(case: Case, probe_rows: int = 8) -> Callable[[], dict]:
    """The floor of a dense loss as defined in issue 6: C single-row VJPs on one retained graph
    (the forward once, plus C x the best time of one single-row VJP, measured on ``probe_rows``
    rows). A batched VJP can beat it: it vectorises the C rows."""

    def run() -> dict:
        L, t_fwd = _timed_forward(case)
        best = float("inf")
        for c in range(min(probe_rows, case.num_classes)):
            t1 = now()
            torch.autograd.grad(L[c] * case.scale, case.params, retain_graph=True, allow_unused=True)
            sync(case.device)
            best = min(best, now() - t1)
        return {"seconds": t_fwd + case.num_classes * best}

    return run


def classgrad(
    case: Case,
    holder: dict,
    engine: str,
    classes: Sequence[int] | None = None,
    keep: Sequence[int] | None = None,
    **options: Any,
) -> Callable[[], dict]:
    """classgrad's engine, built fresh each time (its once-per-process choices, such as the dense
    block size or the partitioned engine's hook check, are made in the warm-up run, as an actor
    makes them on its first shard), rows consumed block by block and kept as they come (no extra copy), or,
    with ``keep``, only the rows of those classes (when all of them would not fit in memory).
    With ``classes`` (a subset), the time is extrapolated per row."""
    wanted = list(range(case.num_classes)) if classes is None else list(classes)
    kept = None if keep is None else set(keep)

    def run() -> dict:
        sync(case.device)
        t0 = now()
        eng = build_engine(
            case.model,
            (case.x, case.y),
            num_classes=case.num_classes,
            loss=case.loss,
            precision=case.precision,
            engine=engine,
            device=case.device,
            **{"batch_size": case.batch_size, **options},
        )
        blocks, got = [], []
        for b in eng.iter_blocks(wanted):
            if kept is None:
                blocks.append(b.rows)
                continue
            for i, c in enumerate(b.classes.tolist()):
                if c in kept:
                    blocks.append(b.rows[i : i + 1].clone())
                    got.append(c)
            del b
        sync(case.device)
        elapsed = now() - t0
        holder["blocks"], holder["classes"], holder["engine"] = blocks, wanted if kept is None else got, eng
        return {"seconds": elapsed * case.num_classes / len(wanted)}

    return run


def held_rows(holder: dict) -> torch.Tensor:
    if "rows" in holder:
        return holder["rows"]
    return torch.cat(holder["blocks"])


def compare(
    rows: torch.Tensor, classes: Sequence[int], ref: torch.Tensor, ref_classes: Sequence[int], precision: str
) -> tuple[bool, float]:
    """allclose on the classes both have; returns (ok, max error relative to the largest entry).

    Tolerance: fp32 sums in a different order (per-sample vs per-class, batched vs looped) give
    relative differences around 1e-6; 1e-4 of the largest entry leaves room for long sums.
    Half precision rounds every product: 2e-2 (fp16) and 5e-2 (bf16)."""
    pos = {c: i for i, c in enumerate(ref_classes)}
    common = [i for i, c in enumerate(classes) if c in pos]
    a = rows[common].float().cpu()
    b = ref[[pos[classes[i]] for i in common]].float().cpu()
    scale = float(b.abs().max()) or 1.0
    err = float((a - b).abs().max()) / scale if len(common) else float("nan")
    tol = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}[precision]
    ok = bool(torch.isfinite(a).all()) and err <= tol
    return ok, err


def fmt_s(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    if seconds >= 100:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join(h.ljust(w) for h, w in zip(cells[0], widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def print_targets(targets: Sequence[dict[str, Any]], value_format: str = ".2f") -> None:
    """The targets table: name, measured value, goal, met, and the detail column when any
    target has one."""
    detail = any("detail" in t for t in targets)
    print("\n== targets")
    print_table(
        ["target", "measured", "goal", "met"] + (["detail"] if detail else []),
        [
            [t["name"], format(t["value"], value_format), t["goal"], "yes" if t["met"] else "NO"]
            + ([t.get("detail", "")] if detail else [])
            for t in targets
        ],
    )


def write_report(out: str | Path, report: dict[str, Any]) -> Path:
    """Write a benchmark's JSON report (creating its folder) and say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}")
    return out


class GcClock:
    """Seconds Python's garbage collector ran while it is entered (``gc.callbacks``): a full
    collection in a process that imported transformers walks millions of objects (100-170 ms on
    the 2-core VM) and lands on whichever call allocates past its threshold: reported beside a
    first call, never taken out of it."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)


def tree_setup_code(tree: str | None) -> str:
    """Python code that points this venv's editable install of classgrad at another checkout
    (its three source folders), to run before ``classgrad`` is imported in a child process: the
    code before a change, timed on the same machine (``--tree`` of the benchmarks)."""
    if tree is None:
        return ""
    return (
        "import __editable___classgrad_0_1_0_finder as finder\n"
        f"root = {str(tree)!r}\n"
        "finder.MAPPING.update({'classgrad': root + '/src/classgrad', 'classgrad.service': root + '/service',"
        " 'classgrad.workers': root + '/workers'})\n"
    )

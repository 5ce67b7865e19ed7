"""How far above the floor any exact per-class method must land: a lower bound, per model (issue 24).

The floor (``projection_scale``'s) is one forward and backward of the summed loss over the probe
set, weight gradients included, plus a fill of the C x k rows. A method that computes each
class's gradient of an outer-product layer (Linear, transformers' ``Conv1D``) exactly, however
it then projects it, must at least

- ``activations``: run the forward and the backward to every layer's output (each token's output
  gradient; no weight gradients), over micro-batches of at most ``--batch-size`` samples cut
  between classes (at 1-4 samples a class, a batch or so more than the floor's);
- ``per class``: for every such layer, either form each class's ``sum_t g_t x_t^T`` (the floor's
  weight-gradient multiply-adds, split by class: the engine's own batched product per token
  count, ``Ragged.per_class_mm``) or take the FFT route (an ``rfft`` of both factors per token,
  zero-padded to ``k``, and an ``irfft`` per class): the cheapest of the two, over all tokens or
  over only those whose output gradient is not all zero (the engine drops the others where they
  are at least half), per layer and batch.

Convolutions and recurrent layers are bounded too (``per class`` includes them):

- a convolution's per-class weight gradients by the cheapest exact kernel the engine has
  (``layer_rules.conv``): one grouped backward per class size (``by_size``), one backward per
  class (``per_class``), or patches and the per-class products above (``tokens``, the patches'
  copy included), per layer and batch;
- a recurrent layer's (single-layer, one direction) by the per-class products of its weights'
  sums over steps, ``sum dgi_t x_t^T`` and ``sum dgi_t h_{t-1}^T``, as above; the gate
  gradients ``dgi`` are taken as given (random, of their shape): getting them counts zero.

Nothing is added for sketching the formed entries, for norm layers or embeddings (their
per-class work counts zero), or for the engine's bookkeeping: ``bound = activations + per class``
is a lower bound of the default's time. Printed beside it, measured in the same process, the
default's warm call (``per_class_gradients(..., projection={"dim": k})``). Where ``bound /
floor`` exceeds a target, no implementation of these kernels on this machine meets it.

    .venv/bin/python -m benchmarks.floor_bound --models real --classes 1000
    .venv/bin/python -m benchmarks.floor_bound --models bert,vit --classes 1000 --width 256
    .venv/bin/python -m benchmarks.floor_bound --quick      # two models at C = 200, one pass

Prints a table and writes ``benchmarks/out/floor_bound.json``; asserts nothing. ``batch_bound``
(one batch's bound) is also what ``training_log --parts`` prints beside a logged step's rows.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks import common
from benchmarks.projection_scale import REAL, _floor, build
from classgrad import per_class_gradients
from classgrad.workers.engines.layer_rules.conv import ConvFactors, patches_channels_inner
from classgrad.workers.engines.layer_rules.layer_shapes import shape_for
from classgrad.workers.engines.layer_rules.recurrent_scan import GATES
from classgrad.workers.engines.layer_rules.rule_io import ClassGrid, LayerCapture, Ragged, live_tokens
from classgrad.workers.gradients import build_engine

OUT = common.OUT_DIR / "floor_bound.json"


# Of the layers the default sketches as units (``layer_shapes.shape_for``), those whose per-class
# products are not timed here: embeddings (lookups) count zero.
UNBOUNDED = (nn.Embedding,)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)


def outer_layers(model: nn.Module) -> list[nn.Module]:
    """The Linear and transformers ``Conv1D`` layers (matrices whose gradient is a sum of outer products)."""
    return [m for m in model.modules() if shape_for(m) is not None and not isinstance(m, UNBOUNDED + CONVS)]


def bounded_layers(model: nn.Module) -> list[nn.Module]:
    """Every layer whose per-class work is timed: outer-product layers, zero-padded convolutions
    and single-layer, one-direction recurrent layers."""
    convs = [m for m in model.modules() if isinstance(m, CONVS) and m.padding_mode == "zeros"]
    recurrent = [m for m in model.modules() if isinstance(m, RECURRENT) and m.num_layers == 1 and not m.bidirectional]
    return outer_layers(model) + convs + recurrent


def class_batches(labels: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Sample indices class after class, cut between classes into batches of at most ``batch_size``
    (a class larger than that is a batch of its own)."""
    order = torch.argsort(labels, stable=True)
    sizes = torch.bincount(labels).tolist()
    batches, current, start = [], 0, 0
    for size in sizes:
        if current and current + size > batch_size:
            batches.append(order[start : start + current])
            start, current = start + current, 0
        current += size
    if current:
        batches.append(order[start : start + current])
    return batches


def per_class_seconds(x: torch.Tensor, g: torch.Tensor, tokens: list[int], dim: int) -> float:
    """The cheaper of forming every class's ``g^T x`` and the FFT route's transforms, in seconds."""
    out = x.new_empty(len(tokens), g.shape[1], x.shape[1])
    ragged = Ragged(g, x, tokens, 0)
    t0 = time.perf_counter()
    ragged.per_class_mm(g, x, out)
    formed = time.perf_counter() - t0
    t0 = time.perf_counter()
    spectrum = torch.fft.rfft(g, n=dim, dim=1) * torch.fft.rfft(x, n=dim, dim=1)
    torch.fft.irfft(spectrum[: len(tokens)], n=dim, dim=1)  # one inverse per class
    return min(formed, time.perf_counter() - t0)


def layer_seconds(x: torch.Tensor, g: torch.Tensor, tokens: list[int], dim: int) -> float:
    """``per_class_seconds`` over all tokens, or over only those whose output gradient is not all
    zero (``rule_io.live_tokens``: a decoder's head read at one position, masked keys add nothing;
    picking them is not timed), the less. Classes then have unequal token counts, and the batched
    product one call per count."""
    every = per_class_seconds(x, g, tokens, dim)
    live = live_tokens(g)
    if live is None:
        return every
    kept = Ragged(g, x, tokens, 0).keeping(live)
    return min(every, per_class_seconds(kept.inputs, kept.grads, kept.tokens, dim))


def conv_seconds(module: nn.Module, x: torch.Tensor, g: torch.Tensor, counts: list[int], dim: int) -> float:
    """The cheapest exact per-class weight gradients of a convolution (see the module docstring)."""
    seen = LayerCapture(x, g, ClassGrid.of_counts(torch.tensor(counts), torch.float32))
    times = []
    for route in ("_by_size", "_per_class"):
        t0 = time.perf_counter()
        getattr(ConvFactors(module, seen), route)(True, module.bias is not None)
        times.append(time.perf_counter() - t0)
    if module.groups == 1:
        t0 = time.perf_counter()
        tokens = patches_channels_inner(x, module)
        positions = tokens.shape[1]
        copy = time.perf_counter() - t0
        g_tokens = g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])
        per_class = per_class_seconds(
            tokens.reshape(-1, tokens.shape[2]), g_tokens, [n * positions for n in counts], dim
        )
        times.append(copy + per_class)
    return min(times)


def recurrent_seconds(x: torch.Tensor, states: torch.Tensor, gates: int, counts: list[int], dim: int) -> float:
    """The per-class products of a recurrent layer's two weights' sums over steps (``x`` and
    ``states`` batch-first ``[N, T, ...]``); the gate gradients are stand-ins of their shape."""
    n, steps = x.shape[:2]
    dgi = torch.randn(n * steps, gates * states.shape[2])
    previous = torch.cat([states.new_zeros(n, 1, states.shape[2]), states[:, :-1]], dim=1)
    tokens = [c * steps for c in counts]
    return per_class_seconds(x.reshape(n * steps, -1), dgi, tokens, dim) + per_class_seconds(
        previous.reshape(n * steps, -1), dgi, tokens, dim
    )


def layer_bound(
    module: nn.Module, inputs: torch.Tensor, output: torch.Tensor, g: torch.Tensor, counts: list[int], dim: int
) -> float:
    """Seconds of one layer's per-class work in one batch (``inputs`` and ``output`` as the layer
    saw and gave them, ``g`` the gradient at ``output``, ``counts`` samples per class)."""
    if isinstance(module, CONVS):
        return conv_seconds(module, inputs, g, counts, dim)
    if isinstance(module, RECURRENT):
        x = inputs if module.batch_first else inputs.transpose(0, 1)
        states = output if module.batch_first else output.transpose(0, 1)
        return recurrent_seconds(x, states.detach(), GATES[module.mode], counts, dim)
    per_sample = inputs.numel() // (sum(counts) * inputs.shape[-1])
    x2, g2 = inputs.reshape(-1, inputs.shape[-1]), g.reshape(-1, g.shape[-1])
    return layer_seconds(x2, g2, [n * per_sample for n in counts], dim)


def batch_bound(
    layers: list[nn.Module], batch_loss: Callable[[], torch.Tensor], counts: list[int], dim: int
) -> dict[str, float]:
    """Seconds of one batch's activations pass (``batch_loss()``: the forward and its loss, then
    the backward to every output of ``layers``) and of its per-class work; the batch's samples
    class after class, ``counts`` samples each."""
    seen: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []

    def keep(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        out = output[0] if isinstance(module, RECURRENT) else output
        seen.append((module, args[0].detach(), out))

    hooks = [m.register_forward_hook(keep) for m in layers]
    try:
        t0 = time.perf_counter()
        loss = batch_loss()
        grads = torch.autograd.grad(loss, [o for _, _, o in seen], allow_unused=True)
        activations = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    per_class = 0.0
    with torch.no_grad():
        for (module, inputs, output), g in zip(seen, grads):
            if g is not None:
                per_class += layer_bound(module, inputs, output, g, counts, dim)
    return {"activations_s": activations, "per_class_s": per_class}


def bound(model: nn.Module, samples: Any, classes: int, dim: int, batch_size: int) -> dict[str, float]:
    """Seconds of the activations pass and of the per-class work, over the whole probe set."""
    eng = build_engine(model, samples, num_classes=classes, batch_size=batch_size)
    layers = bounded_layers(model)
    activations = per_class = 0.0
    for idx in class_batches(eng.probe.targets.long(), batch_size):
        counts = torch.bincount(eng.probe.targets[idx].long())

        def batch_loss(idx: torch.Tensor = idx) -> torch.Tensor:  # reading the batch counts, as in the floor
            x, y = eng.probe.batch(idx, eng.device, eng.compute_dtype)
            return eng.loss.batch_losses(eng.io(x), eng.loss.labels(y), eng.norm).sum()

        found = batch_bound(layers, batch_loss, counts[counts > 0].tolist(), dim)
        activations += found["activations_s"]
        per_class += found["per_class_s"]
    return {"activations_s": activations, "per_class_s": per_class}


def measure(name: str, classes: int, dim: int, batch_size: int, width: int | None, repeat: int) -> dict[str, Any]:
    model, samples, _ = build(name, classes, width)
    kw = {"num_classes": classes, "batch_size": batch_size, "projection": {"dim": dim}, "progress": False}
    per_class_gradients(model, samples, **kw)  # the first call's one-off work is not what is bounded
    floors, bounds, warms = [], [], []
    for _ in range(repeat):  # alternated: a VM whose load moves within the run moves all three alike
        floors.append(_floor(model, samples, classes, dim, batch_size))
        bounds.append(bound(model, samples, classes, dim, batch_size))
        t0 = time.perf_counter()
        per_class_gradients(model, samples, **kw)
        warms.append(time.perf_counter() - t0)
    best = min(bounds, key=lambda b: b["activations_s"] + b["per_class_s"])
    return {
        "model": name, "classes": classes, "width": width, "layers": len(bounded_layers(model)),
        "floor_s": min(floors), **best, "bound_s": best["activations_s"] + best["per_class_s"], "default_s": min(warms),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="real", help="comma list; 'real' = the seven real models")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, help="hidden size of the real models (default: real_model_cases.WIDTH)")
    parser.add_argument("--repeat", type=int, default=3, help="floors, bounds, default calls alternated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="bert and ln_mlp at C = 200, one pass (make bench)")
    args = parser.parse_args()
    if args.quick:
        args.models, args.classes, args.repeat = "bert,ln_mlp", 200, 1
    torch.set_num_threads(args.threads)
    names = list(REAL) if args.models == "real" else args.models.split(",")
    results, rows = [], []
    for name in names:
        r = measure(name, args.classes, args.dim, args.batch_size, args.width, args.repeat)
        results.append(r)
        f = r["floor_s"]
        rows.append([
            name, r["layers"], f"{f:.3f}", f"{r['activations_s'] / f:.2f}", f"{r['per_class_s'] / f:.2f}",
            f"{r['bound_s'] / f:.2f}x", f"{r['default_s'] / f:.2f}x", f"{r['default_s'] / r['bound_s']:.2f}",
        ])  # fmt: skip
    headers = ["model", "layers", "floor s", "activations", "per class", "bound", "default warm", "default / bound"]
    print(f"C = {args.classes}, k = {args.dim}, best of {args.repeat}; columns 4-7 over the floor")
    common.print_table(headers, rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()

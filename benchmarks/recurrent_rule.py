"""Speed of the recurrent-layer rule against the per-class autograd loop on the layer alone (not a test).

Holds ``main``: for each of LSTM, GRU and RNN (``C`` classes of 1 to 4 sequences, ``T`` steps,
``H`` hidden units, ``L`` layers), times ``recurrent_class_grads`` (as the engine calls it,
``method="auto"``, and with each method forced: torch's kernel fed ``gi``, the unrolled cells),
the per-class loop (one forward and ``torch.autograd.grad`` of the layer per class), and the floor
(one forward and backward of the layer over all samples at once), round robin, and prints the
times, the ratios, and the rule's largest relative error against the loop.

    python -m benchmarks.recurrent_rule [--classes 200] [--steps 32] [--hidden 64] [--layers 2]
        [--packed] [--bidirectional] [--device cpu] [--reps 3]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from benchmarks import common
from benchmarks.common import interleaved, machine_info, set_clock
from classgrad.workers.engines.layer_rules import ClassGrid, recurrent_class_grads


def _module(mode: str, args: argparse.Namespace) -> nn.RNNBase:
    torch.manual_seed(0)
    kinds = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}
    opts = {"num_layers": args.layers, "batch_first": True, "bidirectional": args.bidirectional}
    return kinds[mode](args.hidden, args.hidden, **opts).to(args.device).eval()


def _inputs(module: nn.RNNBase, sizes: list[int], args: argparse.Namespace):
    gen = torch.Generator().manual_seed(1)
    n = sum(sizes)
    x = torch.randn(n, args.steps, args.hidden, generator=gen).to(args.device)
    lengths = torch.randint(args.steps // 2, args.steps + 1, (n,), generator=gen) if args.packed else None
    inp = x if lengths is None else pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    with torch.no_grad():
        out, hidden = module(inp)
    data = out.data if isinstance(out, PackedSequence) else out
    g_out = torch.randn(data.shape, generator=gen).to(args.device)
    g_h = (
        tuple(torch.randn(h.shape, generator=gen).to(args.device) for h in hidden)
        if isinstance(hidden, tuple)
        else None
    )
    g_hidden = g_h if g_h is not None else torch.randn(hidden.shape, generator=gen).to(args.device)
    return x, lengths, inp, (g_out, g_hidden)


def _loop(module: nn.RNNBase, x, lengths, grads, sizes: list[int]) -> torch.Tensor:
    """The per-class loop: each class's samples through the layer, then one ``autograd.grad``."""
    params = list(module.parameters())
    g_out, g_hidden = grads
    rows, start = [], 0
    if lengths is not None:  # the packed gradient laid out by sample, to cut per class
        g_out = torch.nn.utils.rnn.pad_packed_sequence(
            PackedSequence(g_out, *pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)[1:]),
            batch_first=True,
            total_length=x.shape[1],
        )[0]
    for size in sizes:
        sl = slice(start, start + size)
        if lengths is None:
            out, hidden = module(x[sl])
            g_o = g_out[sl]
        else:
            inp = pack_padded_sequence(x[sl], lengths[sl], batch_first=True, enforce_sorted=False)
            out, hidden = module(inp)
            g_o = pack_padded_sequence(g_out[sl], lengths[sl], batch_first=True, enforce_sorted=False).data
            out = out.data
        states = list(hidden) if isinstance(hidden, tuple) else [hidden]
        g_states = list(g_hidden) if isinstance(g_hidden, tuple) else [g_hidden]
        found = torch.autograd.grad([out, *states], params, [g_o, *(g[:, sl] for g in g_states)])
        rows.append(torch.cat([g.reshape(-1) for g in found]))
        start += size
    return torch.stack(rows)


def _measure(mode: str, args: argparse.Namespace, sizes: list[int], grid: ClassGrid) -> dict:
    """Times the rule, the loop and the floor on one layer type; returns the record to print."""
    module = _module(mode, args)
    x, lengths, inp, grads = _inputs(module, sizes, args)
    kinds = [n for n, _ in module.named_parameters()]
    params = list(module.parameters())
    held: dict[str, torch.Tensor] = {}

    def rule(method: str):
        def run() -> None:
            got = recurrent_class_grads(module, (inp,), {}, grads, grid, kinds, method=method)
            held[method] = torch.cat([got[n].reshape(len(sizes), -1) for n in kinds], dim=1)

        return run

    def loop() -> None:
        held["loop"] = _loop(module, x, lengths, grads, sizes)

    def floor() -> None:
        out, hidden = module(inp)
        out = out.data if isinstance(out, PackedSequence) else out
        states = list(hidden) if isinstance(hidden, tuple) else [hidden]
        g_out, g_hidden = grads
        g_states = list(g_hidden) if isinstance(g_hidden, tuple) else [g_hidden]
        torch.autograd.grad([out, *states], params, [g_out, *g_states])

    times = interleaved(
        {
            "rule": rule("auto"),
            "rule_native": rule("native"),
            "rule_unrolled": rule("unrolled"),
            "loop": loop,
            "floor": floor,
        },
        args.reps,
        args.device,
    )
    ref = held["loop"].double()
    err = {
        m: float(((held[m].double() - ref).norm(dim=1) / ref.norm(dim=1)).max()) for m in ("auto", "native", "unrolled")
    }
    best = {name: t.best for name, t in times.items()}
    return {
        "mode": mode,
        "seconds_best": {k: round(v, 4) for k, v in best.items()},
        "loop_over_rule": round(best["loop"] / best["rule"], 2),
        "rule_over_floor": round(best["rule"] / best["floor"], 2),
        "loop_over_rule_native": round(best["loop"] / best["rule_native"], 2),
        "loop_over_rule_unrolled": round(best["loop"] / best["rule_unrolled"], 2),
        "max_rel_err_vs_loop": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", type=int, default=200)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--packed", action="store_true", help="packed sequences of lengths T/2 to T")
    ap.add_argument("--bidirectional", action="store_true")
    ap.add_argument("--modes", default="LSTM,GRU,RNN")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    set_clock("auto", args.device, args.threads)
    sizes = torch.randint(1, 5, (args.classes,), generator=torch.Generator().manual_seed(2)).tolist()
    grid = ClassGrid.of_counts(torch.tensor(sizes, device=args.device), torch.float32)
    print(json.dumps({**machine_info(), "clock": common.CLOCK_NAME, "args": vars(args), "samples": sum(sizes)}))
    for mode in args.modes.split(","):
        print(json.dumps(_measure(mode, args, sizes, grid)))


if __name__ == "__main__":
    main()

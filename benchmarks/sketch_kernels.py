"""The kernels behind two fixed rules of the default projection (issue 24's second pass), timed.

- ``--section sign``: a sparse sign map (``projection.sketch.SignedMap``) applied as indexed adds
  along the columns (the CPU's route; the signs folded into the index, and multiplied into the
  values, which ``sketch.SIGNED_VALUES_WIDTH`` picks for rows at most that many times ``dim``
  wide) against the cached CSR product (the route of devices whose adds are unordered), for rows
  x coordinates the engines send it; ms, best of ``--reps``.
- ``--section conv``: a convolution's per-class weight gradients (128 or 32 classes of 2
  samples) by a grouped backward (channels-last and NCHW), one backward per class, and patches
  with one batched product (the ``tokens`` route): where ``conv.FEW_POSITIONS`` comes from.
- ``--section sizes``: a convolution's per-class weight gradients for classes of 1 to 4 samples
  (a run of 100 classes; HF ResNet's layers at hidden 64 up to a ResNet-18 layer) by one backward
  per class against ``ConvFactors._by_size`` (one grouped backward per class size), each run
  with new class sizes: group counts as they come (a new kernel shape nearly every run) or
  rounded up to ``conv.GROUPS_STEP`` (shapes that recur); median ms over the runs.
- ``--section patches``: every output position's input patch for 256 samples, by ``F.unfold``
  (im2col, then a transpose to tokens), by ``conv.patches`` (``Tensor.unfold`` windows) and by
  ``conv.patches_channels_inner`` (the windows of a channels-last copy: what sketched sums take).
- ``--section mm``: per-class products over ragged token slices (``Ragged.per_class_mm``: one
  batched product per token count) against one product per class.
- ``--section route``: the three unit costs of ``sketch_sums.ROUTE_COST`` measured here (seconds
  per rfft column at k = 4,096, per signed addition of a sparse sign map, per multiply-add of a
  batched product) beside the table's.
- ``--section layout``: ``ConvFactors._grouped`` over 248 classes of one sample (channels-last
  inputs, adjacent as a run ordered by size hands them) in NCHW and in channels-last layout, 3x3
  layers of 8x8 to 32x32 positions: where ``conv.LAYOUT_POSITIONS`` comes from; ms, best of ``--reps``.
- ``--section spectra``: ``ChunkedSketchUnit.token_spectra`` of 256 tokens of a head of several
  row chunks of ``dim`` 4,096, one chunk at a time (the CPU's route) against the chunks batched
  (a GPU's route, ``chunked_sketch.SPECTRA_BYTES``), both on this CPU.

    .venv/bin/python -m benchmarks.sketch_kernels --section sign
    .venv/bin/python -m benchmarks.sketch_kernels --section conv
    .venv/bin/python -m benchmarks.sketch_kernels --section sizes
    .venv/bin/python -m benchmarks.sketch_kernels --section patches
    .venv/bin/python -m benchmarks.sketch_kernels --section mm
    .venv/bin/python -m benchmarks.sketch_kernels --section route
    .venv/bin/python -m benchmarks.sketch_kernels --section spectra
    .venv/bin/python -m benchmarks.sketch_kernels --section layout

Prints tables (2 threads unless ``--threads``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import print_table
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.layer_rules import conv as conv_module
from classgrad.workers.engines.layer_rules.conv import (
    ConvFactors,
    grouped_channels_last,
    patches,
    patches_channels_inner,
)
from classgrad.workers.engines.layer_rules.rule_io import ClassGrid, LayerCapture, Ragged, routes_as
from classgrad.workers.projection.sketch import row_sketch as sketch_module
from classgrad.workers.projection.sketch.row_sketch import SparseSignSketch
from classgrad.workers.projection.tensorsketch.chunked_sketch import ChunkedSketchUnit
from classgrad.workers.projection.tensorsketch.tensorsketch_sums import ROUTE_COST

SIGN_CASES = [
    (1, 8, 300_000), (1, 128, 300_000), (1, 8, 2_000_000), (4, 64, 300_000), (4, 256, 20_000),
    (1, 254, 257), (1, 254, 2_304), (1, 254, 10_000), (1, 127, 16_640), (1, 127, 36_928), (4, 254, 2_208),
]  # fmt: skip
# (name, cin, cout, kernel, stride, padding, input side, classes)
CONV_CASES = [
    ("1 position, 512 ch", 512, 512, 3, 1, 1, 1, 32),
    ("4 positions, 64 ch", 64, 64, 3, 1, 1, 2, 128),
    ("16 positions, 128 ch", 128, 128, 3, 1, 1, 4, 32),
    ("64 positions, 64 ch", 64, 64, 3, 1, 1, 8, 8),
    ("256 positions, 3 -> 16 ch, 7x7 s2", 3, 16, 7, 2, 3, 32, 128),
]
# (name, cin, cout, kernel, stride, padding, input side) for --section sizes
SIZE_CASES = [
    ("HF ResNet stem, 3 -> 16 ch, 7x7 s2, 32 px", 3, 16, 7, 2, 3, 32),
    ("HF ResNet, 16 ch, 3x3, 8 px", 16, 16, 3, 1, 1, 8),
    ("32 ch, 3x3, 16 px", 32, 32, 3, 1, 1, 16),
    ("64 ch, 3x3, 16 px", 64, 64, 3, 1, 1, 16),
    ("64 ch, 3x3, 28 px", 64, 64, 3, 1, 1, 28),
    ("ResNet-18, 64 ch, 3x3, 56 px", 64, 64, 3, 1, 1, 56),
]

# (cin, kernel, stride, padding, input side): a small ResNet's convolutions at 32 px
PATCH_CASES = [
    (3, 7, 2, 3, 32), (16, 3, 1, 1, 8), (32, 3, 1, 1, 4), (64, 3, 1, 1, 2), (64, 3, 2, 1, 2), (256, 3, 1, 1, 1)
]  # fmt: skip
# (classes, tokens per sample, rows, cols): BERT-sized layers, classes of 1 to 4 samples
MM_CASES = [(62, 16, 64, 65), (62, 16, 128, 65), (62, 17, 64, 129), (200, 16, 64, 65)]
# (head rows, its input features with the bias): 2, 3 and 25 row chunks of dim 4,096
SPECTRA_CASES = [(8_000, 257), (10_000, 129), (100_000, 257)]


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def sign_times(s: int, n: int, width: int, reps: int) -> tuple[float, float, float | None]:
    """(CSR product ms, folded indexed adds ms, signed-values adds ms or None where the width
    is past ``SIGNED_VALUES_WIDTH``) of one map on ``[n, width]`` rows."""
    rows = torch.randn(n, width)
    maps = [SparseSignSketch(width, 4096, nonzeros=s, seed=1) for _ in range(3)]
    saved = sketch_module.ORDERED_ADD_DEVICES, sketch_module.SIGNED_VALUES_WIDTH
    try:
        sketch_module.ORDERED_ADD_DEVICES = ()  # the CSR route, forced on this CPU
        csr = best_ms(lambda: maps[0].project(rows), reps)
        sketch_module.ORDERED_ADD_DEVICES, sketch_module.SIGNED_VALUES_WIDTH = saved[0], 0  # folded, forced
        folded = best_ms(lambda: maps[1].project(rows), reps)
    finally:
        sketch_module.ORDERED_ADD_DEVICES, sketch_module.SIGNED_VALUES_WIDTH = saved
    signed = best_ms(lambda: maps[2].project(rows), reps) if width <= saved[1] * 4096 else None
    return csr, folded, signed


def conv_times(cin: int, cout: int, ks: int, st: int, pd: int, side: int, k: int, reps: int) -> tuple[int, list[float]]:
    """(output positions, ms of: grouped channels-last, grouped NCHW, per class, tokens)."""
    m = 2
    conv = torch.nn.Conv2d(cin, cout, ks, stride=st, padding=pd)
    A = torch.randn(k, m, cin, side, side)
    G = torch.randn(k, m, cout, *conv(A[0]).shape[2:])
    positions = G.shape[3] * G.shape[4]

    def backward(g: torch.Tensor, a: torch.Tensor, groups: int) -> torch.Tensor:
        w = g.new_zeros(()).expand(cout * groups, cin, ks, ks)  # only its shape is read
        args = ([cout * groups], (st, st), (pd, pd), (1, 1), False, [0, 0], groups, [False, True, False])
        return torch.ops.aten.convolution_backward(g, a, w, *args)[1]

    def grouped_cl() -> torch.Tensor:
        return backward(grouped_channels_last(G), grouped_channels_last(A), k)

    def nchw() -> torch.Tensor:
        gg = G.transpose(0, 1).reshape(m, k * cout, *G.shape[3:])
        return backward(gg, A.transpose(0, 1).reshape(m, k * cin, side, side), k)

    def per_class() -> list[torch.Tensor]:
        return [backward(G[i], A[i], 1) for i in range(k)]

    def tokens() -> torch.Tensor:
        P = patches(A.reshape(k * m, cin, side, side), conv).reshape(k, m * positions, -1)  # [k, tokens, cin kernel]
        Gt = G.reshape(k, m, cout, -1).permute(0, 1, 3, 2).reshape(k, m * positions, cout)
        return torch.bmm(Gt.transpose(1, 2), P)

    return positions, [best_ms(f, reps) for f in (grouped_cl, nchw, per_class, tokens)]


def _work(cin: int, cout: int, ks: int, st: int, pd: int, side: int) -> int:
    out = (side + 2 * pd - ks) // st + 1
    return out * out * cin * ks * ks * cout


def _by_size(conv: torch.nn.Conv2d, seen: LayerCapture, step: int) -> None:
    """``ConvFactors._by_size`` with group counts rounded up to ``step``."""
    saved, conv_module.GROUPS_STEP = conv_module.GROUPS_STEP, step
    try:
        ConvFactors(conv, seen)._by_size(True, True)
    finally:
        conv_module.GROUPS_STEP = saved


def size_times(cin: int, cout: int, ks: int, st: int, pd: int, side: int, runs: int) -> list[float]:
    """Median ms over ``runs`` runs of 100 classes of 1 to 4 samples (new sizes each run) of: one
    backward per class, ``_by_size`` with group counts as they come, and with ``GROUPS_STEP``."""
    conv = torch.nn.Conv2d(cin, cout, ks, stride=st, padding=pd)
    times: list[list[float]] = [[], [], []]
    for run in range(runs):
        counts = torch.randint(1, 5, (100,), generator=torch.Generator().manual_seed(run))
        x = torch.randn(int(counts.sum()), cin, side, side)
        with torch.no_grad():
            g = torch.randn_like(conv(x))
        seen = LayerCapture(x, g, ClassGrid.of_counts(counts, torch.float32))
        routes = [
            functools.partial(ConvFactors(conv, seen)._per_class, True, True),
            functools.partial(_by_size, conv, seen, 1),
            functools.partial(_by_size, conv, seen, conv_module.GROUPS_STEP),
        ]
        for slot, route in enumerate(routes):
            t0 = time.perf_counter()
            route()
            times[slot].append(1e3 * (time.perf_counter() - t0))
    return [statistics.median(t) for t in times]


def patch_times(cin: int, ks: int, st: int, pd: int, side: int, reps: int) -> tuple[str, float, float, float]:
    """(patch shape, ms of ``F.unfold`` to tokens, of ``conv.patches``, of
    ``conv.patches_channels_inner``) for 256 samples."""
    conv = torch.nn.Conv2d(cin, 1, ks, stride=st, padding=pd)
    x = torch.randn(256, cin, side, side)

    def im2col() -> torch.Tensor:
        return F.unfold(x, ks, 1, pd, st).transpose(1, 2).contiguous()

    def windows() -> torch.Tensor:
        return patches(x, conv)

    def channels_inner() -> torch.Tensor:
        return patches_channels_inner(x, conv)

    assert torch.equal(im2col(), windows())  # the same entries, moved: no arithmetic
    shape = "x".join(map(str, windows().shape[1:]))
    return shape, best_ms(im2col, reps), best_ms(windows, reps), best_ms(channels_inner, reps)


def mm_times(k: int, per_sample: int, rows: int, cols: int, reps: int) -> tuple[float, float]:
    """(ms of a product per class, ms of ``Ragged.per_class_mm``)."""
    counts = torch.randint(1, 5, (k,), generator=torch.Generator().manual_seed(0))
    tokens = (counts * per_sample).tolist()
    first, second = torch.randn(sum(tokens), rows), torch.randn(sum(tokens), cols)
    out = torch.empty(k, rows, cols)
    ragged = Ragged(first, second, tokens, per_sample)
    bounds = torch.cumsum(torch.tensor([0, *tokens]), 0).tolist()

    def per_class() -> None:
        for i in range(k):
            a, b = first[bounds[i] : bounds[i + 1]], second[bounds[i] : bounds[i + 1]]
            torch.mm(a.t(), b, out=out[i])

    return best_ms(per_class, reps), best_ms(lambda: ragged.per_class_mm(first, second, out), reps)


def route_costs(reps: int) -> dict[str, float]:
    """Seconds per unit of ``ROUTE_COST``'s three kinds of work, measured on this machine."""
    tokens, dim = 512, 4096
    x = torch.randn(tokens, dim)
    fft_column = best_ms(lambda: torch.fft.rfft(x, dim=1), reps) / 1e3 / (tokens * dim)
    rows = torch.randn(128, 36_864)
    sk = SparseSignSketch(36_864, dim, nonzeros=1, seed=1)
    scatter = best_ms(lambda: sk.project(rows), reps) / 1e3 / rows.numel()
    a, b = torch.randn(128, 64, 32), torch.randn(128, 32, 577)  # a few-position convolution's products
    mac = best_ms(lambda: torch.bmm(a, b), reps) / 1e3 / (128 * 64 * 32 * 577)
    return {"fft_column": fft_column, "scatter": scatter, "mac": mac}


# (cin, cout, side) for --section layout: 3x3, padding 1
LAYOUT_CASES = [
    (3, 32, 32),
    (8, 32, 32),
    (16, 32, 32),
    (32, 32, 32),
    (8, 8, 32),
    (3, 32, 16),
    (16, 64, 16),
    (32, 64, 16),
    (64, 64, 8),
]


def layout_times(cin: int, cout: int, side: int, reps: int) -> tuple[float, float]:
    """(ms NCHW, ms channels-last) of ``ConvFactors._grouped`` for 248 classes of one sample."""
    conv = torch.nn.Conv2d(cin, cout, 3, padding=1)
    last = torch.channels_last
    x = torch.randn(248, cin, side, side).contiguous(memory_format=last)
    g = torch.randn(248, cout, side, side).contiguous(memory_format=last)
    factors = ConvFactors(
        conv, LayerCapture(x, g, ClassGrid.of_counts(torch.ones(248, dtype=torch.long), torch.float32))
    )
    G, A = g.view(248, 1, *g.shape[1:]), x.view(248, 1, *x.shape[1:])
    nchw = best_ms(lambda: factors._grouped("contiguous", G, A, True, True), reps)
    return nchw, best_ms(lambda: factors._grouped("channels_last", G, A, True, True), reps)


def spectra_times(rows: int, cols: int, reps: int) -> tuple[float, float]:
    """(ms one row chunk at a time, ms batched) of ``token_spectra`` for 256 tokens."""
    unit = ChunkedSketchUnit(0, ParamSlot("w", (rows, cols), 0, rows * cols), None, rows, cols, False, 4096, 3)
    g, x = torch.randn(256, rows), torch.randn(256, cols)

    def batched() -> None:
        with routes_as("cuda"):  # the chunks' grouping a GPU takes, on these CPU tensors
            unit.token_spectra(g, x)

    return best_ms(lambda: unit.token_spectra(g, x), reps), best_ms(batched, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sections = ["sign", "conv", "sizes", "patches", "mm", "route", "spectra", "layout"]
    parser.add_argument("--section", choices=sections, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.section == "sign":
        rows = []
        for s, n, width in SIGN_CASES:
            csr, folded, signed = sign_times(s, n, width, args.reps)
            rows.append(
                [s, f"{n} x {width:,}", f"{csr:.2f}", f"{folded:.2f}", "-" if signed is None else f"{signed:.2f}"]
            )
        print_table(
            ["s", "rows x coordinates", "CSR product ms", "adds, signs in index ms", "adds, signed values ms"], rows
        )
    elif args.section == "patches":
        rows = []
        for cin, ks, st, pd, side in PATCH_CASES:
            shape, unfold, windows, inner = patch_times(cin, ks, st, pd, side, args.reps)
            case = f"{cin} x {side}x{side}, {ks}x{ks} stride {st}"
            rows.append([case, shape, f"{unfold:.2f}", f"{windows:.2f}", f"{inner:.2f}"])
        headers = ["input, kernel", "positions x features", "F.unfold ms", "conv.patches ms", "channels inner ms"]
        print_table(headers, rows)
    elif args.section == "sizes":
        rows = [[name, *(f"{t:.1f}" for t in size_times(*shape, 2 * args.reps + 1))] for name, *shape in SIZE_CASES]
        headers = ["layer (100 classes of 1-4 samples)", "per class ms", "by size ms", "by size, GROUPS_STEP ms"]
        # the multiply-adds per sample that conv.SMALL_WORK compares
        rows = [[*row[:1], f"{_work(*shape) / 1e6:.2f}M", *row[1:]] for row, (_, *shape) in zip(rows, SIZE_CASES)]
        headers.insert(1, "multiply-adds per sample")
        print_table(headers, rows)
    elif args.section == "route":
        table = ROUTE_COST["cpu"]
        found = route_costs(args.reps)
        rows = [[k, f"{table[k]:.2e}", f"{found[k]:.2e}", f"{found[k] / table[k]:.2f}"] for k in table]
        print_table(["unit cost", "ROUTE_COST s", "measured s", "measured / table"], rows)
    elif args.section == "spectra":
        rows = []
        for r, c in SPECTRA_CASES:
            one, batched = spectra_times(r, c, args.reps)
            rows.append([f"{r:,} x {c}", -(-r // 4096), f"{one:.2f}", f"{batched:.2f}", f"{batched / one:.2f}"])
        print_table(["head", "row chunks", "a chunk at a time ms", "batched ms", "batched / one"], rows)
    elif args.section == "layout":
        rows = []
        for cin, cout, side in LAYOUT_CASES:
            nchw, cl = layout_times(cin, cout, side, args.reps)
            rows.append([f"{cin} -> {cout}, {side}x{side}", f"{nchw:.1f}", f"{cl:.1f}", f"{cl / nchw:.2f}"])
        print_table(["3x3 layer, 248 classes of 1 sample", "NCHW ms", "channels-last ms", "channels-last / NCHW"], rows)
    elif args.section == "mm":
        rows = []
        for k, per_sample, r, c in MM_CASES:
            loop, grouped = mm_times(k, per_sample, r, c, args.reps)
            rows.append([k, per_sample, f"{r} x {c}", f"{loop:.2f}", f"{grouped:.2f}"])
        print_table(["classes", "tokens per sample", "matrix", "per class ms", "per token count ms"], rows)
    else:
        rows = []
        for name, *shape, k in CONV_CASES:
            positions, times = conv_times(*shape, k, args.reps)
            rows.append([name, positions, k, *(f"{t:.1f}" for t in times)])
        headers = ["layer", "positions", "classes", "grouped CL ms", "grouped NCHW ms", "per class ms", "tokens ms"]
        print_table(headers, rows)


if __name__ == "__main__":
    main()

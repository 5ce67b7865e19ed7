"""The layer rule for ``nn.Conv1d/2d/3d``: per-class weight and bias gradients from one grouped
convolution backward, with the run's classes as groups.

Holds ``ConvFactors`` (the layer's outer-product factors: one token per output position, the
input patch as its input factor; ``direct_sums`` is the fast kernel), ``conv_sums`` (registered
for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``), ``zero_padding`` (when it applies: zero
padding given as numbers; grouped, strided and dilated convolutions are fine), ``patches``
(every output position's input patch, any number of spatial dimensions) and
``patches_channels_inner`` (the same features in the order cheapest to copy, for sketched sums).

Which kernel forms the sums is a fixed rule (``conv_route``), never a timing: every actor of a
job, every resume and ``per_class_gradients`` then compute a row with the same kernel (on a GPU
kernels of other layouts may differ in more than rounding: TF32 or not), and a first call
measures nothing. On a CPU, a layer with few output positions per sample (``FEW_POSITIONS``)
forms its sums from patches (``tokens``: one batched product); else, with classes of unequal
size in the run, unpadded (no products of padded zeros): a small layer (``SMALL_WORK``) by one
grouped backward per class size (channels-last from ``LAYOUT_POSITIONS`` output positions a
sample, NCHW below: ``by_size_layout``), a larger one by a plain backward per class (like the other
outer-product layers' CPU route); else one grouped backward in
the memory format the layer's input comes in (channels-last inputs, the partitioned engine's
for convolutional models: what tensor cores take, and measured about twice as fast on a CPU as
NCHW; on an AMD EPYC without AVX-512 it was slower than NCHW at 4 of 5 shapes of
``benchmarks.sketch_kernels --section conv``: not changed, the layout being a rule, not a
measurement).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from classgrad.workers.engines import host_device
from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.engines.layer_rules.outer import OuterFactors, class_outer_sums
from classgrad.workers.engines.layer_rules.registry import register_rule
from classgrad.workers.engines.layer_rules.rule_io import LayerCapture, LayerRows

ConvNd = nn.Conv1d | nn.Conv2d | nn.Conv3d


def zero_padding(module: ConvNd) -> str | None:
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return f"padding {module.padding!r} in mode {module.padding_mode!r}"
    return None


# Output positions per sample at or below which a CPU forms the sums from patches (one batched
# product, ``tokens``) instead of a convolution kernel: there the grouped backward's cost per group
# dominates. `python -m benchmarks.sketch_kernels --section conv` (2-core CPU, 3x3 convolutions,
# 2 samples per class; grouped NCHW / per class / tokens): 1 position, 512 channels, 32 classes:
# 4.7 s / 886 ms / 247 ms; 4 positions, 64 channels: 38 / 44 / 7.6 ms; 16 positions, 128
# channels: 43 / 20 / 9.2 ms; at 64 positions the grouped kernel is faster (1.4 against 3.5 ms).
FEW_POSITIONS = 16

# Classes of unequal size on a CPU: weight-gradient multiply-adds per sample at or below which
# one grouped backward per class size (``by_size``) is faster than one backward per class (a
# kernel call's overhead is then much of a class's cost); above it, slower. `python -m
# benchmarks.sketch_kernels --section sizes` (2-core AMD EPYC, 100 classes of 1-4 samples; per
# class / by size ms): 0.15M multiply-adds 22.8 / 5.0; 0.6M 30.8 / 20.5; 2.4M 41.1 / 27.1; 9.4M
# 103.1 / 91.1; 29M 246.9 / 320.7; 116M 977.6 / 1,691.5. On a 2-core Intel Xeon the two cross at
# 9.4M (34.5 / 33.4 ms; 2.4M: 17.9 / 11.2; 29M: 75.8 / 116.3).
SMALL_WORK = 10_000_000

# ``by_size``'s group counts are multiples of this (see ``ConvFactors._by_size``).
GROUPS_STEP = 8


# ``by_size``'s grouped backward in channels-last layout where a sample has at least this many
# output positions, else in NCHW (channels-last inputs; NCHW ones stay NCHW). `python -m
# benchmarks.sketch_kernels --section layout` (2-core Intel Xeon, 248 classes of one sample, 3x3;
# channels-last over NCHW): 0.44 to 0.80 at 32x32 from 3 to 32 input channels (1.22 for an 8 -> 8
# layer of 4 ms); 0.74 to 1.59 at 16x16; 1.45 at 8x8.
LAYOUT_POSITIONS = 1024


def by_size_layout(inputs: torch.Tensor, grads: torch.Tensor) -> str:
    """``by_size``'s layout: see ``LAYOUT_POSITIONS``."""
    last = inputs.dim() == 4 and inputs.is_contiguous(memory_format=torch.channels_last)
    return "channels_last" if last and math.prod(grads.shape[2:]) >= LAYOUT_POSITIONS else "contiguous"


def conv_route(module: ConvNd, seen: LayerCapture) -> str:
    """The kernel of a run's per-class weight gradients (see the module docstring): ``tokens``
    (patches and one batched product), ``by_size`` (classes of unequal size, small layers: a
    grouped backward per class size), ``per_class`` (unequal size, larger layers), or one
    grouped backward in ``channels_last`` or ``contiguous`` layout."""
    on_cpu = rule_io.cpu_routes(seen.grads.device)
    positions = math.prod(seen.grads.shape[2:])
    if on_cpu and positions <= FEW_POSITIONS:
        return "tokens"
    if on_cpu and seen.grid.spots is not None:
        work = positions * module.weight[0].numel() * module.out_channels  # per sample
        return "by_size" if work <= SMALL_WORK else "per_class"
    x = seen.inputs
    return "channels_last" if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) else "contiguous"


def grouped_channels_last(t: torch.Tensor) -> torch.Tensor:
    """``[k, m, c, *spatial]`` -> ``[m, k*c, *spatial]`` (class k's channels as group k) with the
    channels innermost in memory, in one copy: the grouped convolution backward is about twice
    as fast on a CPU in that layout (channels-last) as in NCHW, and faster than the plain one."""
    k, m, c = t.shape[:3]
    spatial = t.shape[3:]
    n = len(spatial)
    inner = t.permute(1, *range(3, 3 + n), 0, 2).contiguous().view(m, *spatial, k * c)
    return inner.permute(0, n + 1, *range(1, n + 1))


def patches(x: torch.Tensor, module: ConvNd) -> torch.Tensor:
    """``[b, cin, *spatial]`` -> ``[b, positions, cin * prod(kernel)]``: the input patch of every
    output position, token-major (what the batched products take, no transpose after), its
    features channel-major then kernel offsets (``F.unfold``'s order, any dimension).

    Windows by ``Tensor.unfold`` and one copy: ``F.unfold`` (im2col) was 1.4-38x slower on a CPU
    at a ResNet's shapes (256 channels at 1 position: 3.4 ms against 0.1 ms for 256 samples;
    ``python -m benchmarks.sketch_kernels --section patches``)."""
    assert not isinstance(module.padding, str)  # zero_padding: the rule takes numeric padding only
    n = x.dim() - 2
    pad = [p for d in reversed(range(n)) for p in (module.padding[d], module.padding[d])]
    t = F.pad(x, pad) if any(pad) else x
    for d in range(n):  # windows along each spatial dimension, dilated by keeping every d-th entry
        size, dil = module.kernel_size[d], module.dilation[d]
        t = t.unfold(2 + d, (size - 1) * dil + 1, module.stride[d])[..., ::dil]
    # [b, cin, *out, *kernel] -> [b, *out, cin, *kernel]
    t = t.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
    return t.reshape(x.shape[0], t.shape[1 : 1 + n].numel(), -1)


def patches_channels_inner(x: torch.Tensor, module: ConvNd) -> torch.Tensor:
    """``patches`` with each patch's features kernel-offset-major, channels innermost
    (``[b, positions, prod(kernel) * cin]``; ``SketchUnit.column_order`` gives each feature's
    weight column).

    The windows of a channels-last copy of ``x`` keep a run of ``kernel[-1] * cin`` contiguous
    floats, which the one copy moves 5-13x faster than the weight order's runs of one kernel row
    (``python -m benchmarks.sketch_kernels --section patches``): for sums that only go into a
    sketch, whose hash can follow any column order, the order is free."""
    assert not isinstance(module.padding, str)
    n = x.dim() - 2
    pad = [p for d in reversed(range(n)) for p in (module.padding[d], module.padding[d])]
    t = x.movedim(1, -1).contiguous()  # a view when x is channels-last already
    if any(pad):
        t = F.pad(t, [0, 0, *pad])
    for d in range(n):
        size, dil = module.kernel_size[d], module.dilation[d]
        t = t.unfold(1 + d, (size - 1) * dil + 1, module.stride[d])[..., ::dil]
    # [b, *out, cin, *kernel] -> [b, *out, *kernel, cin]
    t = t.permute(0, *range(1, 1 + n), *range(2 + n, 2 + 2 * n), 1 + n)
    return t.reshape(x.shape[0], t.shape[1 : 1 + n].numel(), -1)


class ConvFactors(OuterFactors):
    """A convolution's per-class gradients from ``G`` ``[k, m, cout, *out]`` (gradient at its
    output) and ``A`` ``[k, m, cin, *in]`` (its input); ``blocks`` are the layer's groups."""

    def __init__(self, module: ConvNd, seen: LayerCapture):
        self.module = module
        self.seen = seen

    @functools.cached_property
    def G(self) -> torch.Tensor:
        return self.seen.grads_by_class()

    @functools.cached_property
    def A(self) -> torch.Tensor:
        return self.seen.inputs_by_class()

    def _per_class(self, want_weight: bool, want_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One plain convolution backward per class on its own samples (no padding, no layout
        copies; a CPU's route for larger layers: on a GPU the launches add up)."""
        module, seen = self.module, self.seen
        dtype = seen.grid.dtype
        G, A = seen.grads.to(dtype), seen.inputs.to(dtype)  # [total, ...], class after class
        cout = module.out_channels
        weight = G.new_zeros(()).expand(module.weight.shape)  # only its shape is read
        gw = G.new_zeros(seen.k, *module.weight.shape) if want_weight else None
        gb = G.new_zeros(seen.k, cout) if want_bias else None
        start = 0
        for i, n in enumerate(seen.grid.sizes):
            if n == 0:
                continue
            _, w, b = torch.ops.aten.convolution_backward(
                G[start : start + n],
                A[start : start + n],
                weight,
                [cout],
                module.stride,
                module.padding,
                module.dilation,
                False,
                [0] * len(module.stride),
                module.groups,
                [False, want_weight, want_bias],
            )
            if gw is not None:
                gw[i] = w
            if gb is not None:
                gb[i] = b
            start += n
        return gw, gb

    def _by_size(self, want_weight: bool, want_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Classes of unequal size (a CPU's route for small layers, ``SMALL_WORK``): one grouped
        backward per class size, over the classes with that many samples, unpadded (a few kernel
        calls a run, where one per class pays a call's overhead a class). Each call's group count
        is rounded up to ``GROUPS_STEP`` (padding groups, their sums dropped: the neighbours of a
        size's classes where those are adjacent, else the last class repeated; ``rule_io.take_groups``)
        so that runs share a few kernel shapes: a CPU's convolution library builds a kernel for
        each new shape, about 0.5 ms on a first call. In channels-last or NCHW by
        ``by_size_layout``."""
        module, seen = self.module, self.seen
        dtype = seen.grid.dtype
        G, A = seen.grads.to(dtype), seen.inputs.to(dtype)  # [total, ...], class after class
        gw = G.new_zeros(seen.k, *module.weight.shape) if want_weight else None
        gb = G.new_zeros(seen.k, module.out_channels) if want_bias else None
        layout = by_size_layout(A, G)
        # Which samples each call takes is worked out on the host, from the grid's sizes.
        for n, picked, firsts in rule_io.equal_size_groups(seen.grid.sizes):
            if n == 0:
                continue
            k = len(picked)
            groups = -(-k // GROUPS_STEP) * GROUPS_STEP
            g, at = rule_io.take_groups(G, firsts, n, groups)
            a, _ = rule_io.take_groups(A, firsts, n, groups)
            classes = host_device.to_device(torch.tensor(picked), G.device)
            w, b = self._grouped(
                layout, g.view(groups, n, *G.shape[1:]), a.view(groups, n, *A.shape[1:]), want_weight, want_bias
            )
            if gw is not None and w is not None:
                gw.index_copy_(0, classes, w.view(groups, *module.weight.shape)[at : at + k])
            if gb is not None and b is not None:
                gb.index_copy_(0, classes, b.view(groups, module.out_channels)[at : at + k])
        return gw, gb

    def direct_sums(self, want_weight: bool, want_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """The sums from an exact kernel that never forms patches: a grouped backward (the k
        classes as k times the layer's groups) or, on a CPU, one per class size; None on the
        ``tokens`` route (the sums are formed from patches). See ``conv_route``."""
        route = conv_route(self.module, self.seen)
        if route == "tokens":
            return None
        if route == "by_size":
            sums = self._by_size(want_weight, want_bias)
        elif route == "per_class":
            sums = self._per_class(want_weight, want_bias)
        else:
            sums = self._grouped(route, self.G, self.A, want_weight, want_bias)
        self.seen.keep_totals(weight=sums[0], bias=sums[1])
        return sums

    def _grouped(
        self, layout: str, G: torch.Tensor, A: torch.Tensor, want_weight: bool, want_bias: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One convolution backward with the k classes of ``G`` ``[k, m, cout, *out]`` and ``A``
        ``[k, m, cin, *in]`` as k times the layer's groups, its inputs in ``layout``."""
        module = self.module
        k, m, cout = G.shape[:3]
        # Only the weight's shape matters for its own gradient (the input's gradient is not
        # asked for), so a zero-stride stand-in of the grouped shape; a copy of the weight per
        # class (``repeat``) cost a ResNet-18 run 45M floats of writes with 4 classes.
        weight = G.new_zeros(()).expand(k * cout, *module.weight.shape[1:])
        if layout == "channels_last":
            gg, ag = grouped_channels_last(G), grouped_channels_last(A)
        else:
            gg = G.transpose(0, 1).reshape(m, k * cout, *G.shape[3:])
            ag = A.transpose(0, 1).reshape(m, k * A.shape[2], *A.shape[3:])
        _, gw, gb = torch.ops.aten.convolution_backward(
            gg,
            ag,
            weight,
            [k * cout],
            module.stride,
            module.padding,
            module.dilation,
            False,
            [0] * len(module.stride),
            k * module.groups,
            [False, want_weight, want_bias],
        )
        # An output masked off may still come back (uninitialised): only what was asked for.
        return (gw if want_weight else None), (gb if want_bias else None)

    def grid_tokens(self) -> int:
        """From shapes alone: ``G`` is ``[k, m, cout, *out]``, its tokens one per group, sample
        and output position (forming them, a padded copy of the gradient, cost a CNN's logged
        step 60 ms at C = 10,000 where the grouped kernel took the layer anyway)."""
        seen = self.seen
        return seen.k * self.module.groups * seen.grid.width * math.prod(seen.grads.shape[2:])

    def grad_tokens(self) -> torch.Tensor:
        """``[k * groups, m * positions, cout / groups]``."""
        G, groups = self.G, self.module.groups
        k, m, cout = G.shape[:3]
        tokens = G.reshape(k, m, groups, cout // groups, -1).permute(0, 2, 1, 4, 3)
        return tokens.reshape(k * groups, -1, cout // groups)

    def input_tokens_any_order(self) -> tuple[torch.Tensor, int | None]:
        """Ungrouped layers: ``[k, m * positions, prod(kernel) * cin]`` (``patches_channels_inner``)
        and ``cin``; grouped ones: ``input_tokens()`` and None."""
        A = self.A
        if self.module.groups != 1:
            return self.input_tokens(), None
        k, m = A.shape[:2]
        found = patches_channels_inner(A.reshape(k * m, *A.shape[2:]), self.module)
        return found.reshape(k, -1, found.shape[2]), A.shape[2]

    def input_tokens(self) -> torch.Tensor:
        """``[k * groups, m * positions, cin / groups * prod(kernel)]``: every output position's patch."""
        A, groups = self.A, self.module.groups
        k, m = A.shape[:2]
        found = patches(A.reshape(k * m, *A.shape[2:]), self.module)  # [k * m, positions, cin * prod(kernel)]
        if groups == 1:  # a reshape: a 1x1, stride-1 layer's patches are a strided view of A
            return found.reshape(k, -1, found.shape[2])
        tokens = found.reshape(k, m, found.shape[1], groups, -1).permute(0, 3, 1, 2, 4)
        return tokens.reshape(k * groups, -1, found.shape[2] // groups)


@register_rule(nn.Conv1d, applies=zero_padding)
@register_rule(nn.Conv2d, applies=zero_padding)
@register_rule(nn.Conv3d, applies=zero_padding)
def conv_sums(module: ConvNd, seen: LayerCapture, out: LayerRows) -> None:
    class_outer_sums(ConvFactors(module, seen), out)

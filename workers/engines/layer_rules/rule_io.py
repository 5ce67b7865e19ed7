"""What a layer rule reads and where it writes (see ``registry`` for the interface).

Holds:
- ``ClassGrid``: where a run's samples (``[total]``, class after class) sit in a ``[k, width]``
  grid by class, short classes padded with zero rows (or, ``copies``, with copies of their own
  last sample, for module VJPs that need real inputs there).
- ``LayerCapture``: one layer's input and output gradient in one run, laid out by class on
  request; ``Ragged``: a layer's token factors of a run, unpadded, and the product per class;
  ``TokenSums``: per-class sums of a unit's ``[N, T, ...]`` tensors (outer products, totals).
- ``ClassRows``: a run's rows ``[k, D]``, filled parameter by parameter, with the evidence that
  they are finite; ``LayerRows``: its part for one layer, addressed by parameter kind.
- ``equal_size_groups``, ``consecutive`` and ``take_groups``: the host's plan of a run's classes
  by size, the samples each group takes (for products per distinct size), and those samples
  themselves (a view where the size's classes are adjacent).
- ``peak``: max ``|t|`` in one pass (for finiteness bounds); ``token_liveness``: the tokens whose
  output gradient is not all zero; ``CPU_ROUTE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines import host_device

# Device types that take the CPU's routes: a loop over a run's classes on unpadded samples, and
# sums by class as one indexed add. A GPU pays a launch per class for the loop, and its indexed
# add is atomic (its order, and so the rows' last bits, change from run to run): it pads instead.
CPU_ROUTE_DEVICES = ("cpu",)
_ROUTES_AS: list[str] = []  # see routes_as


def route_kind(device: torch.device) -> str:
    """The device type whose routes a tensor on ``device`` takes: its own, or within
    ``routes_as`` the one named there."""
    return _ROUTES_AS[-1] if _ROUTES_AS else device.type


def cpu_routes(device: torch.device) -> bool:
    """Whether work on ``device`` takes the CPU's routes (see ``CPU_ROUTE_DEVICES``)."""
    return route_kind(device) in CPU_ROUTE_DEVICES


@contextlib.contextmanager
def routes_as(kind: str) -> Iterator[None]:
    """Within the ``with``, every route is chosen as on a ``kind`` device (``"cuda"``): how the
    tests run a GPU's routes, and count their reads from the device, on a CPU."""
    _ROUTES_AS.append(kind)
    try:
        yield
    finally:
        _ROUTES_AS.pop()


def equal_size_groups(sizes: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
    """The host's plan of a run's classes by size (``sizes``: each class's samples or tokens,
    class after class): for each distinct size ``n``, ascending, the positions of the classes of
    that size and the first sample of each (``consecutive`` gives the rest)."""
    starts = list(itertools.accumulate(sizes, initial=0))
    plan = []
    for n in sorted(set(sizes)):
        picked = [i for i, size in enumerate(sizes) if size == n]
        plan.append((n, picked, [starts[i] for i in picked]))
    return plan


def consecutive(firsts: Sequence[int], n: int) -> torch.Tensor:
    """int64 ``[len(firsts) * n]`` on the host: ``n`` samples from each of ``firsts``, in order."""
    return (torch.tensor(firsts, dtype=torch.long).unsqueeze(1) + torch.arange(n)).reshape(-1)


def take_groups(t: torch.Tensor, firsts: Sequence[int], n: int, groups: int) -> tuple[torch.Tensor, int]:
    """``([groups * n, ...], at)``: ``n`` rows of ``t`` from each of ``firsts`` (one size's classes,
    class after class), padded to ``groups`` classes, and where the first class is among them. A
    view of ``t`` when the classes are adjacent (a run ordered by size: ``hook_path.size_order``),
    padded with their neighbours, whose sums the caller drops; else a gather, padded with copies
    of the last class (``at`` 0)."""
    k = len(firsts)
    if list(firsts) == list(range(firsts[0], firsts[0] + k * n, n)):
        borrowed = max(0, -(-(firsts[0] + groups * n - t.shape[0]) // n))  # classes before the first
        start = firsts[0] - borrowed * n
        if start >= 0:
            return t[start : start + groups * n], borrowed
    take = host_device.to_device(consecutive([*firsts, *[firsts[-1]] * (groups - k)], n), t.device)
    return t.index_select(0, take), 0


# A row whose entries are all bounded by this is finite, with room for the sums that form it and
# for a sum of up to 3e8 such rows (a training step's aggregate over its classes, ``sum_is_finite``):
# a real gradient entry is never near it, so a lower bound costs no exact check in practice.
FINITE_BOUND = 1e30


def sum_is_finite(rows: int) -> bool:
    """Whether a sum of ``rows`` float32 rows whose entries are all below ``FINITE_BOUND`` (a run
    that ``certainly_finite``) is finite for sure, with no read of it."""
    return rows * FINITE_BOUND < torch.finfo(torch.float32).max


def token_liveness(grads: torch.Tensor) -> torch.Tensor:
    """bool ``[tokens]`` on ``grads``' device, not read: the rows of ``grads`` ``[..., features]``
    that are not all zero (by their largest and smallest entry: one pass, 10x faster than ``any``
    on a CPU; a NaN is live). A row of zeros (a position the loss never reads: a decoder's
    classifier head scores every position and keeps the last) adds nothing to any sum of outer
    products, so it can be left out exactly. The hook path reads every layer's at once."""
    flat = grads.reshape(-1, grads.shape[-1])
    if flat.shape[1] == 0:
        return torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
    # amax and amin apart: aminmax along a dimension was 10x slower on a CPU (torch 2.13).
    return (flat.amax(dim=1) != 0) | (flat.amin(dim=1) != 0)


def live_tokens(grads: torch.Tensor) -> torch.Tensor | None:
    """``token_liveness`` read to the host, or None when every row is live (tests, benchmarks)."""
    live = token_liveness(grads).cpu()
    return None if bool(live.all()) else live


def peak(t: torch.Tensor) -> torch.Tensor:
    """Max ``|t|`` in one pass, no temporary; NaN stays NaN."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi)


@dataclass(frozen=True)
class ClassGrid:
    """A run of ``k`` classes laid out as ``[k, width]``: the plan of one micro-batch, made on the
    host from its labels before the forward (``build``) and handed to every layer rule, so that
    no rule reads the layout back from the device. ``sizes``: samples of each class (host);
    ``owner``: each sample's class (``[total]``, on the device); ``spots``: the grid positions of
    the run's samples (None: every class has ``width`` samples, so ``[total]`` already is the grid)."""

    k: int
    width: int
    spots: torch.Tensor | None
    dtype: torch.dtype
    sizes: tuple[int, ...]
    owner: torch.Tensor

    @classmethod
    def build(cls, sizes: Sequence[int], dtype: torch.dtype, device: torch.device) -> ClassGrid:
        """The grid of a run whose classes have ``sizes`` samples each, class after class: made
        on the host, moved to ``device`` in one copy (no ``spots`` when the sizes are equal)."""
        sizes = tuple(int(n) for n in sizes)
        width = max(sizes, default=0)
        counts = torch.tensor(sizes, dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(sizes)), counts)
        if all(n == width for n in sizes):
            return cls(len(sizes), width, None, dtype, sizes, host_device.to_device(owner, device))
        within = torch.arange(len(owner)) - (torch.cumsum(counts, 0) - counts)[owner]
        both = host_device.to_device(torch.stack([owner, owner * width + within]), device)
        return cls(len(sizes), width, both[1], dtype, sizes, both[0])

    @classmethod
    def of_counts(cls, counts: torch.Tensor, dtype: torch.dtype) -> ClassGrid:
        """``build`` from a tensor of counts (tests, benchmarks: reads them once)."""
        return cls.build(counts.tolist(), dtype, counts.device)

    @cached_property
    def groups(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Classes of equal size, one entry per distinct size above 0: ``(classes, samples)``, the
        classes' positions ``[n]`` and their samples ``[n * size]`` (class after class), on the
        device, made on the host; ``samples`` None when every class has ``width`` samples."""
        device = self.owner.device
        if self.spots is None:
            return [(host_device.to_device(torch.arange(self.k), device), None)]
        return [
            (host_device.to_device(torch.tensor(picked), device), host_device.to_device(consecutive(firsts, n), device))
            for n, picked, firsts in equal_size_groups(self.sizes)
            if n > 0
        ]

    @property
    def total(self) -> int:
        """How many samples the run has (class after class)."""
        return len(self.owner)

    def sample_class(self, device: torch.device) -> torch.Tensor:
        """``[total]``: each sample's position in the run (which of the ``k`` classes)."""
        return self.owner.to(device)

    def counts(self, device: torch.device) -> torch.Tensor:
        """``[k]``: samples of each class in the run (from the host's ``sizes``)."""
        return host_device.to_device(torch.tensor(self.sizes), device)

    def copies(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(take, real)``, both ``[k * width]``: the sample (index into ``[total]``) at each grid
        place, a short class repeating its own last sample (an empty one: sample 0), and whether
        the place holds a real sample (padding gets a zero weight or a zero cotangent)."""
        counts = self.counts(device)
        first = torch.cumsum(counts, 0) - counts
        j = torch.arange(self.width, device=device).unsqueeze(0)
        last = (counts - 1).clamp(min=0).unsqueeze(1)
        take = (first.unsqueeze(1) + torch.minimum(j, last)).clamp(max=max(self.total - 1, 0))
        return take.reshape(-1), (j < counts.unsqueeze(1)).reshape(-1)

    def class_sums(self, t: torch.Tensor) -> torch.Tensor:
        """``[total, ...]`` summed over each class's samples: ``[k, ...]`` in the rows' dtype. On a
        CPU by one indexed add (no padded copy); elsewhere over the padded grid (an indexed add
        there is atomic, in an order that changes from run to run)."""
        t = t.to(self.dtype)
        if self.spots is None:
            return t.reshape(self.k, self.width, *t.shape[1:]).sum(dim=1)
        if cpu_routes(t.device):
            return t.new_zeros(self.k, *t.shape[1:]).index_add_(0, self.sample_class(t.device), t)
        return self.padded(t).sum(dim=1)

    def padded(self, t: torch.Tensor) -> torch.Tensor:
        """``[total, ...]`` -> ``[k, width, ...]`` in the rows' dtype, zero rows as padding."""
        t = t.to(self.dtype)
        if self.spots is None:
            return t.reshape(self.k, self.width, *t.shape[1:])
        grid = t.new_zeros(self.k * self.width, *t.shape[1:])
        return grid.index_copy_(0, self.spots, t).view(self.k, self.width, *t.shape[1:])


@dataclass(frozen=True)
class Ragged:
    """A run's tokens class after class, unpadded: ``grads`` ``[tokens, out]``, ``inputs``
    ``[tokens, in]`` (each class's tokens a contiguous slice, each sample's ``per_sample`` tokens
    in a row; 0 once ``keeping`` dropped some), ``tokens`` per class."""

    grads: torch.Tensor
    inputs: torch.Tensor
    tokens: list[int]
    per_sample: int

    def owner(self, device: torch.device) -> torch.Tensor:
        """int64 ``[tokens]``: each token's class (its position in the run), made on the host."""
        return host_device.to_device(self._owner(), device)

    def _owner(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.tokens)), torch.tensor(self.tokens, dtype=torch.long))

    def keeping(self, live: torch.Tensor) -> Ragged:
        """The tokens where ``live`` (bool ``[tokens]``, host) is set, each class keeping its own."""
        tokens = torch.bincount(self._owner()[live], minlength=len(self.tokens)).tolist()
        take = host_device.to_device(live.nonzero().squeeze(1), self.grads.device)
        return Ragged(self.grads.index_select(0, take), self.inputs.index_select(0, take), tokens, 0)

    def per_class_mm(self, first: torch.Tensor, second: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] = first_i^T @ second_i`` over class i's slice of tokens (zero for no tokens).

        One batched product per distinct token count (classes of 1 to 4 samples: 4 products),
        not one product per class: at 64x64 layers a product per class cost twice as much in
        calls as the gather of each group's tokens (``benchmarks.sketch_kernels --section mm``).
        Which tokens each product takes is worked out on the host from ``tokens``."""
        device = first.device
        for n, picked, firsts in equal_size_groups(self.tokens):
            classes = host_device.to_device(torch.tensor(picked), device)
            if n == 0:
                out.index_fill_(0, classes, 0.0)
                continue
            a = take_groups(first, firsts, n, len(picked))[0].view(len(picked), n, first.shape[1])
            b = take_groups(second, firsts, n, len(picked))[0].view(len(picked), n, second.shape[1])
            if picked == list(range(picked[0], picked[0] + len(picked))):  # adjacent: a slice of out
                torch.bmm(a.transpose(1, 2), b, out=out[picked[0] : picked[0] + len(picked)])
            else:
                out.index_copy_(0, classes, torch.bmm(a.transpose(1, 2), b))


class TokenSums:
    """Per-class sums over a class's samples and their steps or tokens (``[N, T, ...]``, the run's
    samples class after class, placed by ``grid``): a module unit's gradients (recurrent layers,
    attention). Classes of equal size are done in one batched product (no padding rows
    multiplied: a grid of classes of 1 to 4 samples is a third padding)."""

    def __init__(self, grid: ClassGrid, device: torch.device):
        self.k = grid.k
        self.owner = grid.sample_class(device)
        self.groups = [(c.to(device), None if r is None else r.to(device)) for c, r in grid.groups]
        self.complete = 0 not in grid.sizes

    def outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``sum_{samples, steps} a_t b_t^T`` per class: ``[N, T, p]``, ``[N, T, q]`` -> ``[k, p, q]``."""
        p, q = a.shape[2], b.shape[2]
        out: torch.Tensor | None = None
        for classes, rows in self.groups:
            A, B = (t if rows is None else t.index_select(0, rows) for t in (a, b))
            part = torch.bmm(A.reshape(len(classes), -1, p).transpose(1, 2), B.reshape(len(classes), -1, q))
            if rows is None:
                return part
            if out is None:
                out = a.new_empty(self.k, p, q) if self.complete else a.new_zeros(self.k, p, q)
            out.index_copy_(0, classes, part)
        assert out is not None
        return out

    def total(self, a: torch.Tensor) -> torch.Tensor:
        """``sum_{samples, steps} a_t`` per class: ``[N, T, p]`` -> ``[k, p]``."""
        return a.new_zeros(self.k, a.shape[2]).index_add_(0, self.owner, a.sum(dim=1))


@dataclass(frozen=True)
class LayerCapture:
    """One layer in one run: its input and the gradient at its output, ``[total, ...]`` each,
    class after class (the gradient already divided by the fp16 loss scale, and in fp16 by a
    training step's class weights too; in other precisions those weights, ``n_c / N``, are
    divided out of the finished rows instead); ``live``: which of
    its tokens (``[total * positions]``, host bool) have an output gradient not all zero, for a
    rule registered with ``live_tokens`` on the CPU's routes (None: not known, keep them all).
    ``totals``: where the caller asks for them, by kind, the sum over the run's classes of the
    whole per-class gradients a route formed on its way (``keep_totals``): the hook path takes
    them as a training step's gradient instead of forming that again (a CNN's convolutions: 17 ms
    of a logged step)."""

    inputs: torch.Tensor
    grads: torch.Tensor
    grid: ClassGrid
    live: torch.Tensor | None = None
    totals: dict[str, torch.Tensor] | None = None

    def keep_totals(self, **values: torch.Tensor | None) -> None:
        """Whole per-class gradients by kind (``weight=``, ``bias=``), class after class (``[k, *shape]``,
        or a grouped backward's ``[k * cout, ...]``): their sum over the classes kept when asked for
        (one parameter's size, not ``k`` of them)."""
        if self.totals is not None:
            self.totals.update({kind: v.reshape(self.k, -1).sum(dim=0) for kind, v in values.items() if v is not None})

    @property
    def k(self) -> int:
        return self.grid.k

    @property
    def total(self) -> int:
        return self.grads.shape[0]

    def by_class(self, t: torch.Tensor) -> torch.Tensor:
        """Any ``[total, ...]`` tensor (e.g. a reshaped input) as ``[k, width, ...]``."""
        return self.grid.padded(t)

    def grads_by_class(self) -> torch.Tensor:
        return self.grid.padded(self.grads)

    def inputs_by_class(self) -> torch.Tensor:
        return self.grid.padded(self.inputs)


def _key(slot: ParamSlot) -> tuple[int, int]:
    return slot.offset, slot.size


class ProjectionUnit(Protocol):
    """One projected layer of a structure's map, as the hook path sees it: the weight (and bias)
    it stands for, the ``width`` work columns at ``offset`` its sums write, the structure whose
    sums those are, and the map of a whole per-class gradient another path formed (``map_part``:
    the weight's or the bias's ``[k, size]``; ``map_matrix`` of ``joined(w, b)``: both at once)."""

    @property
    def structure(self) -> str: ...
    @property
    def weight(self) -> ParamSlot: ...
    @property
    def bias(self) -> ParamSlot | None: ...
    @property
    def offset(self) -> int: ...
    @property
    def width(self) -> int: ...

    def map_part(self, part: str, value: torch.Tensor) -> torch.Tensor: ...

    def map_matrix(self, m: torch.Tensor) -> torch.Tensor: ...

    def joined(self, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...


class ClassRows:
    """A run's rows ``[k, D]`` (a view of the group's buffer), written parameter by parameter.

    The first value for a parameter's columns is copied in, later ones added: a layer called
    twice, or another layer whose slot has the same columns (a TensorSketch work row, where every
    unit adds into one sketch). What was written is tracked by columns, not names.
    Rules leave evidence that their values are finite: ``bounds``, each one above every entry it
    covers (a bound from the factors, or the values' own largest magnitude); ``certainly_finite``
    reads it all in one synchronisation instead of a pass over the rows.
    """

    def __init__(self, rows: torch.Tensor, projections: dict[str, ProjectionUnit] | None = None):
        self.rows = rows
        # Weight name -> its projection unit (the structure's map's) when rows are projected.
        self.projections = projections or {}
        self.k = rows.shape[0]
        self.written: set[tuple[int, int]] = set()  # (offset, size) of the columns written
        self.bounds: list[torch.Tensor] = []

    def for_layer(self, slots: dict[str, ParamSlot], full: bool = False) -> LayerRows:
        """``full``: the values put are whole per-class gradients (a module VJP's), mapped here
        when a parameter belongs to a projected layer."""
        return LayerRows(self, slots, full)

    def mapped(self, slot: ParamSlot, value: torch.Tensor) -> tuple[ParamSlot, torch.Tensor]:
        """``(slot, value)`` to write for a whole per-class gradient ``value`` ``[k, size]`` of the
        parameter ``slot`` names: itself, or, for a weight or bias of a projected layer (whose
        gradient another path formed whole), that layer's projected columns and its share of them
        (the maps are linear: the weight's and the bias's shares add up)."""
        for unit in self.projections.values():
            for part in ("weight", "bias"):
                param = getattr(unit, part)
                if param is not None and param.name == slot.name:
                    return self.unit_slot(unit), unit.map_part(part, value)
        return slot, value

    @staticmethod
    def unit_slot(unit: Any) -> ParamSlot:
        """The work columns a projection unit writes."""
        return ParamSlot(unit.weight.name, (unit.width,), unit.offset, unit.width)

    def columns(self, slot: ParamSlot) -> torch.Tensor:
        return self.rows[:, slot.offset : slot.offset + slot.size]

    def zero_unwritten(self, slots: Sequence[ParamSlot]) -> None:
        """Parameters with no path to the loss in this run get zero columns."""
        for slot in slots:
            if _key(slot) not in self.written:
                self.columns(slot).zero_()

    def scale_rows(self, factors: torch.Tensor) -> None:
        """Row i times ``factors[i]`` (``[k]``, on the rows' device), after every layer wrote its
        part; each bound grows by the largest factor, so the evidence still covers the rows."""
        self.rows.mul_(factors.to(self.rows.dtype).unsqueeze(1))
        if self.bounds:
            top = factors.abs().max()
            self.bounds = [b * top for b in self.bounds]

    def certainly_finite(self) -> torch.Tensor:
        """bool scalar on the rows' device, not read here: whether every row is finite for sure
        (False: let the exact per-row check decide). The caller reads it with the run's losses."""
        if not self.bounds:
            return torch.ones((), dtype=torch.bool, device=self.rows.device)
        # A NaN bound compares False: not certain.
        return (torch.stack([b.float() for b in self.bounds]) < FINITE_BOUND).all()


class LayerRows:
    """One layer's part of a run's rows: per-class gradients by parameter kind (``weight``, ...)."""

    def __init__(self, run: ClassRows, slots: dict[str, ParamSlot], full: bool = False):
        self.run = run
        self.slots = slots
        self.full = full
        # The layer's projection unit (a rule projects inside the backward), or None.
        self.projection = run.projections.get(slots["weight"].name) if "weight" in slots and not full else None

    @property
    def k(self) -> int:
        return self.run.k

    def wants(self, kind: str) -> bool:
        """Whether the parameter ``kind`` of this layer is selected."""
        return kind in self.slots

    def put(self, kind: str, value: torch.Tensor) -> None:
        """Per-class gradients ``[k, *shape]`` (any shape of ``k * size`` entries) of ``kind``."""
        slot = self.slots[kind]
        if self.full and self.run.projections:
            slot, value = self.run.mapped(slot, value.reshape(self.k, -1))
        self._write(slot, value)

    def put_all(self, values: dict[str, torch.Tensor]) -> None:
        """``put`` of every kind in ``values``; whole gradients (``full``) of a projected layer's
        weight and bias joined into its unit's one matrix and mapped once (not each part apart,
        the other part zero: half the entries sketched)."""
        pending = dict(values)
        kinds = {self.slots[kind].name: kind for kind in values}  # parameter name -> kind
        for unit in self.run.projections.values() if self.full else ():
            weight = kinds.get(unit.weight.name)
            bias = kinds.get(unit.bias.name) if unit.bias is not None else None
            if weight is not None and bias is not None:
                w, b = pending.pop(weight).reshape(self.k, -1), pending.pop(bias).reshape(self.k, -1)
                self._write(self.run.unit_slot(unit), unit.map_matrix(unit.joined(w, b)))
        for kind, value in pending.items():
            self.put(kind, value)

    def _write(self, slot: ParamSlot, value: torch.Tensor) -> None:
        target = self.run.columns(slot)
        if _key(slot) in self.run.written:
            target.add_(value.reshape(self.k, slot.size))
        else:
            target.copy_(value.reshape(self.k, slot.size))
            self.run.written.add(_key(slot))

    def fresh(self, kind: str) -> torch.Tensor | None:
        """The rows' columns of ``kind`` (``[k, size]``, a view) to write the values straight into,
        when nothing was written there yet in this run (else None: use ``put``). The caller must
        then fill every entry."""
        slot = self.slots[kind]
        if _key(slot) in self.run.written:
            return None
        self.run.written.add(_key(slot))
        return self.run.columns(slot)

    def bound(self, t: torch.Tensor) -> None:
        """A scalar tensor bounding every entry this layer writes (certainly finite below ``FINITE_BOUND``)."""
        self.run.bounds.append(t)

    def bound_by_values(self, *values: torch.Tensor | None) -> None:
        """Values this layer writes, bounded by their largest magnitude (``peak``: one pass, read
        with the run's other bounds; NaN or inf when any entry is)."""
        self.run.bounds.extend(peak(t) for t in values if t is not None and t.numel())  # empty: nothing to bound


def sample_classes(seen: LayerCapture) -> torch.Tensor:
    """``[total]``: the position in the run (0..k-1) of each sample's class. Raises when the
    layer's batch dimension is not the run's samples (ids broadcast across the batch, such as
    Hugging Face's position ids ``[1, L]``: their gradient is already summed over the samples)."""
    grid = seen.grid
    samples = grid.k * grid.width if grid.spots is None else grid.spots.numel()
    if seen.inputs.shape[0] != samples or seen.total != samples:
        raise RuntimeError(
            f"an embedding's batch dimension ({seen.inputs.shape[0]}) is not the run's {samples} samples "
            "(ids broadcast across the batch)"
        )
    spots = grid.spots if grid.spots is not None else torch.arange(seen.total, device=seen.grads.device)
    return torch.div(spots, grid.width, rounding_mode="floor")

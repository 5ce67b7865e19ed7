"""Module-local VJP units: per-class gradients of one module's parameters from its own inputs.

Holds ``UnitComputer`` (the signature), ``UNIT_COMPUTERS`` / ``register_unit_computer`` /
``unit_computer_for`` (a registry keyed by module type, looked up along the type's bases, with
``module_class_grads`` as the default), ``module_class_grads`` itself (per-sample copies, a vmapped
VJP or a loop), ``batch_dim`` (where a
captured tensor keeps its samples) and ``check_layout`` (the module on one sample alone gives
that sample's outputs: which arguments are per-sample was read right). Modules
``torch.func.vmap`` could not batch are remembered in ``choices.VMAP_REFUSED`` (they take the
per-class loop from then on).

The hook path handles a selected parameter that no layer rule covers by a *unit*: the module
that holds it (or, for ``nn.MultiheadAttention`` and recurrent layers, the whole layer) is
captured in the run's one forward (its positional and keyword arguments, and its output) and,
after the one backward, the gradient at its output is known. Its parameters' per-class gradients
are then a VJP of that module alone::

    grads[i] = d/dtheta < unit(theta; args of class i), grad_output of class i >

computed for all ``k`` classes of the run at once with ``torch.func.vmap`` over a ``[k, width]``
grid (a short class padded with copies of its own samples and a zero cotangent), or, when vmap
cannot batch the module, by a loop over classes of ``torch.autograd.grad`` on the module alone
(on each class's own samples: the same flops as one pass over the run). Cheaper still, where it
holds: each wanted parameter given one copy per sample (an expanded view: a class token or a
position embedding ``[1, ...]`` along its first dim, an elementwise gain ``[H]`` in front of the
output's dims), one forward and one VJP of the module over the whole run, and the copies'
gradients summed by class; used once it gave the VJP's sums on the module's first run of two or
more classes (``choices.PER_SAMPLE_LEAVES``). Only the module itself
has to treat samples independently. Parameters of the unit's descendants that are handled
elsewhere (their own rule or unit) are swapped for detached copies, so they contribute nothing.

A computer is ``fn(module, args, kwargs, grad_outputs, grid, kinds) -> {name: [k, *shape]}``:
``args``/``kwargs`` as captured (tensors ``[total, ...]`` along their batch dimension, class
after class, detached), ``grad_outputs`` the output's structure with the gradient at each
tensor (None where none reached it; a broadcast output, ``[1, ...]`` in the model, has the
gradient of its per-sample expansion ``[total, ...]``), ``grid`` the run's ``ClassGrid``,
``kinds`` the names (relative to ``module``) of the parameters wanted. Gradients are linear in
``grad_outputs``: the caller divides by the fp16 loss scale afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from classgrad.errors import first_line
from classgrad.workers.engines import choices
from classgrad.workers.engines.layer_rules.layer_shapes import UNIT_MATRICES
from classgrad.workers.engines.layer_rules.rule_io import ClassGrid

UnitComputer = Callable[[nn.Module, tuple, dict, Any, ClassGrid, tuple[str, ...]], dict[str, torch.Tensor]]

UNIT_COMPUTERS: dict[type[nn.Module], UnitComputer] = {}

# Layers whose whole set of parameters is one unit: ``nn.MultiheadAttention`` reads
# ``out_proj.weight`` without calling ``out_proj``; a recurrent layer's weights are used at every
# step. Hooks on their submodules would see nothing or only part.
WHOLE_UNIT_TYPES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.RNNBase)


def register_unit_computer(
    module_type: type[nn.Module],
    *,
    unit_matrices: Callable[[Any], list[tuple[str, str | None]]] | None = None,
    replace: bool = False,
) -> Callable[[UnitComputer], UnitComputer]:
    """Register the decorated function as the unit computer for ``module_type`` (and subclasses);
    ``unit_matrices(module)``: how the TensorSketch structure treats its parameters, the names
    under the module of each weight matrix and its bias (None: none) that it sketches as one
    ``[W | b]`` unit (the built-in types' table is ``layer_shapes.UNIT_MATRICES``)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_unit_computer needs an nn.Module subclass, got {module_type!r}")

    def decorate(fn: UnitComputer) -> UnitComputer:
        if module_type in UNIT_COMPUTERS and not replace:
            raise ValueError(f"a unit computer for {module_type.__name__} is already registered; pass replace=True")
        UNIT_COMPUTERS[module_type] = fn
        if unit_matrices is not None:  # the layer knowledge every structure's plan reads
            UNIT_MATRICES[module_type] = unit_matrices
        return fn

    return decorate


def unit_computer_for(module: nn.Module) -> UnitComputer:
    """The computer registered for the module's type or its nearest base, else the generic one."""
    for base in type(module).__mro__:
        fn = UNIT_COMPUTERS.get(base)
        if fn is not None:
            return fn
    return module_class_grads


def batch_dim(t: object, total: int, module: nn.Module) -> int | None:
    """Where the tensor ``t`` captured at ``module`` keeps the run's ``total`` samples, or None
    (not per-sample: a constant, or a broadcast ``[1, ...]`` tensor): dim 0, or dim 1 of tensors
    with 3 or more dims for sequence-first layers (``batch_first=False``). A constant whose dim
    happens to equal ``total`` would be mistaken for per-sample: ``_Layout`` keeps the layout
    seen on a module's first (spot-checked) run."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    d = 1 if getattr(module, "batch_first", True) is False and t.dim() >= 3 else 0
    return d if t.shape[d] == total else None


def check_layout(module: nn.Module, args: tuple, kwargs: dict, outputs: Any, total: int) -> bool:
    """Once per unit and call structure: whether the module run on the first sample alone (the
    arguments ``batch_dim`` finds per-sample cut to it, the others as they are) gives that
    sample's captured ``outputs`` (the output's structure; None, or a tensor with no sample
    dimension, where not compared). A constant
    argument taken for per-sample (its size equal to ``total`` by chance) gives other outputs,
    or none. Runs under the caller's autocast; kept in ``choices.UNIT_LAYOUTS`` once it holds."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    layouts = choices.UNIT_LAYOUTS.setdefault(module, {})
    if total < 2 or str(spec) in layouts:
        return True
    dims = [batch_dim(t, total, module) for t in leaves]
    one = [t if d is None else t.narrow(d, 0, 1) for t, d in zip(leaves, dims)]
    a, kw = pytree.tree_unflatten(one, spec)
    try:
        with torch.no_grad():
            got, _ = pytree.tree_flatten(module(*a, **kw))
    except Exception:  # noqa: BLE001 - a module that cannot run on the cut arguments: not per-sample
        return False
    want, _ = pytree.tree_flatten(outputs)
    if len(got) != len(want):
        return False
    for w, g in zip(want, got):
        d = batch_dim(w, total, module)
        if d is None:  # not compared (None), or not per-sample
            continue
        w = w.detach().narrow(d, 0, 1)
        if not isinstance(g, torch.Tensor) or g.shape != w.shape:
            return False
        # The same sample alone or in a batch: equal up to the kernels' summation order (1e-5
        # in fp32, 1e-3 in half precision); a misread argument changes outputs by O(1).
        scale = float(w.abs().max()) if w.numel() else 0.0
        if not torch.allclose(g.float(), w.float(), rtol=1e-2, atol=1e-2 * max(scale, 1e-30)):
            return False
    layouts[str(spec)] = dims
    return True


def _split_params(module: nn.Module, kinds: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The wanted parameters (detached, one name per tensor) and every other parameter of the
    module as a detached copy (tied names of a wanted one left to ``functional_call``)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    own = {name: named[name].detach() for name in kinds}
    own_ids = {id(named[name]) for name in kinds}
    frozen = {n: p.detach() for n, p in named.items() if n not in own and id(p) not in own_ids}
    return own, frozen


def module_class_grads(
    module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, grid: ClassGrid, kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """The generic unit computer: one copy of each parameter per sample (``_per_sample_leaves``)
    once that is checked to give the same sums, else vmap over classes of the module's VJP, or a
    per-class loop."""
    leaves_ok = choices.PER_SAMPLE_LEAVES.get(module)
    if leaves_ok is not False:
        try:
            got = _per_sample_leaves(module, args, kwargs, grad_outputs, grid, kinds)
        except Exception:  # noqa: BLE001 - the module does not take per-sample copies: the VJP per class
            choices.PER_SAMPLE_LEAVES[module] = False
        else:
            if leaves_ok:
                return got
            want = _by_vjp(module, args, kwargs, grad_outputs, grid, kinds)
            # Decided on a run of two or more classes with samples: with one, any attribution
            # of the gradient to samples sums to the same class total.
            if sum(n > 0 for n in grid.sizes) >= 2:
                choices.PER_SAMPLE_LEAVES[module] = _close(got, want)
            return want
    return _by_vjp(module, args, kwargs, grad_outputs, grid, kinds)


def _by_vjp(
    module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, grid: ClassGrid, kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    refused = choices.VMAP_REFUSED.get(module)
    if refused is None:
        try:
            return _vmapped(module, args, kwargs, grad_outputs, grid, kinds)
        except Exception as exc:  # noqa: BLE001 - anything vmap cannot batch: the exact loop below
            choices.VMAP_REFUSED[module] = first_line(exc, limit=120)
    return _looped(module, args, kwargs, grad_outputs, grid, kinds)


def _per_sample_view(p: torch.Tensor, total: int, out_dims: int) -> torch.Tensor:
    """``p`` as one copy per sample (an expanded view, no memory): ``[1, ...]`` parameters (a class
    token, a position embedding) along their first dim, others (an elementwise gain ``[H]``)
    in front of the output's trailing dims they would broadcast along (``[total, 1, ..., H]``)."""
    if p.dim() >= 2 and p.shape[0] == 1:
        return p.expand(total, *p.shape[1:])
    if out_dims - 1 < p.dim():
        raise RuntimeError("the parameter has more dims than a sample's output")
    return p.view(1, *[1] * (out_dims - 1 - p.dim()), *p.shape).expand(total, *[-1] * (out_dims - 1))


def _per_sample_leaves(
    module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, grid: ClassGrid, kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Each wanted parameter given one copy per sample (``_per_sample_view``, as leaves): one
    forward and one VJP of the module over the run's samples give every sample's gradient,
    summed by class. Exact when sample i uses only copy i, which ``module_class_grads`` checks
    against the VJP per class on the module's first run of two or more classes."""
    lay = _Layout(module, args, kwargs, grad_outputs, grid.total)
    if any(d != 0 for d in lay.cot_dims) or any(d not in (None, 0) for d in lay.in_dims):
        raise RuntimeError("samples not along dim 0")
    own, frozen = _split_params(module, kinds)
    # The copies' gradients are per-sample: at most the size of what the run already holds per
    # sample (its captured inputs, its output's gradient); a weight matrix's per-sample gradients
    # are what the engines never form.
    held = [c[0].numel() for c in lay.cots]
    held += [t[0].numel() for t, d in zip(lay.leaves, lay.in_dims) if d == 0]
    if any(p.numel() > max(held) for p in own.values()):
        raise RuntimeError("a parameter bigger than a sample's output")
    out_dims = lay.cots[0].dim()
    copies = {n: _per_sample_view(p, grid.total, out_dims).requires_grad_() for n, p in own.items()}
    with torch.enable_grad():
        outs = _expanded(lay.call(module, (copies, frozen), [None] * len(lay.leaves)), lay.cots, lay.cot_dims)
        live = [(o, c) for o, c in zip(outs, lay.cots) if o.requires_grad]
        found = torch.autograd.grad(
            [o for o, _ in live], list(copies.values()), [c for _, c in live], allow_unused=True
        )
    out = {}
    for (name, p), g in zip(own.items(), found):
        if g is None or g.shape[0] != grid.total:
            raise RuntimeError(f"no per-sample gradient for {name}")
        out[name] = grid.class_sums(g).view(grid.k, *p.shape)
    return out


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """The same per-class gradients up to summation order (1e-4 relative: one pass over a run's
    samples in another order; a wrong attribution to samples is off by O(1))."""
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            return False
        scale = float(w.abs().max()) if w.numel() else 0.0
        tol = 1e-4 if w.dtype == torch.float32 or w.dtype == torch.float64 else 2e-2
        if float((g - w).abs().max()) > tol * max(scale, 1e-30):
            return False
    return True


class _Layout:
    """The captured call flattened: input leaves with their batch dims, output cotangents.

    Which inputs are per-sample is decided on a module's first run of more than one sample with
    a given call structure (spot-checked against the plain path) and kept
    (``choices.UNIT_LAYOUTS``), so a constant whose size later equals a run's sample count by
    chance is not taken for per-sample. A later run that contradicts it raises (the engine then
    leaves the hook path; rows stay exact)."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, total: int):
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))
        seen = [batch_dim(t, total, module) for t in self.leaves]
        layouts = choices.UNIT_LAYOUTS.setdefault(module, {})
        # A run of one sample says nothing (every dim of size 1 looks per-sample, harmlessly).
        known = layouts.setdefault(str(self.spec), seen) if total > 1 else layouts.get(str(self.spec), seen)
        for t, d in zip(self.leaves, known):
            if d is not None and (not isinstance(t, torch.Tensor) or t.dim() <= d or t.shape[d] != total):
                raise RuntimeError(f"an input of {type(module).__name__} changed its sample layout between runs")
        self.in_dims = known
        cots, _ = pytree.tree_flatten(grad_outputs)
        # Output leaves with a gradient, by their position among the output's leaves.
        self.cot_at = [i for i, g in enumerate(cots) if isinstance(g, torch.Tensor)]
        self.cots = [cots[i] for i in self.cot_at]
        dims = [batch_dim(g, total, module) for g in self.cots]
        if any(d is None for d in dims):
            raise RuntimeError(f"a gradient at the output of {type(module).__name__} is not per-sample")
        self.cot_dims: list[int] = [d for d in dims if d is not None]

    def call(self, module: nn.Module, params: tuple[dict, dict], leaves: list) -> list[torch.Tensor]:
        """The module on ``leaves`` (the captured ones where None), the output leaves that get a
        gradient; a broadcast one expanded to the cotangent's batch size."""
        from torch.func import functional_call

        full = [t if s is None else s for t, s in zip(self.leaves, leaves)]
        args, kwargs = pytree.tree_unflatten(full, self.spec)
        out_leaves, _ = pytree.tree_flatten(functional_call(module, params, tuple(args), kwargs))
        return [out_leaves[i] for i in self.cot_at]


def _expanded(outs: list[torch.Tensor], cots: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
    """A broadcast output ``[1, ...]`` as its per-sample expansion (its VJP sums the samples)."""
    return [
        o.expand(*c.shape) if o.dim() == c.dim() and o.shape[d] == 1 and c.shape[d] != 1 else o
        for o, c, d in zip(outs, cots, dims)
    ]


def _vmapped(
    module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, grid: ClassGrid, kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    from torch.func import vjp, vmap

    lay = _Layout(module, args, kwargs, grad_outputs, grid.total)
    own, frozen = _split_params(module, kinds)
    device = next(iter(own.values())).device
    take, real = grid.copies(device)
    k, width = grid.k, grid.width

    def on_grid(t: torch.Tensor, d: int, zero_padding: bool) -> torch.Tensor:
        g = t.index_select(d, take.to(t.device))
        if zero_padding:
            g = g * real.to(t.device, t.dtype).view(-1, *[1] * (t.dim() - d - 1))
        return g.reshape(*t.shape[:d], k, width, *t.shape[d + 1 :])

    at = [i for i, d in enumerate(lay.in_dims) if d is not None]
    dims = [d for d in lay.in_dims if d is not None]
    batched = [on_grid(lay.leaves[i], d, False) for i, d in zip(at, dims)]
    cots = [on_grid(c, d, True) for c, d in zip(lay.cots, lay.cot_dims)]

    def one_class(xs: list[torch.Tensor], cs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        leaves: list = [None] * len(lay.leaves)
        for i, x in zip(at, xs):
            leaves[i] = x

        def f(p: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            return _expanded(lay.call(module, (p, frozen), leaves), cs, lay.cot_dims)

        pullback = vjp(f, own)[1]
        return pullback(cs)[0]

    return vmap(one_class, in_dims=(dims, lay.cot_dims))(batched, cots)


def _looped(
    module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, grid: ClassGrid, kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Class by class on the module alone: each class's own samples, one forward and one
    ``torch.autograd.grad`` of the module each (what vmap would do, as a loop)."""
    lay = _Layout(module, args, kwargs, grad_outputs, grid.total)
    own, frozen = _split_params(module, kinds)
    out = {name: torch.zeros(grid.k, *p.shape, dtype=p.dtype, device=p.device) for name, p in own.items()}
    start = 0
    for i, n in enumerate(grid.sizes):
        if n == 0:
            continue
        leaves = [None if d is None else t.narrow(d, start, n) for t, d in zip(lay.leaves, lay.in_dims)]
        cots = [c.narrow(d, start, n) for c, d in zip(lay.cots, lay.cot_dims)]
        start += n
        params = {name: p.clone().requires_grad_() for name, p in own.items()}
        with torch.enable_grad():
            outs = _expanded(lay.call(module, (params, frozen), leaves), cots, lay.cot_dims)
            live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
            if not live:
                continue
            found = torch.autograd.grad(
                [o for o, _ in live], list(params.values()), [c for _, c in live], allow_unused=True
            )
        for name, g in zip(params, found):
            if g is not None:
                out[name][i] = g
    return out

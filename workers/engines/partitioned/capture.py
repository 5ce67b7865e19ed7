"""The hook path's forward: what every module that handles selected parameters saw and gave.

Holds ``Captured`` (one call of a layer with a rule: its input, its output and their versions),
``Copies`` (which modules hand the model a copy of their output), ``UnitCall`` (one call of a
module-VJP unit: all its arguments and its output's tensors), ``NotLocal`` (a handled module
whose parameters must go to an enclosing module instead, and why) and ``forward_capturing``
(one forward of the model that records them).

Inside its own forward each handling module sees detached copies of the selected parameters it
handles, so the graph holds no edge from the module to them: any edge left after the forward is
a use outside the module (``x @ layer.weight``), which per-class sums from its capture would
miss; that is checked on the graph (a walk, no computation) and reported as ``NotLocal``. A
module's output starts the graph when nothing before it needs a gradient. Where a model changes
a captured output in place (``ReLU(inplace=True)``, a residual ``h += x``), that module hands the
model a copy (``Copies``), so the gradient is taken at the module's own output: only the modules
found doing so, found in the forward of the first run (a ResNet's residual adds change 4 of its
26 captured outputs). A broadcast output (``[1, ...]`` from inputs with no sample dimension:
position embeddings of ``position_ids [1, T]``) is handed to the model expanded to the run's
``total`` samples, so its gradient comes per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from classgrad.workers.engines.base import parameters_kept, reaches_any
from classgrad.workers.engines.layer_rules.module_vjp import batch_dim

# Where a handled module's selected parameters live: (module holding it, its name there).
Holder = tuple[nn.Module, str]


class NotLocal(RuntimeError):
    """``module``'s parameters cannot be handled at ``module`` (used outside its forward, or an
    output with no sample dimension): an enclosing module must handle them."""

    def __init__(self, module: nn.Module, why: str):
        super().__init__(why)
        self.module = module


@dataclass(frozen=True)
class Captured:
    """One call of a layer with a rule: its input and output (the gradient is taken at ``output``)."""

    module: nn.Module
    inputs: torch.Tensor
    output: torch.Tensor
    input_version: int
    output_version: int

    @property
    def targets(self) -> list[torch.Tensor]:
        return [self.output] if self.output.requires_grad else []

    def input_modified(self) -> bool:
        """Whether the input was changed in place after the call (no copy of the output fixes that)."""
        return self.inputs._version != self.input_version

    def modified(self) -> bool:
        """Whether the input or output was changed in place after the call."""
        return self.input_modified() or self.output._version != self.output_version


@dataclass(frozen=True)
class UnitCall:
    """One call of a module-VJP unit: its arguments as called, its output's structure and the
    output tensors the gradient is taken at (``targets``: None where none can be)."""

    module: nn.Module
    args: tuple
    kwargs: dict
    spec: Any  # the output's pytree structure
    outputs: list[torch.Tensor | None]  # its leaves: the tensors that need a gradient, else None
    versions: list[tuple[torch.Tensor, int]]

    @property
    def targets(self) -> list[torch.Tensor]:
        return [t for t in self.outputs if t is not None and t.requires_grad]

    def modified(self) -> bool:
        return any(t._version != v for t, v in self.versions)

    def grad_outputs(self, found: dict[int, torch.Tensor]) -> Any:
        """The output's structure with the gradient at each tensor (None where there is none)."""
        leaves = [None if t is None else found.get(id(t)) for t in self.outputs]
        return pytree.tree_unflatten(leaves, self.spec)


class Copies:
    """Which handled modules hand the model a copy of their output (and, for a module-VJP unit,
    keep copies of their arguments): none at first, then the modules found with an output
    changed in place, or every module (``every``: a change found elsewhere, or refused by autograd)."""

    def __init__(self) -> None:
        self.modules: set[nn.Module] = set()
        self.every = False

    def __call__(self, module: nn.Module) -> bool:
        return self.every or module in self.modules

    def refused(self, leaves: list[nn.Module]) -> bool:
        """Autograd refused an in-place change in the forward (of an output that starts the
        graph, a leaf): copy the outputs of ``leaves``, then of every module; False when every
        module copied already."""
        if self.every:
            return False
        fresh = set(leaves) - self.modules
        self.modules |= fresh
        self.every = not fresh
        return True

    def widen(self, captured: list[Captured | UnitCall]) -> bool:
        """After a run with changed captures: copy more and run again (True), or nothing more
        can be copied (False)."""
        if self.every:
            return False
        changed = [c for c in captured if c.modified()]
        fresh = {c.module for c in changed} - self.modules
        # A unit copies its arguments too; a layer's changed input is no output of its own.
        if fresh and all(isinstance(c, UnitCall) or not c.input_modified() for c in changed):
            self.modules |= fresh
        else:
            self.every = True
        return True


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def forward_capturing(
    model: nn.Module,
    handled: dict[nn.Module, list[Holder]],
    units: set[nn.Module],
    x: object,
    context: Callable[[], AbstractContextManager],
    copies: Copies,
    call: Callable[[object], Any],  # the engine's ModelIO: model(x) as the model takes it, logits out
    total: int,
    expanded: list[nn.Module] | None = None,
) -> tuple[Any, list[Captured | UnitCall]] | None:
    """The model's output on ``x`` (a run of ``total`` samples) and every call of a module in
    ``handled`` (module -> where its selected parameters are), in call order: ``UnitCall`` for
    ``units``, ``Captured`` for the others. None when an in-place change of a captured output
    that starts the graph (a leaf) was refused by autograd: run again (``copies`` widened).

    With ``expanded`` (a list), broadcast outputs are handed on expanded to ``total`` samples
    and their modules appended to it; without, they are left as they are (their modules will be
    found not local)."""
    captured: list[Captured | UnitCall] = []
    real: dict[nn.Module, list[tuple[nn.Module, str, torch.Tensor]]] = {
        m: [(h, kind, getattr(h, kind)) for h, kind in holders] for m, holders in handled.items()
    }
    detached = {m: [(h, kind, p.detach()) for h, kind, p in params] for m, params in real.items()}
    calls: dict[nn.Module, list[tuple[tuple, dict, list]]] = {}

    def swap_in(module: nn.Module, args: tuple, kwargs: dict) -> None:
        for h, kind, p in detached[module]:
            h._parameters[kind] = p  # type: ignore[assignment]  # a detached copy, for one call
        if module in units:
            if copies(module):  # private copies: nothing the model does later can change them
                args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            calls.setdefault(module, []).append((args, kwargs, [(t, t._version) for t in _tensors((args, kwargs))]))

    leaves: list[nn.Module] = []  # modules whose outputs start the graph

    def start_graph(module: nn.Module, t: torch.Tensor) -> None:
        # Nothing before it needs a gradient: start the graph here (unless the model runs this
        # module under no_grad, where its parameters truly get no gradient).
        if not t.requires_grad and torch.is_grad_enabled() and t.is_floating_point():
            t.requires_grad_()
            leaves.append(module)

    def keep(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        for h, kind, p in real[module]:
            h._parameters[kind] = p  # type: ignore[assignment]  # the real parameter back
        if module in units:
            return keep_unit(module, output)
        inputs = args[0] if args else next(iter(kwargs.values()))  # layer(input=x) too
        start_graph(module, output)
        version = output._version
        if expanded is not None and total > 1 and output.shape[0] == 1 and inputs.shape[0] == 1:  # broadcast
            inputs, output = inputs.expand(total, *inputs.shape[1:]), output.expand(total, *output.shape[1:])
            expanded.append(module)
        captured.append(Captured(module, inputs, output, inputs._version, version))
        return output.clone() if copies(module) else output

    def keep_unit(module: nn.Module, output: Any) -> Any:
        args, kwargs, versions = calls[module].pop()
        leaves, spec = pytree.tree_flatten(output)
        per_sample_inputs = any(batch_dim(t, total, module) is not None for t in _tensors((args, kwargs)))
        outputs: list[torch.Tensor | None] = []
        handed = list(leaves)
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                outputs.append(None)
                continue
            start_graph(module, t)
            versions.append((t, t._version))
            broadcast = not per_sample_inputs and t.dim() >= 1 and t.shape[0] == 1 and t.requires_grad
            if expanded is not None and total > 1 and broadcast:
                t = t.expand(total, *t.shape[1:])
                expanded.append(module)
            outputs.append(t if t.requires_grad else None)
            handed[i] = t.clone() if copies(module) and t.requires_grad else t
        captured.append(UnitCall(module, args, kwargs, spec, outputs, versions))
        return pytree.tree_unflatten(handed, spec)

    handles = [m.register_forward_pre_hook(swap_in, with_kwargs=True) for m in handled]
    handles += [m.register_forward_hook(keep, with_kwargs=True) for m in handled]
    try:
        # parameters_kept: the real parameters are back even when the forward raised inside a module.
        with parameters_kept(model), context():
            out = call(x)
    except RuntimeError:
        if not copies.refused(leaves):
            raise
        return None
    finally:
        for handle in handles:
            handle.remove()
    grad_fns = [t.grad_fn for t in _tensors(out)]
    every = {id(p) for params in real.values() for _, _, p in params}
    if any(reaches_any(fn, every) for fn in grad_fns):
        for module, params in real.items():
            ids = {id(p) for _, _, p in params}
            if any(reaches_any(fn, ids) for fn in grad_fns):
                raise NotLocal(module, f"a selected parameter of {type(module).__name__} is used outside its forward")
    return out, captured

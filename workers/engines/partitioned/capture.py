"""The hook path's forward: the input and output of every layer that owns selected parameters.

Holds ``Captured`` (one layer call: its input, its output and their versions) and
``forward_capturing`` (one forward of the model that records them).

Inside its own forward each hooked layer sees detached copies of its selected parameters, so the
graph holds no edge from the layer to them: any edge left after the forward is a use outside the
layer (``x @ layer.weight``), which per-class sums from hooks would miss; that is checked on the
graph (a walk, no computation). A layer's output starts the graph when nothing before it needs a
gradient. A model that changes a captured output in place (``ReLU(inplace=True)``) gets copies
(``clone``), so the gradient is taken at the layer's own output.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from classgrad.workers.engines.base import parameters_kept, reaches_any


@dataclass(frozen=True)
class Captured:
    """One call of a hooked layer: its input and output (the gradient is taken at ``output``)."""

    module: nn.Module
    inputs: torch.Tensor
    output: torch.Tensor
    input_version: int
    output_version: int

    def modified(self) -> bool:
        """Whether the input or output was changed in place after the call."""
        return self.inputs._version != self.input_version or self.output._version != self.output_version


def forward_capturing(
    model: nn.Module,
    layers: dict[nn.Module, tuple[str, ...]],
    x: object,
    context: Callable[[], AbstractContextManager],
    clone: bool,
    call: Callable[[object], torch.Tensor],  # the engine's ModelIO: model(x) as the model takes it
) -> tuple[torch.Tensor, list[Captured]] | None:
    """The model's output on ``x`` and every call of a layer in ``layers`` (module -> names of its
    selected parameters), in call order. None when an in-place change of a layer output that
    starts the graph (a leaf) was refused by autograd: run again with ``clone``."""
    captured: list[Captured] = []
    real = {m: {kind: getattr(m, kind) for kind in kinds} for m, kinds in layers.items()}
    detached = {m: {kind: t.detach() for kind, t in params.items()} for m, params in real.items()}

    def swap_in(module: nn.Module, args: tuple) -> None:
        module._parameters.update(detached[module])

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        module._parameters.update(real[module])
        # Nothing before it needs a gradient: start the graph here (unless the model runs this
        # layer under no_grad, where its parameters truly get no gradient).
        if not output.requires_grad and torch.is_grad_enabled():
            output.requires_grad_()
        captured.append(Captured(module, args[0], output, args[0]._version, output._version))
        return output.clone() if clone else None

    handles = [m.register_forward_pre_hook(swap_in) for m in layers]
    handles += [m.register_forward_hook(keep) for m in layers]
    try:
        # parameters_kept: the real parameters are back even when the forward raised inside a layer.
        with parameters_kept(model), context():
            out = call(x)
    except RuntimeError:
        if clone:
            raise
        return None
    finally:
        for h in handles:
            h.remove()
    if reaches_any(out.grad_fn, {id(t) for params in real.values() for t in params.values()}):
        raise RuntimeError("a selected parameter of a hooked layer is also used outside that layer's forward")
    return out, captured

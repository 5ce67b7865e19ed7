"""The outer-product layers a projection inside the backward maps as matrices: layer knowledge the
layer rules own and every structure's plan reads.

Holds:

- ``UnitShape``: ``[a, b]`` of a weight as the outer-product sums form it, and whether its first
  axis is the layer's input;
- ``OUTER_SHAPES`` and ``LAZY_SHAPES`` (module types with an outer-product structure and their
  ``[a, b]`` view; the second for types of optional libraries, by name, so nothing is imported
  for them; ``register_rule(unit_shape=...)`` adds to the first), ``shape_for`` and
  ``outer_layers`` (the selected, hooked layers of such types: every structure's units, found
  one way);
- ``UNIT_MATRICES`` and ``unit_matrices``: the weight matrices of module-VJP units
  (``nn.LSTM``/``GRU``/``RNN``, ``nn.MultiheadAttention``; ``register_module_vjp(unit_matrices=...)``
  adds to it), which a structure may map like a Linear's ``[W | b]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from classgrad.store.core.params import ParamSlot

# [a, b] of a weight as the outer-product sums form it, and whether its first axis is the layer's
# input (then a bias is a constant-1 row of the matrix, and the gradient is the second factor).
UnitShape = tuple[int, int, bool]


def _conv_shape(m: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> UnitShape | None:
    if m.groups != 1:
        return None  # grouped/depthwise: no useful Kronecker structure (dense rest)
    return m.out_channels, m.weight[0].numel(), False


def _embedding_shape(m: nn.Embedding) -> UnitShape | None:
    if m.sparse or m.max_norm is not None or m.scale_grad_by_freq:
        return None  # refused by the embedding rule: the layer is not on the hook path anyway
    return m.num_embeddings, m.embedding_dim, True


def _hf_conv1d_shape(m: Any) -> UnitShape | None:
    rows, cols = m.weight.shape  # stored [in, out]
    return int(rows), int(cols), True


# Module type -> its UnitShape (None: not for this layer).
OUTER_SHAPES: dict[type[nn.Module], Callable[[Any], UnitShape | None]] = {
    nn.Linear: lambda m: (m.out_features, m.in_features, False),
    nn.Conv1d: _conv_shape,
    nn.Conv2d: _conv_shape,
    nn.Conv3d: _conv_shape,
    nn.Embedding: _embedding_shape,
}
# The same for types of optional libraries, by (module, class name): nothing is imported for them.
LAZY_SHAPES: dict[tuple[str, str], Callable[[Any], UnitShape | None]] = {
    ("transformers.pytorch_utils", "Conv1D"): _hf_conv1d_shape,
}


def shape_for(module: nn.Module) -> Callable[[Any], UnitShape | None] | None:
    """The ``UnitShape`` function for ``module``'s exact type, or None."""
    kind = type(module)
    return OUTER_SHAPES.get(kind) or LAZY_SHAPES.get((kind.__module__, kind.__qualname__))


ShapeLookup = Callable[[nn.Module], Callable[[Any], UnitShape | None] | None]


def outer_layers(
    slots: Sequence[ParamSlot],
    modules: dict[str, nn.Module],
    hooked: set[str],
    lookup: ShapeLookup = shape_for,
    skip: Callable[[str], bool] = lambda owner: False,
) -> Iterator[tuple[int, ParamSlot, ParamSlot | None, UnitShape]]:
    """``(index, weight, bias, shape)`` of every selected weight of a hooked module (``hooked``:
    the modules the hook path covers) whose type ``lookup`` gives a shape for, in layout order:
    the units of a structure's map (``skip``: module names left to the rest)."""
    by_name = {s.name: s for s in slots}
    for i, slot in enumerate(slots):
        owner, _, kind = slot.name.rpartition(".")
        module = modules.get(owner)
        if kind != "weight" or owner not in hooked or module is None or skip(owner):
            continue
        shape_of = lookup(module)
        shape = shape_of(module) if shape_of is not None else None
        if shape is not None:
            yield i, slot, by_name.get(f"{owner}.bias" if owner else "bias"), shape


def _recurrent_matrices(m: nn.RNNBase) -> list[tuple[str, str | None]]:
    bias = {"weight_ih": "bias_ih", "weight_hh": "bias_hh", "weight_hr": None}
    pairs: list[tuple[str, str | None]] = []
    for name in m._flat_weights_names:
        base, _, suffix = name.partition("_l")
        if base in bias:
            b = bias[base]
            pairs.append((name, f"{b}_l{suffix}" if b is not None and m.bias else None))
    return pairs


def _attention_matrices(m: nn.MultiheadAttention) -> list[tuple[str, str | None]]:
    if m.in_proj_weight is not None:
        pairs = [("in_proj_weight", "in_proj_bias" if m.in_proj_bias is not None else None)]
    else:  # separate q/k/v weights; their one in_proj_bias stays in the rest
        pairs = [("q_proj_weight", None), ("k_proj_weight", None), ("v_proj_weight", None)]
    return [*pairs, ("out_proj.weight", "out_proj.bias" if m.out_proj.bias is not None else None)]


# Module-VJP units (exactly these types) whose weight matrices are sketch units: the names, under
# the module, of each matrix and its bias (None: none). Such a unit hands over each class's whole
# gradients, and any matrix of them is sketched like a Linear's ``[W | b]`` (the map hashes its
# entries; nothing needs an outer product): for a recurrent layer each is also a sum of outer
# products over a class's samples and steps, for attention over its tokens.
UNIT_MATRICES: dict[type[nn.Module], Callable[[Any], list[tuple[str, str | None]]]] = {
    nn.LSTM: _recurrent_matrices,
    nn.GRU: _recurrent_matrices,
    nn.RNN: _recurrent_matrices,
    nn.MultiheadAttention: _attention_matrices,
}


def unit_matrices(
    slots: Sequence[ParamSlot], modules: dict[str, nn.Module], hooked: set[str]
) -> Iterator[tuple[int, ParamSlot, ParamSlot | None, UnitShape]]:
    """``(index, weight, bias, shape)`` of every selected weight matrix of a hooked module of an
    ``UNIT_MATRICES`` type (an LSTM's ``weight_hh_l1_reverse``, attention's ``in_proj_weight``,
    ...), as ``outer_layers`` (a bias that is not selected is left to the rest)."""
    index = {s.name: (i, s) for i, s in enumerate(slots)}
    for owner in sorted(hooked):
        module = modules.get(owner)
        pairs_of = UNIT_MATRICES.get(type(module)) if module is not None else None
        for weight, bias in pairs_of(module) if pairs_of is not None else ():
            found = index.get(f"{owner}.{weight}" if owner else weight)
            if found is None or len(found[1].shape) != 2:
                continue
            i, slot = found
            b = index.get(f"{owner}.{bias}" if owner else bias) if bias is not None else None
            yield i, slot, (b[1] if b is not None else None), (int(slot.shape[0]), int(slot.shape[1]), False)

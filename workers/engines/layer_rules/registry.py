"""The registry of layer rules: how one layer type's per-class parameter gradients come from hooks.

Holds ``LayerRule``, ``RULES`` (module type -> rule), ``register_rule`` (a decorator) and
``rule_for`` (the lookup; exact type, since a subclass may change ``forward``); for rows projected
inside the backward, one Protocol per layer family (``OuterSums``, ``TableSums``, ``EntrySums``),
a structure's ``ProjectedSums`` of them (checked by ``sums_refusal``), ``register_projected_sums``
(into ``PROJECTED_SUMS``, a ``classgrad.registry.Registry`` keyed by the units' structure) and
``projected_sums`` (the typed lookup by a unit's structure).

The partitioned engine's hook path runs a run of consecutive classes through one ordinary
forward, capturing at every layer that owns selected parameters its input ``x`` and (after one
backward that stops there) the gradient ``g`` at its output. A rule turns those into the layer's
per-class weight and bias gradients. Adding a layer type is adding one function::

    @register_rule(MyLayer, applies=lambda m: None if m.plain else "not plain")
    def my_layer_sums(module: MyLayer, seen: LayerCapture, out: LayerRows) -> None:
        G = seen.grads_by_class()           # [k, width, ...]: class i's samples, zero padding
        if out.wants("bias"):
            out.bound_by_values(bias := G.sum(dim=1))
            out.put("bias", bias)

The interface (types in ``rule_io`` and ``outer``):

- ``applies(module) -> str | None``: None when the rule is exact for this layer as configured,
  else why not (then a VJP of the module alone handles it: ``module_vjp``). Called once, when an
  engine is built.
- ``sums(module, seen, out)``: ``seen`` (``LayerCapture``) holds the layer's input and output
  gradient for the run's samples (``[total, ...]``, class after class, already divided by the
  fp16 loss scale) and lays them out by class (``[k, width, ...]``, padded with zero rows, which
  add exactly zero to any sum of products). ``out`` (``LayerRows``) receives per-class gradients
  ``[k, *parameter shape]`` with ``put(kind, value)`` for each ``kind`` it ``wants``; it may be
  handed a view of the rows to write into (``fresh``), so no temporary is made.
- Finite rows: every rule gives ``out`` cheap evidence that its sums are finite, either a bound
  (``out.bound(t)``: a tensor that is finite and below ``rule_io.FINITE_BOUND`` only if no entry
  can overflow) or the values themselves (``out.bound_by_values(*tensors)``: their largest
  magnitude, one pass, read with the run). Rows without that
  evidence go to the exact per-row check and are recomputed at a smaller fp16 loss scale.
- Layers whose weight gradient is a sum of outer products over tokens (Linear: one token per
  sample and position; Conv: one per output pixel, with the input patch as the input factor)
  do not form their sums themselves: they describe their factors (``outer.OuterFactors``) and
  call ``outer.class_outer_sums``, the one place that forms the per-class sums
  ``sum_t g_t x_t^T`` (and the bias sums ``sum_t g_t``). A projection inside the backward
  (``P_out (sum_t g_t x_t^T) P_in^T = sum_t (P_out g_t)(P_in x_t)^T``) goes there once, for
  every such layer: project the token factors, then the same batched product.
- Layers with any other structure (norm layers: sums of ``g`` and ``g * x_hat``) compute their
  per-class sums directly, as above.

What every rule gets for free, from the hook path (not the rules' job): a layer whose selected
parameters are also used outside its own forward is found on the autograd graph (its
parameters then go to the enclosing module's VJP), and so is a layer that sees no per-sample
dimension; a broadcast layer (input and output ``[1, ...]``, e.g. position embeddings of
``position_ids [1, T]``) is handed its input and output expanded to the run's samples; the first
run on each model in a process is checked against the plain single-class path
(``choices.HOOKS_CHECKED``); shared (tied) parameters (each holder's contribution is added),
layers with forward hooks (handled by their parent), and in-place changes of a captured input
or output are handled there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar, cast, overload

import torch
from torch import nn

from classgrad.errors import ConfigError
from classgrad.registry import Registry
from classgrad.workers.engines.layer_rules.layer_shapes import OUTER_SHAPES, UnitShape
from classgrad.workers.engines.layer_rules.rule_io import LayerCapture, LayerRows

# A rule's functions take modules of its own type (``LayerRule.module_type``).
M = TypeVar("M", bound=nn.Module)
SumsFn = Callable[[M, LayerCapture, LayerRows], None]
AppliesFn = Callable[[M], "str | None"]
# The decorated ``sums`` as written (one function may be registered for several types).
S = TypeVar("S", bound=Callable[[Any, LayerCapture, LayerRows], None])


def _always(module: nn.Module) -> str | None:
    return None


@dataclass(frozen=True)
class LayerRule(Generic[M]):
    """How per-class gradients of one module type's parameters ``kinds`` come from its hooks."""

    module_type: type[M]
    sums: SumsFn[M]
    applies: AppliesFn[M] = _always
    kinds: tuple[str, ...] = ("weight", "bias")
    live_tokens: bool = False
    # How the projection structures treat its weight: ``unit_shape(module) -> (a, b, input_first)``,
    # the weight as ``[a, b]`` sums of outer products (a Kronecker or TensorSketch unit: its
    # rule's sums go through ``outer.class_outer_sums``), or None for a layer that is not one
    # (for the built-in types the table is ``layer_shapes.OUTER_SHAPES``).
    unit_shape: Callable[[Any], UnitShape | None] | None = None


RULES: dict[type[nn.Module], LayerRule[Any]] = {}
# Rules for types of optional libraries, registered on first sight of such a module: importing
# the library up front (transformers: ~1 s) would slow every import of the engines.
# (defining module, class name) -> a function that registers the rule.
LAZY_RULES: dict[tuple[str, str], Callable[[], object]] = {}


def register_rule(
    module_type: type[M],
    *,
    applies: AppliesFn[M] | None = None,
    kinds: tuple[str, ...] = ("weight", "bias"),
    live_tokens: bool = False,
    unit_shape: Callable[[Any], UnitShape | None] | None = None,
    replace: bool = False,
) -> Callable[[S], S]:
    """Register the decorated ``sums(module, seen, out)`` as the rule for ``module_type``.

    ``applies(module)`` says why a given layer is outside the rule (None: it applies); ``kinds``
    are the parameter names the rule computes; ``live_tokens``: the rule reads ``seen.live``
    (on the CPU's routes the hook path then finds the live tokens of every such layer of a run
    in one read); ``unit_shape``: how the projection structures treat the weight (``LayerRule``),
    so that one registration says everything of the type. A type already registered needs
    ``replace=True``.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_rule needs an nn.Module subclass, got {module_type!r}")

    def decorate(sums: S) -> S:
        if module_type in RULES and not replace:
            raise ValueError(
                f"a layer rule for {module_type.__name__} is already registered "
                f"({RULES[module_type].sums.__qualname__}); pass replace=True to change it"
            )
        RULES[module_type] = LayerRule(module_type, sums, applies or _always, tuple(kinds), live_tokens, unit_shape)
        if unit_shape is not None:  # the maps' table of weight shapes (projection sits below the rules)
            OUTER_SHAPES[module_type] = unit_shape
        return sums

    return decorate


def register_lazy_rule(module_path: str, class_name: str, register: Callable[[], object]) -> None:
    """Call ``register()`` the first time ``rule_for`` meets ``module_path.class_name``."""
    LAZY_RULES[(module_path, class_name)] = register


def rule_for(module: nn.Module) -> LayerRule[Any] | None:
    """The rule registered for exactly this module's type, or None."""
    kind = type(module)
    if kind not in RULES:
        register = LAZY_RULES.pop((kind.__module__, kind.__qualname__), None)
        if register is not None:
            register()
    return RULES.get(kind)


# The per-class sums of projected rows inside the backward, one typed call per layer family, given
# by each structure (``ProjectedSums``, from its ``layer_sums()``) for the units it plans (``unit``:
# its unit type, ``KroneckerUnit``, ``SketchUnit``...; the layer rules depend on these Protocols alone).


class OuterSums(Protocol):
    """``"outer"``: a Linear-like layer's per-class weight (and bias) rows from its factors
    (``outer.class_outer_sums``; ``factors``: an ``outer.OuterFactors``, which imports this module)."""

    def __call__(self, factors: Any, out: LayerRows, unit: Any, /) -> None: ...


class TableSums(Protocol):
    """``"embedding"``: an ``nn.Embedding``'s per-class table rows from its lookups (``embedding_sums``)."""

    def __call__(self, module: nn.Embedding, seen: LayerCapture, out: LayerRows, unit: Any, /) -> None: ...


class EntrySums(Protocol):
    """``"entries"``: single entries of a class's weight matrix (an ``nn.EmbeddingBag``'s): ``values[t]``
    at ``(rows[t], columns[t])`` (columns None: the whole row) of class ``classes[t]``'s matrix."""

    def __call__(
        self,
        out: LayerRows,
        unit: Any,
        classes: torch.Tensor,
        rows: torch.Tensor,
        columns: torch.Tensor | None,
        values: torch.Tensor,
        /,
    ) -> None: ...


Family = Literal["outer", "embedding", "entries"]
# How many arguments each family's call passes (the Protocols' parameters, less ``self``).
FAMILY_ARITY: dict[str, int] = {
    family: len(inspect.signature(proto.__call__).parameters) - 1
    for family, proto in (("outer", OuterSums), ("embedding", TableSums), ("entries", EntrySums))
}


@dataclass(frozen=True)
class ProjectedSums:
    """A structure's sums inside the backward by layer family (``ProjectionStructure.layer_sums``):
    ``outer`` always; ``embedding`` and ``entries`` where its map plans units for those layers."""

    outer: OuterSums
    embedding: TableSums | None = None
    entries: EntrySums | None = None


def sums_refusal(sums: object) -> str | None:
    """Why ``sums`` cannot be a structure's ``layer_sums()`` (None: it can): not a
    ``ProjectedSums``, no ``outer``, or a family's callable that does not take its call's arguments."""
    if not isinstance(sums, ProjectedSums):
        return f"its layer_sums() gives {type(sums).__name__}, not a ProjectedSums"
    if sums.outer is None:
        return "its layer_sums() gives no outer sums"
    for family, arity in FAMILY_ARITY.items():
        fn = getattr(sums, family)
        if fn is None:
            continue
        if not callable(fn):
            return f"its {family} sums are not callable"
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: taken on trust
            continue
        try:
            signature.bind(*range(arity))
        except TypeError:
            name = getattr(fn, "__qualname__", repr(fn))
            return f"its {family} sums {name}{signature} do not take the {arity} arguments of {family} layers"
    return None


# The units' structure -> its sums. Filled by each structure's registration
# (``classgrad.workers.projection``), never here.
PROJECTED_SUMS: Registry[ProjectedSums] = Registry("projected sums")


def register_projected_sums(structure: str, sums: ProjectedSums, *, replace: bool = False) -> None:
    """``sums`` for the layers of units of ``structure`` (``sums_refusal`` checked by the one
    caller, ``structures.register_structure``, whose refusal names the structure); other sums
    already there are refused (a plugin reusing a built-in's units shares its sums, it does not
    replace them)."""
    held = PROJECTED_SUMS.find(structure)
    if held is not None and held != sums and not replace:
        raise ValueError(f"projected sums for {structure!r} units are already registered")
    PROJECTED_SUMS.register(structure, sums, replace=True)  # the same sums again: taken as they are


@overload
def projected_sums(family: Literal["outer"], unit: Any) -> OuterSums: ...
@overload
def projected_sums(family: Literal["embedding"], unit: Any) -> TableSums: ...
@overload
def projected_sums(family: Literal["entries"], unit: Any) -> EntrySums: ...
def projected_sums(family: Family, unit: Any) -> OuterSums | TableSums | EntrySums:
    """The sums of ``unit``'s structure for a layer of ``family``; a structure without them is one
    line naming it and the family (a ``ConfigError``: the job's structure cannot take this layer)."""
    sums = PROJECTED_SUMS.find(unit.structure)
    fn = None if sums is None else getattr(sums, family)
    if fn is None:
        raise ConfigError(
            f"projection structure {unit.structure!r} has no sums for {family} layers (its layer_sums() "
            f"gives no {family}): use projection.structure=dense"
        )
    return cast("OuterSums | TableSums | EntrySums", fn)

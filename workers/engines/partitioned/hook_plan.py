"""Which module handles each selected parameter on the hook path: a layer rule or a module-VJP unit.

Holds ``HookPlan`` (for every selected parameter, the module that handles it and how, with
``plan`` to make one, ``lifting`` to move a module's parameters to its parent, and ``summary``,
the short description the engine logs).

Each selected parameter is handled where it is held: by its module's layer rule when the rule
covers it (``layer_rules.rule_for``, ``applies``), else by a *unit*: a module-local VJP of the
module holding it (``layer_rules.module_vjp``). Every parameter below a
``nn.MultiheadAttention`` or a recurrent layer belongs to one unit, that layer. A module with
forward hooks of its own (they may change what it returns), or one found not to be local on a
run (a parameter used outside its forward, an output with no sample dimension: see
``capture.NotLocal``), hands its parameters to its parent as a unit: ``lifted``. A tied
parameter held by two modules is handled by both, their contributions added. ``plan`` returns
None only when a parameter would have to go above the model itself, or when hooks on every
module (``register_module_forward_hook``) may change any layer's input or output.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from torch import nn
from torch.nn.modules import module as module_state  # where global forward hooks are kept

from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.choices import VMAP_REFUSED
from classgrad.workers.engines.layer_rules import LayerRule, rule_for
from classgrad.workers.engines.layer_rules.module_vjp import WHOLE_UNIT_TYPES, UnitComputer, unit_computer_for
from classgrad.workers.engines.partitioned.capture import Holder
from classgrad.workers.layout import ParamLayout

log = logging.getLogger(__name__)


def _has_own_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


@dataclass(frozen=True)
class HookPlan:
    """The modules that handle the selected parameters.

    ``layers``: handling module -> {name relative to it: slot}; ``rules`` and ``units`` split
    them by how; ``holders``: handling module -> where each of its parameters is held (swapped
    for detached copies during its forward); ``names``: each module's name in the model.
    """

    layers: dict[nn.Module, dict[str, ParamSlot]]
    rules: dict[nn.Module, LayerRule]
    units: dict[nn.Module, UnitComputer]
    holders: dict[nn.Module, list[Holder]]
    names: dict[nn.Module, str]
    lifted: frozenset[nn.Module] = frozenset()
    # Why a module with a registered rule is a unit instead (the rule does not apply to it).
    why_unit: tuple[tuple[nn.Module, str], ...] = ()

    @classmethod
    def plan(cls, model: nn.Module, layout: ParamLayout, lifted: frozenset[nn.Module] = frozenset()) -> HookPlan | None:
        if module_state._global_forward_hooks or module_state._global_forward_pre_hooks:
            return None  # hooks on every module (they may change a layer's input or output)
        modules = dict(model.named_modules())
        names = {m: name for name, m in modules.items()}
        slot_of = {id(p): s for s, p in zip(layout.slots, layout.parameters(model))}
        # handling module's name -> [(holder, holder's name, kind, slot)]
        entries: dict[str, list[tuple[nn.Module, str, str, ParamSlot]]] = collections.defaultdict(list)
        for hname, holder in modules.items():
            for kind, p in holder._parameters.items():
                if p is None or id(p) not in slot_of:
                    continue
                at = hname
                parts = hname.split(".") if hname else []
                for i in range(len(parts) + 1):  # the outermost attention or recurrent layer
                    prefix = ".".join(parts[:i])
                    if isinstance(modules[prefix], WHOLE_UNIT_TYPES):
                        at = prefix
                        break
                while modules[at] in lifted or _has_own_hooks(modules[at]):
                    if at == "":
                        return None
                    at = at.rpartition(".")[0]
                entries[at].append((holder, hname, kind, slot_of[id(p)]))
        layers: dict[nn.Module, dict[str, ParamSlot]] = {}
        rules: dict[nn.Module, LayerRule] = {}
        units: dict[nn.Module, UnitComputer] = {}
        holders: dict[nn.Module, list[Holder]] = {}
        why_unit: list[tuple[nn.Module, str]] = []
        for at, found in entries.items():
            mod = modules[at]
            slots: dict[str, ParamSlot] = {}
            for _, hname, kind, slot in found:
                rel = (hname[len(at) + 1 :] + "." if at else hname + ".") + kind if hname != at else kind
                if slot not in slots.values():  # a tensor tied within one module: once
                    slots[rel] = slot
            layers[mod] = slots
            holders[mod] = [(holder, kind) for holder, _, kind, _ in found]
            rule = rule_for(mod)
            direct = all(holder is mod for holder, _, _, _ in found)
            if rule is not None and direct and all(kind in rule.kinds for kind in slots):
                reason = rule.applies(mod)
                if reason is None:
                    rules[mod] = rule
                    continue
                log.debug("partitioned: %s by its module's VJP (%s)", at or "the model", reason)
                why_unit.append((mod, reason))
            units[mod] = unit_computer_for(mod)
        return cls(layers, rules, units, holders, names, frozenset(lifted), tuple(why_unit))

    def lifting(self, model: nn.Module, layout: ParamLayout, module: nn.Module) -> HookPlan | None:
        """The plan with ``module``'s parameters handled by its parent (None: it is the model)."""
        return HookPlan.plan(model, layout, self.lifted | {module})

    def summary(self) -> str:
        """``hooks for 98 params (Linear 72, ...); module VJP for 2 (ViTEmbeddings: cls_token, ...)``."""
        by_rule: collections.Counter[str] = collections.Counter()
        for mod in self.rules:
            by_rule[type(mod).__name__] += len(self.layers[mod])
        by_unit: dict[str, dict[str, None]] = {}
        looped: dict[str, str] = {}
        for mod in self.units:
            kinds = by_unit.setdefault(type(mod).__name__, {})
            kinds.update(dict.fromkeys(self.layers[mod]))
            if mod in VMAP_REFUSED:
                looped.setdefault(type(mod).__name__, VMAP_REFUSED[mod])
        parts = []
        if by_rule:
            counts = ", ".join(f"{t} {n}" for t, n in by_rule.most_common())
            parts.append(f"hooks for {sum(by_rule.values())} params ({counts})")
        if by_unit:
            n = sum(len(self.layers[m]) for m in self.units)
            shown = []
            for t, kinds in by_unit.items():
                names = list(kinds)
                shown.append(f"{t}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}")
            parts.append(f"module VJP for {n} ({'; '.join(shown[:6])}{'; ...' if len(shown) > 6 else ''})")
        for t, why in dict((type(m).__name__, reason) for m, reason in self.why_unit).items():
            parts.append(f"{t} not by its rule ({why[:80]})")
        for t, why in looped.items():
            parts.append(f"{t} class by class (vmap: {why[:100]})")
        return "; ".join(parts)

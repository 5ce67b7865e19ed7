"""``classgrad.registry.Registry``: names to plugins, a taken name refused, an unknown one a
one-line error of the registry's own type listing the choices, and each name published in (and
taken back from) a config key's ``Choices``."""

from __future__ import annotations

import pytest

from classgrad.config.choices import Choices
from classgrad.errors import ConfigError, InputError
from classgrad.registry import Registry


def test_names_in_registration_order_with_mapping_like_access() -> None:
    reg: Registry[int] = Registry("widget")
    assert reg.register("b", 2) == 2
    reg.register("a", 1)
    assert reg.names() == ("b", "a")
    assert list(reg) == ["b", "a"]
    assert len(reg) == 2
    assert "a" in reg and "c" not in reg and 3 not in reg
    assert reg.get("a") == 1 and reg["b"] == 2
    assert reg.find("c") is None and reg.find("a") == 1


def test_a_taken_name_is_refused_unless_replace() -> None:
    reg: Registry[int] = Registry("loss kind")
    reg.register("x", 1)
    with pytest.raises(ValueError, match=r"^loss kind 'x' is already registered$"):
        reg.register("x", 2)
    assert reg.get("x") == 1
    reg.register("x", 2, replace=True)
    assert reg.get("x") == 2


def test_an_unknown_name_is_the_registrys_own_one_line_error_with_sorted_choices() -> None:
    reg: Registry[int] = Registry(
        "w", unknown="w.kind {name!r} is unknown (choices: auto, {choices})", error=InputError
    )
    reg.register("zeta", 1)
    reg.register("alpha", 2)
    with pytest.raises(InputError, match=r"^w\.kind 'nope' is unknown \(choices: auto, alpha, zeta\)$"):
        reg.get("nope")
    with pytest.raises(InputError):
        reg["nope"]
    default: Registry[int] = Registry("w")
    with pytest.raises(ConfigError, match=r"^\['un', 'hashable'\] is unknown \(choices: \)$"):
        default.get(["un", "hashable"])  # type: ignore[arg-type]


def test_names_are_published_with_traits_and_taken_back() -> None:
    names = Choices("test.kind")
    reg: Registry[str] = Registry("test kind", choices=names)
    reg.register("plain", "p")
    reg.register("fancy", "f", traits=("dense",))
    assert names._traits == {"plain": frozenset(), "fancy": frozenset({"dense"})}
    assert reg.unregister("fancy") == "f"
    assert reg.unregister("fancy") is None
    assert "fancy" not in reg and list(names._traits) == ["plain"]

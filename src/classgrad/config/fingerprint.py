"""The fingerprint: what makes two stores interchangeable, and the check that resumes old stores.

Holds:

- ``FINGERPRINT_VERSION`` and ``FINGERPRINT_FIELDS`` (the sections and fields hashed);
- ``fingerprint``: sha256 of the canonical JSON of the hashed fields of the given sections;
- ``recorded_fingerprint``: today's fingerprint of a config recorded in a store by any earlier
  classgrad (so a store whose recorded fingerprint came from an older scheme can still be
  recognised as the same job);
- ``differing_keys``: the hashed keys (``model.kwargs.seed``) on which a recorded config and
  given sections differ, to name them when a store is refused.

Version 2 hashes only the fields that differ from their defaults, with import paths in their
canonical spelling: adding a key with a default, or renaming a module that keeps an alias, leaves
every existing fingerprint unchanged. Changing a default of a hashed field is therefore a change
of what existing fingerprints mean: bump ``FINGERPRINT_VERSION`` when doing it, unless the
store's structure check already refuses every store the change would misread (``projection.rest``
went from dense to sketch that way: a Kronecker store records its projection, and the refusal
names the setting that resumes it; the key means nothing to other stores, which a bump would
all have refused), or unless a resume runs what the store records (``projection.structure`` went
from dense to unset that way: unset means tensorsketch for a new store and the recorded
structure on a resume, ``preparation.recorded_projection``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from classgrad.config.compute import EngineConfig, ParamsConfig, PrecisionConfig
from classgrad.config.fields import Section, canonical_import_path
from classgrad.config.inputs import DataConfig, LossConfig, ModelConfig
from classgrad.config.placement import ShardingConfig, StoreConfig
from classgrad.config.projection import ProjectionConfig

__all__ = ["FINGERPRINT_FIELDS", "FINGERPRINT_VERSION", "differing_keys", "fingerprint", "recorded_fingerprint"]

# 1: every hashed field, module names as written. 2: only non-default fields, canonical import paths.
FINGERPRINT_VERSION = 2

# Fields of a section that change the stored bytes; None = every field of the section.
# Everything else (where the store is, how the job runs) may differ between a run and its resume.
FINGERPRINT_FIELDS: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "data": None,
    "loss": None,
    "precision": None,
    "params": None,
    "engine": ("kind", "block_rows", "group_rows"),
    "sharding": ("shard_rows",),
    "store": ("dtype", "row_chunk", "col_chunk", "codec", "sharded"),
    "projection": None,
}
_SECTION_MODELS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "loss": LossConfig,
    "precision": PrecisionConfig,
    "params": ParamsConfig,
    "engine": EngineConfig,
    "sharding": ShardingConfig,
    "store": StoreConfig,
    "projection": ProjectionConfig,
}
# Fields holding `module:function` paths (loss.kind and data.collate only when they have a colon).
_IMPORT_PATH_FIELDS = (("model", "factory"), ("data", "factory"), ("data", "collate"), ("loss", "kind"))


def _is_default(model: type[Section], key: str, value: Any) -> bool:
    info = model.model_fields[key]
    if info.is_required():
        return False
    # Defaults are JSON scalars, [] or {}; JSON round-trip puts them in model_dump(mode="json") form.
    return value == json.loads(json.dumps(info.get_default(call_default_factory=True)))


def fingerprint(sections: Mapping[str, Section]) -> str:
    """sha256 hex of the canonical JSON of the non-default hashed fields of ``sections``.

    ``sections`` maps each name in ``FINGERPRINT_FIELDS`` to its validated section.
    """
    selected: dict[str, Any] = {"fingerprint_version": FINGERPRINT_VERSION, **_selected(sections)}
    canonical = json.dumps(selected, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _selected(sections: Mapping[str, Section]) -> dict[str, Any]:
    """section -> its non-default hashed fields (canonical import paths); sections at defaults left out."""
    selected: dict[str, Any] = {}
    for name, fields in FINGERPRINT_FIELDS.items():
        section = sections[name]
        values = section.model_dump(mode="json")
        for path_section, key in _IMPORT_PATH_FIELDS:
            if path_section == name and ":" in values[key]:
                values[key] = canonical_import_path(values[key])
        keys = tuple(values) if fields is None else fields
        changed = {k: values[k] for k in keys if not _is_default(type(section), k, values[k])}
        if changed:  # a section left at its defaults adds nothing, like a key left at its default
            selected[name] = changed
    return selected


def recorded_fingerprint(recorded: Any) -> str | None:
    """Today's fingerprint of a job config recorded in a store (``attrs["config"]``), or None when
    it is not one today's schema accepts (then it cannot be shown to be the same job).

    Only the hashed fields are read: sections and keys that do not change the stored bytes (and
    the redacted secrets among them) are ignored, and keys added since take their defaults.
    """
    sections = _recorded_sections(recorded)
    return None if sections is None else fingerprint(sections)


def differing_keys(sections: Mapping[str, Section], recorded: Any) -> list[str] | None:
    """The hashed keys, as dotted paths into mappings (``model.kwargs.seed``), whose values differ
    between ``sections`` and the config ``recorded`` in a store; None when the recorded config is
    not one today's schema reads (then no key can be named)."""
    old = _recorded_sections(recorded)
    if old is None:
        return None
    return sorted(_paths_that_differ(_selected(sections), _selected(old)))


def _paths_that_differ(a: Any, b: Any, prefix: str = "") -> set[str]:
    # A section or mapping left at its defaults is absent: compare it as empty, key by key.
    a = {} if a is None and isinstance(b, Mapping) else a
    b = {} if b is None and isinstance(a, Mapping) else b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out: set[str] = set()
        for key in set(a) | set(b):
            out |= _paths_that_differ(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return set() if a == b else {prefix.rstrip(".")}


def _recorded_sections(recorded: Any) -> dict[str, Section] | None:
    """The hashed sections of a recorded config under today's schema, or None."""
    if not isinstance(recorded, Mapping):
        return None
    sections: dict[str, Section] = {}
    for name, fields in FINGERPRINT_FIELDS.items():
        raw = recorded.get(name) or {}
        if not isinstance(raw, Mapping):
            return None
        if fields is not None:
            raw = {k: v for k, v in raw.items() if k in fields}
        try:
            sections[name] = _SECTION_MODELS[name].model_validate(raw)
        except ValidationError:
            return None
    return sections

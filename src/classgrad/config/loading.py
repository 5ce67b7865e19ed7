"""Loading a job: YAML file and ``--set a.b=c`` overrides -> ``JobConfig``, problems on one line.

Holds ``load_config`` and what it needs: a YAML loader that refuses duplicate keys and documents
that expand (through aliases) to more than ``MAX_YAML_NODES`` values, the
override parser (a path that names no field is refused, listing the keys), and the translation
of pydantic's validation errors into one ``ConfigError`` line that names the field.
"""

from __future__ import annotations

import copy
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from classgrad.config.job import JobConfig
from classgrad.config.projection import (
    STRUCTURE_KEY_ERROR,
    ProjectionConfig,
    projection_keys,
    projection_options_models,
)
from classgrad.errors import ConfigError

__all__ = ["MAX_YAML_NODES", "load_config"]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (plain safe_load silently keeps the last one)."""


def _construct_mapping_no_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    # Checked before merge keys ("<<: *base") are flattened: overriding a merged key is fine.
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # an unhashable (complex) key; construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_duplicates)


# The most values (scalars, lists and mappings, each alias counted as everything it stands for)
# a job file or a --set value may expand to: a real job file has a few hundred; a YAML alias
# bomb (aliases of aliases) of a kilobyte expands to millions, and every copy made of the
# loaded config (merging, validation) multiplies its memory.
MAX_YAML_NODES = 100_000


def _expanded_size(root: yaml.Node) -> int:
    """How many values ``root`` stands for once every alias is expanded, without expanding them
    (a node reached twice is counted twice, its size computed once); stops past ``MAX_YAML_NODES``."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if depth > 100:  # deeper than any job file; also keeps the recursion bounded
            return MAX_YAML_NODES + 1
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_YAML_NODES:
                break
        sizes[id(node)] = total
        return total

    return size(root, 0)


def _load_yaml(text: str, where: str) -> Any:
    """``text`` parsed with the strict loader, refusing a document that expands (through aliases)
    to more than ``MAX_YAML_NODES`` values before anything is built from it."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_YAML_NODES:
            raise ConfigError(
                f"config error: {where}: expands to more than {MAX_YAML_NODES} values "
                f"(YAML aliases of aliases?); refusing to build it"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.YAMLError) -> tuple[int | None, str]:
    """(1-based line or None, short description) of a YAML error, on one line."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    text = f"{context}: {problem}" if context and "duplicate key" not in problem else problem
    return line, " ".join(str(text).split())


def _read_yaml_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    name = str(path)
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config error: {name}: not found")
    if not p.is_file():
        raise ConfigError(f"config error: {name}: not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config error: {name}: cannot read ({exc})") from None
    try:
        data = _load_yaml(text, name)
    except yaml.YAMLError as exc:
        line, problem = _yaml_problem(exc)
        where = f"{name} line {line}" if line is not None else name
        raise ConfigError(f"config error: {where}: malformed YAML ({problem})") from None
    if data is None:  # an empty file means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config error: {name}: the top level must be a mapping of sections "
            f"({', '.join(JobConfig.model_fields)}), got {_type_word(data)}"
        )
    return data


def _type_word(value: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "null"}.get(type(value), type(value).__name__)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`, merging nested mappings key by key (used for base + file)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _field_annotation_kind(annotation: Any) -> type[BaseModel] | str:
    """A section model class, "mapping" for free-form dict fields, or "leaf"."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is dict:
        return "mapping"
    return "leaf"


def _section_keys(model: type[BaseModel]) -> str:
    return ", ".join(sorted(_keys_of(model)))


def _keys_of(model: type[BaseModel]) -> set[str]:
    """The keys a section takes (``projection``: those of every structure; which of them apply is
    checked against the structure once the section is validated)."""
    return projection_keys() if model is ProjectionConfig else set(model.model_fields)


def _check_override_path(parts: list[str], raw_key: str) -> None:
    """Refuse a --set path that names no field (free-form mappings accept any sub-key)."""
    node: type[BaseModel] | str = JobConfig
    for depth, part in enumerate(parts):
        if node == "mapping":
            return
        if node == "leaf":
            parent = ".".join(parts[:depth])
            raise ConfigError(f"config error: --set {raw_key}: {parent} is not a mapping")
        assert isinstance(node, type)
        if part not in _keys_of(node):
            what = "unknown section" if node is JobConfig else "unknown key"
            raise ConfigError(f"config error: --set {raw_key}: {what} (choices: {_section_keys(node)})")
        node = _field_annotation_kind(_field_of(node, part).annotation)


def _field_of(model: type[BaseModel], key: str) -> Any:
    if model is ProjectionConfig:  # the first structure's options that declare it
        return next(m.model_fields[key] for m in projection_options_models().values() if key in m.model_fields)
    return model.model_fields[key]


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw_value = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        # Not "key=value": the CLI's redaction reads that as a secret-looking pair and masks it.
        raise ConfigError(f"config error: --set {override}: expected section.field=value")
    _check_override_path(parts, key)
    try:
        # A YAML scalar or flow value, so "3" is an int, "true" a bool, "[a, b]" a list and
        # "null" None, exactly as they would be in the file.
        value = _load_yaml(raw_value, f"--set {key}")
    except yaml.YAMLError as exc:
        _, problem = _yaml_problem(exc)
        raise ConfigError(f"config error: --set {key}: malformed value ({problem})") from None
    if len(parts) == 1 and value is None:
        # In a file, an empty section (every line commented out) means its defaults; on the
        # command line, `model=null` is a typo or a wish to reset that the user must spell out.
        raise ConfigError(
            f"config error: --set {key}=null: a section cannot be null (to reset it to its defaults: --set {key}={{}})"
        )
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            parent = ".".join(parts[: depth + 1])
            raise ConfigError(f"config error: --set {key}: {parent} is {_type_word(child)}, not a mapping")
        node = child
    node[parts[-1]] = value


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_loc(loc: Sequence[int | str]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def section_at(loc: Sequence[int | str], root: type[BaseModel] = JobConfig) -> type[BaseModel] | None:
    """The section model at ``loc`` (a validation error's location) below ``root``; None where a
    step names no section (a free-form mapping, a leaf, or no field)."""
    node: type[BaseModel] | str = root
    for part in loc:
        if not isinstance(node, type) or part not in node.model_fields:
            return None
        node = _field_annotation_kind(node.model_fields[part].annotation)
    return node if isinstance(node, type) else None


def _error_line(err: Mapping[str, Any]) -> str:
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    msg = str(err.get("msg", ""))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind == "extra_forbidden":
        parent = section_at(loc[:-1])
        what = "unknown section" if parent is JobConfig else "unknown key"
        msg = f"{what} (choices: {_section_keys(parent)})" if parent else "unknown key"
    elif kind == STRUCTURE_KEY_ERROR:
        loc = (*loc, err["ctx"]["key"])
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = f"expected a mapping, got {_type_word(err.get('input'))}"
    elif kind == "literal_error" or kind.endswith("_parsing"):
        msg = f"{msg}, got {_short_repr(err.get('input'))}"
    elif kind.endswith("_type"):
        msg = f"{msg}, got {_type_word(err.get('input'))}"
    where = _format_loc(loc)
    return f"{where}: {msg}" if where else msg


def _validation_message(exc: ValidationError) -> str:
    # Unknown keys first: a misspelt key usually also makes its intended key "required", and
    # the misspelling is the thing to fix.
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    line = f"config error: {_error_line(errors[0])}"
    if len(errors) > 1:
        line += f" (and {len(errors) - 1} more)"
    return " ".join(line.split())  # one line, whatever a message contained


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> JobConfig:
    """Build a `JobConfig` from `base` (a mapping), then the YAML file at `path` merged over it,
    then each ``"a.b=c"`` override in order (the value parsed as YAML; an override replaces the
    value at its path, a whole mapping included).

    Raises `ConfigError` with one line naming the field (or the file, or the override) for
    every problem.
    """
    if base is not None and not isinstance(base, Mapping):
        raise ConfigError(f"config error: the base config must be a mapping, got {_type_word(base)}")
    data: dict[str, Any] = copy.deepcopy(dict(base)) if base is not None else {}
    if path is not None:
        data = _deep_merge(data, _read_yaml_file(path))
    if isinstance(overrides, str):  # a lone "a=b" would otherwise be iterated per character
        overrides = (overrides,)
    for override in overrides:
        _apply_override(data, override)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc)) from None

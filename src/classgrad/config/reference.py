"""The job file reference in README.md, generated from the config's field descriptions.

Holds ``config_reference_markdown`` (one table per section: key, type, default, description);
``scripts/config_reference.py`` keeps README's block equal to it, so the two cannot drift.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel

from classgrad.config.choices import Choices
from classgrad.config.job import JobConfig
from classgrad.config.projection import ProjectionConfig, projection_options_models

__all__ = ["config_reference_markdown"]


def _describe_type(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *extra = typing.get_args(annotation)
        return _describe_type(inner, [*metadata, *extra])
    names = next((m for m in metadata if isinstance(m, Choices)), None)
    if names is not None:  # a registry-backed key: the names registered now
        return " \\| ".join(f"`{v}`" for v in names)
    if origin is Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        text = " or ".join(_describe_type(a, metadata) for a in args)
        return f"{text} or null" if len(args) < len(typing.get_args(annotation)) else text
    if origin is dict:
        return "mapping"
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"list of {_describe_type(item)}"
    name = getattr(annotation, "__name__", str(annotation))
    bounds = []
    for meta in metadata:
        for attr, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            bound = getattr(meta, attr, None)
            if bound is not None and isinstance(meta, annotated_types.BaseMetadata):
                bounds.append(f"{symbol} {bound}")
    return f"{name} {', '.join(bounds)}" if bounds else name


def _describe_default(info: Any) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _table(title: str, model: type[BaseModel], keys: Sequence[str]) -> list[str]:
    doc = " ".join((model.__doc__ or "").split())
    lines = [title, "", doc, "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key in keys:
        info = model.model_fields[key]
        type_text = _describe_type(info.annotation, info.metadata)
        description = (info.description or "").replace("|", "\\|")
        lines.append(f"| `{key}` | {type_text} | {_describe_default(info)} | {description} |")
    return [*lines, ""]


def config_reference_markdown() -> str:
    """The job file reference (one table per section, and per projection structure its own keys)
    rendered from the field descriptions. A structure registered from outside classgrad (a
    plugin's) is left out: the reference is the package's."""
    lines: list[str] = []
    for section, section_info in JobConfig.model_fields.items():
        model = _section_model(section_info.annotation)
        lines += _table(f"### `{section}`", model, list(model.model_fields))
        if model is ProjectionConfig:
            for structure, options in projection_options_models().items():
                if structure is None or not options.__module__.startswith("classgrad."):
                    continue
                own = [k for k in options.model_fields if k not in ProjectionConfig.model_fields]
                lines += _table(f"#### `projection` with `structure: {structure}`", options, own)
    return "\n".join(lines)


def _section_model(annotation: Any) -> type[BaseModel]:
    if typing.get_origin(annotation) is Annotated:  # SerializeAsAny[...]
        annotation = typing.get_args(annotation)[0]
    assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation

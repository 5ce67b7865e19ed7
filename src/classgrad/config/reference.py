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


def config_reference_markdown() -> str:
    """The job file reference (one table per section) rendered from the field descriptions."""
    lines: list[str] = []
    for section, section_info in JobConfig.model_fields.items():
        model = section_info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        doc = " ".join((model.__doc__ or "").split())
        lines += [f"### `{section}`", "", doc, "", "| key | type | default | description |"]
        lines.append("| --- | --- | --- | --- |")
        for key, info in model.model_fields.items():
            type_text = _describe_type(info.annotation, info.metadata)
            description = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{key}` | {type_text} | {_describe_default(info)} | {description} |")
        lines.append("")
    return "\n".join(lines)

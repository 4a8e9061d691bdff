"""The config reference page, generated from the pydantic models so it cannot drift from them.

    python -m autotuner.config.reference > docs/config_reference.md

One table per section: each key with its type, its default and its `Field(description=...)`.
tests/integration/test_docs.py fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from autotuner.config.keys import section_model
from autotuner.config.models import DeepSpeedConfig

HEADER = """# Config reference

Generated from the config models (`python -m autotuner.config.reference > docs/config_reference.md`;
the suite fails when this page and the models differ). Every key of every section we read, its
type, its default and what it means here. Names and meanings are DeepSpeed's unless the
description says "ours"; [Config](config.md) says what happens to each top-level DeepSpeed key.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type_text(annotation: Any) -> str:
    """A type as a user reads it: `int > 0 | "auto" | null`, `list of bool`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        bounds = [_bound(m) for m in args[1:]] + [_bound(m) for f in args[1:] for m in getattr(f, "metadata", ())]
        return " ".join([_type_text(args[0]), *[b for b in bounds if b]])
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_text(arg) for arg in args)
    if origin is typing.Literal:
        return " | ".join(f'"{arg}"' if isinstance(arg, str) else repr(arg) for arg in args)
    if origin in (list, tuple):
        inner = _type_text(args[0]) if args else ""
        return f"list of ({inner})" if " | " in inner else f"list of {inner}" if inner else "list"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", repr(annotation))


def _bound(metadata: Any) -> str:
    for name, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        value = getattr(metadata, name, None)
        if value is not None and type(metadata).__name__.lower() == name:
            return f"{sign} {value}"
    return ""


def _default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{field.default!r}`"


def _tables(model: type[BaseModel], path: str, out: list[str]) -> None:
    rows, sections = [], []
    for name, field in model.model_fields.items():
        meaning = _cell(field.description or "")
        section = section_model(field.annotation)
        key = f"{path}.{name}" if path else name
        if section is not None:
            sections.append((section, key))
            rows.append(f"| `{name}` | section: see `{key}` | {_default_text(field)} | {meaning} |")
            continue
        kind = _cell(" ".join([_type_text(field.annotation), *[b for b in map(_bound, field.metadata) if b]]))
        rows.append(f"| `{name}` | {kind} | {_default_text(field)} | {meaning} |")
    out += [f"## `{path or 'top level'}`", ""]
    if model.__doc__ and path:
        out += [" ".join(model.__doc__.split()), ""]
    out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for section, key in sections:
        _tables(section, key, out)


def reference_markdown() -> str:
    out = [HEADER]
    _tables(DeepSpeedConfig, "", out)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())

"""JSON schemas as the adapters send them to constrained decoding.

The adapters' hosts make their schemas from types whose fields are the whole of them (pydantic
models, TypedDicts, a function's parameters); JSON Schema leaves an object open to members it does
not name unless it says `additionalProperties: false`, and a small model held to the open schema
may well write the schema's own keywords as extra members. `closed` closes such objects, so a
reply holds exactly the members its schema names.
"""

from __future__ import annotations

from typing import Any

VALUES = ("enum", "const", "default", "examples")  # members whose values are data, not schemas


def closed(schema: Any) -> Any:
    """The schema with every object schema that names its `properties` and says nothing of
    others closed (`additionalProperties: false`), at every depth; a free-form object (no
    `properties`) and whatever a schema says of `additionalProperties` are kept."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in VALUES else closed(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out

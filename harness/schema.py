"""The subset of JSON Schema that tool parameters use, checked against model-written arguments.

Supported: ``type`` (string, integer, number, boolean, array, object, null, or a list of them), ``properties``,
``required``, ``additionalProperties: false``, ``items``, ``enum``. Anything else in a schema is ignored. Every
message names the parameter, what was given and what is valid, because it goes back to the model verbatim.
"""

from __future__ import annotations

from typing import Any

_PY = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _short(v: Any, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def types_of(schema: dict) -> list[str]:
    t = schema.get("type")
    if t is None:
        return []
    return list(t) if isinstance(t, list) else [t]


def _type_ok(value: Any, types: list[str]) -> bool:
    if not types:
        return True
    for t in types:
        py = _PY.get(t)
        if py is None:
            continue
        # bool is an int in Python but not in JSON
        if t in ("integer", "number") and isinstance(value, bool):
            continue
        if isinstance(value, py):
            return True
    return False


def check_value(schema: dict, value: Any, where: str) -> str | None:
    types = types_of(schema)
    if not _type_ok(value, types):
        return f"{where} must be {' or '.join(types)}, got {type(value).__name__} {_short(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {', '.join(map(repr, schema['enum']))}, got {_short(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            err = check_value(schema["items"], v, f"{where}[{i}]")
            if err:
                return err
    if isinstance(value, dict) and ("properties" in schema or "required" in schema):
        return check_object(schema, value, where)
    return None


def check_object(schema: dict, args: Any, where: str = "arguments") -> str | None:
    """None when ``args`` satisfies the object ``schema``, else one message saying what is wrong."""
    if not isinstance(args, dict):
        return f"{where} must be a JSON object, got {type(args).__name__} {_short(args)}"
    props: dict = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"{where}: missing required parameter(s) {', '.join(missing)} (parameters: {', '.join(props) or 'none'})"
    if schema.get("additionalProperties") is False:
        unknown = [k for k in args if k not in props]
        if unknown:
            return (
                f"{where}: unknown parameter(s) {', '.join(map(repr, unknown))}; "
                f"valid parameters: {', '.join(props) or 'none'}"
            )
    for k, v in args.items():
        if k in props:
            err = check_value(props[k], v, f"parameter {k!r}")
            if err:
                return err
    return None

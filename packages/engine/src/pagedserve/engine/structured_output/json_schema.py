"""The checks a JSON schema passes before it is compiled: well-formed, and nothing xgrammar
would quietly leave unenforced.

xgrammar compiles a schema with ``uniqueItems`` or ``not`` in it without complaint and then does
not enforce them, so an output could "follow the schema" and fail to validate against it. Such a
keyword is refused with a 400 naming it, as OpenAI refuses keywords its strict mode does not
support. The schema itself is checked against its metaschema with ``jsonschema`` first, so that
``{"type": "strnig"}`` is called an invalid schema, not a compile error.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.errors import InvalidRequestError

# Keywords that constrain instances and that xgrammar 0.2 does not enforce (measured: it accepts
# an instance that breaks each of them). allOf of several schemas is also ignored; one is fine.
UNSUPPORTED_KEYWORDS = frozenset(
    {"uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
     "dependentSchemas", "unevaluatedItems"}
)  # fmt: skip
# Keywords whose values are schemas (or maps / lists of schemas) to walk into.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")


def load_json_schema(spec: str | dict | bool, param: str) -> dict | bool:
    """The schema as an object (parsed from its text when given as text)."""
    if isinstance(spec, (dict, bool)):
        return spec
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{param} is not valid JSON: {e}", param) from e


def check_json_schema(schema: Any, param: str) -> None:
    """Raise ``InvalidRequestError`` for an invalid schema or an unsupported keyword."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{param} must be a JSON schema object, got {schema!r}", param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "the top level"
        message = f"{param} is not a valid JSON schema (at {where}): {e.message}"
        raise InvalidRequestError(message, param) from e
    _refuse_unsupported(schema, param, "#")


def _refuse_unsupported(schema: Any, param: str, where: str) -> None:
    if not isinstance(schema, dict):
        return
    for keyword in UNSUPPORTED_KEYWORDS & schema.keys():
        raise InvalidRequestError(
            f"{param} uses the JSON schema keyword {keyword!r} (at {where}), which structured "
            "outputs do not support: remove it, or check it after generation",
            param,
        )
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise InvalidRequestError(
            f"{param} uses the JSON schema keyword 'allOf' with several schemas (at {where}), "
            "which structured outputs do not support: merge them into one schema",
            param,
        )
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            _refuse_unsupported(sub, param, f"{where}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        for index, sub in enumerate(schema.get(key) or []):
            _refuse_unsupported(sub, param, f"{where}/{key}/{index}")
    for key in _SUBSCHEMA_ONE:
        _refuse_unsupported(schema.get(key), param, f"{where}/{key}")

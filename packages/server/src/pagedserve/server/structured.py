"""A request's output constraint, from whichever of OpenAI's and vLLM's fields it came in.

``response_format`` (OpenAI: ``text``, ``json_object``, ``json_schema``), vLLM's
``structured_outputs`` object, and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` all become one ``StructuredOutputsParams``. A request may
use one of them; two constraints at once is a 400 naming the second, as is any malformed one.
Whether the schema, regex or grammar compiles is the engine's answer (a 400 all the same, with
the engine's ``structured_outputs.<kind>`` renamed to the field the client sent:
``structured_output_aliases``).
"""

from __future__ import annotations

from pagedserve.engine import InvalidRequestError
from pagedserve.engine.structured_output import StructuredOutputsParams
from pagedserve.server.errors import bad_request, from_invalid_request
from pagedserve.server.structured_protocol import StructuredOutputFields

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _requested(body: StructuredOutputFields) -> list[tuple[str, dict]]:
    """(field the client used, StructuredOutputsParams keyword arguments) per constraint given."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema", "response_format"
            )
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if body.structured_outputs is not None:
        given = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", given))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, {kind: value}))
    return found


def structured_outputs_of(body: StructuredOutputFields) -> StructuredOutputsParams | None:
    """The request's one constraint, or None (``response_format: text`` included)."""
    found = _requested(body)
    if not found:
        return None
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad_request(
            f"{second} conflicts with {first}: give one output constraint per request", second
        )
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidRequestError as e:
        raise from_invalid_request(e, {e.param: field}) from e


def constraint_field(body: StructuredOutputFields) -> str | None:
    """The field the request's one output constraint came in (None: it has none)."""
    found = _requested(body)
    return found[0][0] if found else None


def structured_output_aliases(body: StructuredOutputFields) -> dict[str, str]:
    """The engine's ``structured_outputs.<kind>`` -> the field the client sent."""
    found = _requested(body)
    if len(found) != 1 or found[0][0] == "structured_outputs":
        return {}
    field = found[0][0]
    return {
        f"structured_outputs.{kind}": field
        for kind in ("json", "json_object", *GUIDED_FIELDS.values())
    }

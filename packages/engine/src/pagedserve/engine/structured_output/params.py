"""StructuredOutputsParams: the constraint a request's output must satisfy, with vLLM's names.

Exactly one of ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of a list of strings), ``grammar`` (EBNF/GBNF) or
``structural_tag`` (xgrammar's structural tag, as JSON text or a dict) is set. The fields are
checked for shape here, at the edge; whether the schema, regex or grammar compiles is the
grammar backend's answer (backend.py), a 400 naming the field all the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.errors import InvalidRequestError

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    # True by default, unlike vLLM: measured on SmolLM2, free whitespace lets a small model wander
    # in newlines and indents until max_tokens cuts the JSON short; compact JSON always closes
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        set_kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {set_kinds or 'none'}",
                "structured_outputs",
            )
        self._check_shapes()

    def _check_shapes(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict, bool)):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object or its JSON text)",
                "structured_outputs.json",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a non-empty string",
                    f"structured_outputs.{name}",
                )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                "structured_outputs.choice",
            )

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def param_name(self) -> str:
        """The field a compile failure is blamed on (``structured_outputs.<kind>``)."""
        return f"structured_outputs.{self.kind}"

    def spec(self) -> str:
        """The constraint as text: what the backend compiles and what its cache is keyed by."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return json.dumps(value)
        if isinstance(value, (dict, list, bool)) and self.kind != "json_object":
            return json.dumps(value, sort_keys=True)
        return "" if self.kind == "json_object" else value

    def cache_key(self) -> tuple[str, str, bool]:
        return (self.kind, self.spec(), self.disable_any_whitespace)

"""Request fields of structured outputs and tool calling, as OpenAI and vLLM spell them.

Kept apart from protocol.py so the request models there take them with one base class
(``StructuredOutputFields`` for both endpoints, ``ToolFields`` for chat). What they mean is
structured.py's and tools.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Model):
    name: StrictStr = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's ``structured_outputs`` object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool | None = None


class StructuredOutputFields(_Model):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionDefinition(_Model):
    name: StrictStr | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Model):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Model):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(_Model):
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Model):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

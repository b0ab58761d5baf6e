"""The grammar backend over xgrammar (chosen by measurement: docs/structured_outputs.md).

xgrammar precomputes, per grammar, which tokens each state of its pushdown automaton accepts
whatever the stack holds, so a step's mask is mostly a table lookup (about 10-40 us a row on
SmolLM2's 49k vocabulary, against 100-800 us for llguidance and a far slower compile for
outlines-core). The tokenizer's vocabulary is read once per engine (under a second).
"""

from __future__ import annotations

import json

import torch

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured_output.json_schema import check_json_schema, load_json_schema
from pagedserve.engine.structured_output.params import StructuredOutputsParams


class XgrammarMatcher:
    """One sequence's position in its grammar (an ``xgrammar.GrammarMatcher``)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XgrammarGrammar:
    __slots__ = ("_compiled", "_xgr")

    def __init__(self, compiled, xgr) -> None:
        self._compiled, self._xgr = compiled, xgr

    def matcher(self) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(self._compiled))


class XgrammarBackend:
    """Compiles constraints for one tokenizer; ``vocab_size`` is the model's (its logits'
    width), which may exceed the tokenizer's (padded embeddings: those tokens are never
    allowed)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # compiles run in the manager's pool, one per thread; xgrammar's own cache is off
        # (the manager caches compiled grammars by constraint)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        kind, param = params.kind, params.param_name
        try:
            compiled = self._compile(kind, params)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"{param} does not compile: {_first_line(e)}", param) from e
        return XgrammarGrammar(compiled, self.xgr)

    def _compile(self, kind: str, params: StructuredOutputsParams):
        compiler, whitespace = self.compiler, not params.disable_any_whitespace
        if kind in ("json", "json_object"):
            schema = {"type": "object"}
            if kind == "json":
                schema = load_json_schema(params.json, params.param_name)
            return compiler.compile_grammar(self._json_ebnf(schema, whitespace, params.param_name))
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in params.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        tag = params.structural_tag
        tag = json.loads(tag) if isinstance(tag, str) else tag
        tag = self._schemas_as_grammars(tag, whitespace, params.param_name)
        return compiler.compile_structural_tag(json.dumps(tag))

    def _json_ebnf(self, schema, whitespace: bool, param: str) -> str:
        """A JSON schema as EBNF, refused where xgrammar would not enforce it."""
        check_json_schema(schema, param)
        grammar = self.xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=whitespace)
        return _forbid_control_characters(str(grammar))

    def _schemas_as_grammars(self, node, whitespace: bool, param: str):
        """A structural tag with each ``json_schema`` content replaced by its EBNF, so that a
        schema inside a tag (a strict tool's arguments) gets the same checks and the same
        control-character fix as a schema on its own (a content in one of xgrammar's XML
        styles is left to xgrammar)."""
        if isinstance(node, list):
            return [self._schemas_as_grammars(item, whitespace, param) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and node.get("style", "json") == "json":
            schema = load_json_schema(node["json_schema"], param)
            return {"type": "grammar", "grammar": self._json_ebnf(schema, whitespace, param)}
        return {k: self._schemas_as_grammars(v, whitespace, param) for k, v in node.items()}


# xgrammar 0.2.9 writes a string with maxLength/minLength as repetitions of this class, which
# lets raw control characters (a NUL byte, a tab) into a JSON string, where JSON forbids them
# (its unbounded strings exclude them); found by sampling a random-weight model.
_LENGTH_BOUNDED_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\\r\n]"


def _forbid_control_characters(ebnf: str) -> str:
    return ebnf.replace(_LENGTH_BOUNDED_CHARACTER, _JSON_STRING_CHARACTER)


def _first_line(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text

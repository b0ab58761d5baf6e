"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar.

- params.py: ``StructuredOutputsParams``, what a request asks for (vLLM's names);
- backend.py: the small interface a grammar engine is used through (compile a constraint to a
  grammar; per sequence, a matcher that fills its row of the step's bitmask, accepts tokens,
  rolls back and says when it is terminated);
- xgrammar_backend.py: that interface over xgrammar, the engine chosen by measurement
  (docs/structured_outputs.md); json_schema.py: the schema checks xgrammar does not make;
- manager.py: compilation off the engine step (a thread pool, a cache of compiled grammars) and
  the step's one bitmask over the constrained rows.

Only params.py is imported here: SamplingParams needs it, and the grammar engine is loaded when
the first constrained request arrives.
"""

from pagedserve.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]

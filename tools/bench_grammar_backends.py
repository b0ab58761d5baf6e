"""Grammar backends compared on the default model's vocabulary: compile time and mask cost.

For each backend installed (xgrammar, llguidance, outlines-core; a missing one is skipped) and
each constraint below, on SmolLM2's 49 152-token vocabulary:

- ``vocab_s``: the one-time cost of reading the tokenizer's vocabulary (per model, not per
  request);
- ``compile_ms``: compiling the constraint with every cache off (what a request with a new
  schema waits for before it can be scheduled);
- ``mask_us``: the mean cost of one decoding step for one row: fill the row's next-token bitmask
  and accept the token, walking the tokens of a valid output (what the engine pays per
  constrained row per step), and the worst step.

Run: ``python tools/bench_grammar_backends.py [--model DIR] [--repeats 3]``. One thread
(OMP_NUM_THREADS=1); the figures in docs/structured_outputs.md came from this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

SCHEMA_FLAT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SCHEMA_NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "cast": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"actor": {"type": "string"}, "lead": {"type": "boolean"}},
                "required": ["actor", "lead"],
            },
            "maxItems": 4,
        },
        "budget": {"type": "number", "minimum": 0},
        "sequel": {"type": ["string", "null"]},
    },
    "required": ["title", "rating", "genre", "cast"],
}
# (name, kind, constraint, a valid output whose tokens the mask walk follows)
CASES = [
    ("json flat", "json", SCHEMA_FLAT, '{"name": "Ada Lovelace", "age": 36}'),
    (
        "json nested",
        "json",
        SCHEMA_NESTED,
        '{"title": "Night Train", "rating": 4, "genre": "drama", "cast": [{"actor": "Ann '
        'Lee", "lead": true}, {"actor": "Bo Ray", "lead": false}], "budget": 1250000.5}',
    ),
    ("json_object", "json_object", None, '{"city": "Paris", "population": 2100000}'),
    ("regex", "regex", r"\d{3}-\d{3}-\d{4}", "555-123-4567"),
    ("choice", "choice", ["positive", "negative", "neutral"], "neutral"),
]


def byte_vocabulary(tokenizer) -> list[bytes]:
    """Each token id's bytes (byte-level BPE: the GPT-2 byte alphabet undone)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = [b for b in range(256) if b not in printable]
    decoder = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
    vocab = [b""] * len(tokenizer)
    for token, index in tokenizer.get_vocab().items():
        try:
            vocab[index] = bytes(decoder[c] for c in token)
        except KeyError:  # a special token written as itself
            vocab[index] = token.encode()
    return vocab


def choice_regex(choices: list[str]) -> str:
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos]
        )

    def compile(self, kind, constraint):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(constraint))
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(constraint)
        return compiler.compile_regex(choice_regex(constraint))

    def walk(self, compiled, tokens, vocab_size):
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, vocab_size)
        times = []
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token), token
            times.append(time.perf_counter() - start)
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, eos: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def compile(self, kind, constraint):
        m = self.llg.LLMatcher
        if kind == "json":
            grammar = m.grammar_from_json_schema(json.dumps(constraint))
        elif kind == "json_object":
            grammar = m.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = m.grammar_from_regex(constraint)
        else:
            grammar = m.grammar_from_regex(choice_regex(constraint))
        matcher = m(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(self, grammar, tokens, vocab_size):
        import llguidance.torch as lt

        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        bitmask = lt.allocate_token_bitmask(1, vocab_size)
        times = []
        for token in tokens:
            start = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), matcher.get_error()
            times.append(time.perf_counter() - start)
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for index, piece in enumerate(byte_vocabulary(tokenizer)):
            if index != eos and piece:
                by_bytes.setdefault(piece, []).append(index)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, kind, constraint):
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "json":
            regex = build_regex_from_schema(json.dumps(constraint))
        elif kind == "json_object":
            regex = build_regex_from_schema('{"type": "object"}')
        elif kind == "regex":
            regex = constraint
        else:
            regex = choice_regex(constraint)
        return self.oc.Index(regex, self.vocabulary)

    def walk(self, index, tokens, vocab_size):
        guide = self.oc.Guide(index)
        bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        times = []
        for token in tokens:
            start = time.perf_counter()
            guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())
            guide.advance(token)
            times.append(time.perf_counter() - start)
        return times


BACKENDS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines_core": OutlinesCore}


def main() -> None:
    from pagedserve.models import load_tokenizer
    from pagedserve.models.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    eos = int(tokenizer.eos_token_id)
    vocab_size = len(tokenizer)
    print(f"model {args.model}: vocabulary {vocab_size} tokens, {torch.get_num_threads()} thread")
    print(
        f"{'backend':14} {'constraint':12} {'vocab_s':>8} {'compile_ms':>11} {'mask_us':>9} "
        f"{'worst_us':>9} {'tokens':>6}"
    )
    for module, cls in BACKENDS.items():
        if importlib.util.find_spec(module) is None:
            print(f"{cls.name:14} not installed: skipped")
            continue
        start = time.perf_counter()
        backend = cls(tokenizer, eos)
        vocab_s = time.perf_counter() - start
        for name, kind, constraint, sample in CASES:
            compile_times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                compiled = backend.compile(kind, constraint)
                compile_times.append(time.perf_counter() - start)
            tokens = tokenizer.encode(sample, add_special_tokens=False)
            steps = backend.walk(compiled, tokens, vocab_size)
            print(
                f"{cls.name:14} {name:12} {vocab_s:8.2f} "
                f"{statistics.median(compile_times) * 1e3:11.1f} "
                f"{statistics.mean(steps) * 1e6:9.0f} {max(steps) * 1e6:9.0f} {len(tokens):6d}"
            )


if __name__ == "__main__":
    main()

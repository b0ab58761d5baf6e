"""Structured outputs in the engine: every sample obeys its constraint, constrained and
unconstrained rows share a batch, and a bad constraint fails only its request (greedy under a
constraint that the free greedy output already satisfies: tests/e2e/test_structured_outputs_smollm2.py).

A random-weight model is the hard case for a grammar: left alone it never writes JSON, so any
sample that validates does so because of the mask.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve.engine import LLM, InvalidRequestError, SamplingParams
from pagedserve.engine.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "level": {"type": "integer", "minimum": -5, "maximum": 300},
        "kind": {"enum": ["cat", "dog", "emu"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "extra": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    },
    "required": ["name", "level", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), max_num_seqs=32)


def sampled(llm, constraint: StructuredOutputsParams, n: int, max_tokens: int = 160, seed=0):
    params = SamplingParams(
        n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint
    )
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
    return out.outputs


def test_sampled_json_validates_against_its_schema(llm):
    outputs = sampled(llm, StructuredOutputsParams(json=SCHEMA), n=24)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), SCHEMA)
    assert len({o.text for o in outputs}) > 10  # sampled, not one forced string


@pytest.mark.parametrize(
    "constraint, check",
    [
        (StructuredOutputsParams(regex=r"[a-c]{2,5}-\d{3}"), re.compile(r"[a-c]{2,5}-\d{3}")),
        (StructuredOutputsParams(choice=["alpha", "beta", "al"]), re.compile(r"alpha|beta|al")),
        (
            StructuredOutputsParams(grammar='root ::= "(" [xy]{0,6} ")"'),
            re.compile(r"\([xy]{0,6}\)"),
        ),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_hold_on_every_sample(llm, constraint, check):
    for output in sampled(llm, constraint, n=16, max_tokens=40):
        # EOS is allowed only where the grammar may end: every sample ends on a stop, whole
        assert output.finish_reason == "stop", output.text
        assert check.fullmatch(output.text), output.text


def test_any_json_object(llm):
    for output in sampled(llm, StructuredOutputsParams(json_object=True), n=2, max_tokens=60):
        if output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert output.text.startswith("{")


def test_unconstrained_rows_in_a_constrained_batch_are_untouched(llm):
    plain = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [9, 10, 11]}, {"prompt_token_ids": [5, 6, 7, 8]}]
    alone = llm.generate(prompts[:1], plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(
        temperature=1.0, seed=3, max_tokens=30, structured_outputs={"regex": r"\d+"}
    )
    mixed = llm.generate(prompts, [plain, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(r"\d+", mixed[1].outputs[0].text)


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"json": {"type": "strnig"}}, "not a valid JSON schema"),
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a(b"}, "parenthesis"),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_fails_only_its_request(llm, constraint, message):
    engine = llm.engine
    good = SamplingParams(temperature=0, max_tokens=5, structured_outputs={"regex": "[ab]+"})
    engine.add_request("good", [5, 6, 7], good)
    engine.add_request("bad", [5, 6, 7], SamplingParams(structured_outputs=constraint))
    errors, finished = [], {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        errors += engine.take_request_errors()
    assert [rid for rid, _ in errors] == ["bad"]
    error = errors[0][1]
    assert isinstance(error, InvalidRequestError) and message in str(error)
    assert error.param == f"structured_outputs.{next(iter(constraint))}"
    assert set(finished) == {"good"} and re.fullmatch("[ab]+", finished["good"].outputs[0].text)


def test_offline_generate_raises_the_compile_error(llm):
    with pytest.raises(InvalidRequestError, match="parenthesis"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "("}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_structured_outputs_params_shape():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequestError, match="no field"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(InvalidRequestError, match="beam search"):
        SamplingParams(n=2, temperature=0, use_beam_search=True, structured_outputs={"regex": "a"})


def test_matcher_rollback_restores_the_mask(llm):
    """Speculative decoding's hook: rolling back n accepted tokens gives back the mask the
    matcher had n tokens earlier, and a terminated matcher is live again after a rollback."""
    import torch

    from pagedserve.engine.structured_output.manager import grammar_bitmask

    backend = llm.engine.structured_output.backend()
    grammar = backend.compile(StructuredOutputsParams(regex="ab+c"))
    matcher = grammar.matcher()
    vocab = llm.engine.model_config.vocab_size
    tokens = llm.tokenizer.convert_tokens_to_ids(["a", "b", "b", "c"])
    masks = []
    for token in tokens:
        masks.append(grammar_bitmask([matcher], vocab)[0].clone())
        assert matcher.accept_token(token)
    assert not matcher.accept_token(tokens[0])  # "ab" then "a": refused, nothing changes
    eos = llm.tokenizer.eos_token_id
    assert matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(3)  # EOS, "c", the second "b"
    assert not matcher.is_terminated()
    assert torch.equal(grammar_bitmask([matcher], vocab)[0], masks[2])


def test_a_structural_tag_holds_each_tag_to_its_json_schema(llm):
    """xgrammar's triggered tags with a schema inside (what a strict tool under "auto" sends):
    ``at_least_one`` makes the random model open a tag, whose content must then validate."""
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f>"],
            "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "json_schema",
                      "json_schema": SCHEMA}, "end": "</f>"}],
            "at_least_one": True,
            "stop_after_first": True,
        },
    }  # fmt: skip
    outputs = sampled(llm, StructuredOutputsParams(structural_tag=tag), n=8)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        body = re.fullmatch(r"<f>(.*)</f>", output.text, re.DOTALL)
        assert body, output.text
        jsonschema.validate(json.loads(body.group(1)), SCHEMA)


def test_a_schema_inside_a_structural_tag_gets_the_schema_checks(llm):
    unenforced = {"type": "array", "uniqueItems": True}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>",
           "content": {"type": "json_schema", "json_schema": unenforced}, "end": "</f>"}}  # fmt: skip
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        sampled(llm, StructuredOutputsParams(structural_tag=tag), n=1)

"""An invalid speculative configuration fails at start-up, naming the field at fault, from
Python (``LLM(..., speculative_config=...)``) and from the command line alike."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.engine import LLM, EngineArgs
from pagedserve.engine.spec_decode import SpeculativeConfig, SpeculativeConfigError


def test_vllm_dict_parses_with_vllm_defaults():
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min) == (3, 4)
    assert SpeculativeConfig.from_dict({"method": "ngram"}).prompt_lookup_max == 5
    text = json.dumps({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert SpeculativeConfig.from_dict(text).prompt_lookup_min == 2


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "medusa"}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"method": "ngram", "lookahead": 3}, "lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ],
)
def test_invalid_config_names_its_field(value, field):
    with pytest.raises(SpeculativeConfigError) as info:
        EngineArgs(model="unused", speculative_config=value)  # before any model is loaded
    assert info.value.param == f"speculative_config.{field}"
    assert f"speculative_config.{field}" in str(info.value)


def test_the_cli_flag_takes_vllm_json():
    from pagedserve.server.cli import add_config_args, config_kwargs

    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineArgs)
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = parser.parse_args(["--model", "m", "--speculative-config", spec])
    engine_args = EngineArgs(**config_kwargs(args, EngineArgs))
    assert engine_args.create_speculative_config().num_speculative_tokens == 3
    assert parser.parse_args(["--model", "m"]).speculative_config is None


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint):
    target = tiny_checkpoint("llama")
    draft = tiny_checkpoint("llama", vocab_size=640)
    with pytest.raises(SpeculativeConfigError, match="vocabulary") as info:
        LLM(model=target, speculative_config={"method": "draft_model", "model": draft})
    assert info.value.param == "speculative_config.model"

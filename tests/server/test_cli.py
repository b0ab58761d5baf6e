"""The command line is built from the config dataclasses: every field is a flag of its own type,
with its help text, and what the flags parse to reaches the engine's and the server's configs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from pagedserve.engine import EngineArgs
from pagedserve.server.cli import (
    add_config_args,
    build_parser,
    config_kwargs,
    with_batch_background,
)
from pagedserve.server.config import ServerConfig


def config_flags(cls: type, **kwargs) -> dict[str, argparse.Action]:
    """The flags ``add_config_args`` makes of a config dataclass, by field."""
    return add_config_args(argparse.ArgumentParser(), cls, **kwargs)


def help_of(command: str, capsys) -> str:
    """``pagedserve COMMAND --help`` as printed."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_field_is_a_flag_with_help(command, capsys):
    text = help_of(command, capsys)
    for name, action in config_flags(EngineArgs, skip=("model",)).items():
        f = EngineArgs.__dataclass_fields__[name]
        assert action.dest == name and action.default == f.default
        assert action.help and not action.help.startswith(" (default")
        assert "--" + name.replace("_", "-") in text, name


def test_every_server_field_is_a_serve_flag_with_help(capsys):
    text = help_of("serve", capsys)
    for name, action in config_flags(ServerConfig).items():
        assert action.dest == name and action.help and not action.help.startswith(" (default")
        assert "--" + name.replace("_", "-") in text, name


def test_flags_parse_to_the_types_of_the_fields(tiny_path):
    args = build_parser().parse_args(
        ["serve", tiny_path, "--port", "9001", "--max-body-bytes", "1MiB", "--shutdown-timeout"]
        + ["2.5", "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching", "--max-model-len"]
        + ["128", "--max-num-waiting-tokens", "4096", "--served-model-name", "tiny"]
    )
    config = ServerConfig(**config_kwargs(args, ServerConfig))
    assert (config.port, config.max_body_bytes, config.shutdown_timeout) == (9001, 2**20, 2.5)
    assert config.served_model_name == "tiny"
    engine_args = EngineArgs(model=tiny_path, **config_kwargs(args, EngineArgs, skip=("model",)))
    assert engine_args.kv_cache_memory == 2 * 2**30
    assert engine_args.enable_prefix_caching is False
    assert engine_args.max_model_len == 128 and engine_args.num_gpu_blocks_override is None
    _, cache_config, scheduler_config = engine_args.create_configs()
    assert scheduler_config.max_num_waiting_tokens == 4096
    assert cache_config.enable_prefix_caching is False


def test_generate_has_no_served_model_name():
    """The offline engine names no model in its outputs: the flag belongs to the server alone."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--served-model-name", "x", "hi"])


def test_a_field_of_a_type_without_a_flag_is_refused():
    @dataclass
    class Odd:
        names: list[str] = field(default_factory=list, metadata={"help": "several names"})

    with pytest.raises(TypeError, match="names: no command-line flag"):
        add_config_args(argparse.ArgumentParser(), Odd)


def test_list_flags_take_json_lists_or_commas(tiny_path):
    args = build_parser().parse_args(
        ["serve", tiny_path, "--allowed-origins", '["https://a.example", "https://b.example"]']
        + ["--allowed-methods", "GET, POST"]
    )
    config = ServerConfig(**config_kwargs(args, ServerConfig))
    assert config.allowed_origins == ("https://a.example", "https://b.example")
    assert config.allowed_methods == ("GET", "POST") and config.allowed_headers == ("*",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "[1, 2]"])


@pytest.mark.parametrize(
    ("flags", "background"),
    [
        (["--scheduling-policy", "priority"], ServerConfig.batch_priority),
        (["--scheduling-policy", "priority", "--batch-priority", "50"], 50),
        (["--scheduling-policy", "priority", "--background-priority", "10"], 10),
        ([], None),  # fcfs: no background work (the priority is only a label there)
    ],
)
def test_serve_makes_the_batch_api_lines_background_work_under_the_priority_policy(
    tiny_path, flags, background
):
    args = build_parser().parse_args(["serve", tiny_path, *flags])
    config = ServerConfig(**config_kwargs(args, ServerConfig))
    engine_args = EngineArgs(model=tiny_path, **config_kwargs(args, EngineArgs, skip=("model",)))
    assert with_batch_background(engine_args, config).background_priority == background

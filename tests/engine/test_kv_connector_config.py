"""The KV connector's options, checked at start-up: vLLM's KVTransferConfig with the fields
pagedserve does not implement refused by name, and the engine options a connector rules out."""

from __future__ import annotations

import pytest

from pagedserve.engine import EngineArgs
from pagedserve.engine.kv_connector import KVTransferConfig, KVTransferConfigError


def test_vllms_shape_parses_from_json_and_defaults_hold():
    config = KVTransferConfig.from_dict(
        '{"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_ip": "0.0.0.0",'
        ' "kv_port": 15000, "kv_buffer_size": 2e9, "kv_rank": null, "kv_parallel_size": 1,'
        ' "kv_buffer_device": "cpu", "kv_connector_extra_config": {"transfer_timeout": 3}}'
    )
    assert config.is_producer and not config.is_consumer
    assert (config.kv_port, config.extra("transfer_timeout"), config.extra("transfer_ttl")) == (
        15000,
        3,
        60.0,
    )


@pytest.mark.parametrize(
    "config, field",
    [
        ({"kv_connector": "NixlConnector"}, "kv_connector"),
        ({"kv_role": "kv_leader"}, "kv_role"),
        ({"kv_rank": 0}, "kv_rank"),
        ({"kv_parallel_size": 2}, "kv_parallel_size"),
        ({"kv_buffer_device": "cuda"}, "kv_buffer_device"),
        ({"kv_connector_module_path": "my.module"}, "kv_connector_module_path"),
        ({"enable_permute_local_kv": True}, "enable_permute_local_kv"),
        ({"kv_load_failure_policy": "fail"}, "kv_load_failure_policy"),
        ({"kv_port": 70000}, "kv_port"),
        ({"kv_buffer_size": 0}, "kv_buffer_size"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"kv_connector_extra_config": {"nixl": 1}}, "kv_connector_extra_config.nixl"),
        ({"kv_connector_extra_config": {"transfer_timeout": -1}}, "transfer_timeout"),
        (
            {"kv_role": "kv_producer", "kv_connector_extra_config": {"prefill_url": "http://p"}},
            "prefill_url",
        ),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(config, field):
    with pytest.raises(KVTransferConfigError, match=field) as error:
        KVTransferConfig.from_dict(config)
    assert error.value.param.startswith("kv_transfer_config.")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kv_offload_disk": 1 << 20}, "kv_offload_dir"),
        ({"kv_offload_memory": 1 << 20, "tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"kv_offload_memory": 1 << 20, "enable_prefix_caching": False}, "enable_prefix_caching"),
        (
            {"kv_offload_memory": 1 << 20, "speculative_config": {"model": "/draft"}},
            "draft model",
        ),
        ({"kv_offload_memory": 1 << 20, "kv_transfer_config": {}}, "one or the other"),
        ({"kv_transfer_config": {"kv_rank": 3}}, "kv_rank"),
    ],
)
def test_engine_options_a_connector_rules_out_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="unused", **options)


def test_a_pooling_model_refuses_offloading(tiny_pooling_checkpoint):
    args = EngineArgs(model=tiny_pooling_checkpoint("bert"), kv_offload_memory=1 << 20)
    with pytest.raises(ValueError, match="kv_offload_memory"):
        args.create_configs()

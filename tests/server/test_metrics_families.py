"""/metrics exports vLLM's families (under ``pagedserve:``, or ``vllm:`` with
``--metrics-prefix vllm``): each moves by what one request did, counted independently here (its
prompt and output lengths, the steps it took, the parameters it asked for)."""

from __future__ import annotations

import re

from starlette.testclient import TestClient

from pagedserve.engine import EngineStats
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.metrics import EngineMetrics
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

LABEL = f'model_name="{MODEL}"'
VLLM_FAMILIES = [  # vLLM's names (vllm:...) that pagedserve exports as pagedserve:...
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "iteration_tokens_total_bucket",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "time_per_output_token_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
    "request_queue_time_seconds_bucket",
    "request_prefill_time_seconds_bucket",
    "request_decode_time_seconds_bucket",
    "request_inference_time_seconds_bucket",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket",
]


def series(text: str, name: str, extra: str = "") -> float:
    pattern = rf"^pagedserve:{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
    total = 0.0
    for labels, value in re.findall(pattern, text, re.MULTILINE):
        if LABEL in labels and extra in labels:
            total += float(value)
    return total


def test_every_vllm_family_is_exported(client):
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    text = client.get("/metrics").text
    for name in VLLM_FAMILIES:
        assert re.search(rf"^pagedserve:{name}\{{", text, re.MULTILINE), name
    assert f'pagedserve:request_success_total{{finished_reason="length",{LABEL}}}' in text


def test_one_request_moves_each_family_by_what_it_did(client):
    prompt = [11, 23, 37, 41, 53, 67, 71, 83, 97, 101, 113, 127, 131, 149, 151, 163, 173]
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    before = client.get("/metrics").text
    assert client.post("/v1/completions", json=body).status_code == 200
    after = client.get("/metrics").text

    def moved(name: str, extra: str = "") -> float:
        return series(after, name, extra) - series(before, name, extra)

    assert moved("request_prompt_tokens_sum") == len(prompt)
    assert moved("request_generation_tokens_sum") == 5
    # five steps, counted as vLLM counts them: the first the prompt and its first token, the
    # other four one generated token each
    assert moved("iteration_tokens_total_sum") == len(prompt) + 5
    assert moved("iteration_tokens_total_count") == 5
    assert moved("inter_token_latency_seconds_count") == 4
    for name in (
        "time_to_first_token_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "request_inference_time_seconds_count",
        "e2e_request_latency_seconds_count",
    ):
        assert moved(name) == 1, name
    assert moved("request_success_total", 'finished_reason="length"') == 1
    assert moved("prefix_cache_queries_total") >= len(prompt) - len(prompt) % 16
    decode = moved("request_decode_time_seconds_sum")
    assert abs(moved("inter_token_latency_seconds_sum") - decode) < 1e-6  # the same intervals


def test_metrics_prefix_vllm_gives_vllms_own_names(engine):
    """Dashboards and autoscalers written for vLLM read vllm:*: every family, none left under
    pagedserve:."""
    app = build_app(engine, ServerConfig(metrics_prefix="vllm"), MODEL)
    http = TestClient(app)
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    text = http.get("/metrics").text
    for name in VLLM_FAMILIES + NEW_FAMILIES:
        assert re.search(rf"^vllm:{name}\{{", text, re.MULTILINE), name
    assert not re.search(r"^pagedserve:", text, re.MULTILINE)


NEW_FAMILIES = [
    "num_requests_waiting_by_reason",
    "cache_config_info",
    "request_params_n_bucket",
    "request_params_max_tokens_bucket",
]


def test_request_params_are_observed_per_admitted_request(client):
    before = client.get("/metrics").text
    two_prompts = {"prompt": ["Hi", "Ho"], "n": 3, "max_tokens": 7, "temperature": 1.0}
    assert client.post("/v1/completions", json=two_prompts).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    refused = {"prompt": "Hi", "max_tokens": 10**6}
    assert client.post("/v1/completions", json=refused).status_code == 400  # never admitted
    after = client.get("/metrics").text

    def moved(name: str) -> float:
        return series(after, name) - series(before, name)

    assert moved("request_params_n_count") == 3 and moved("request_params_n_sum") == 3 + 3 + 1
    assert moved("request_params_max_tokens_count") == 3
    assert moved("request_params_max_tokens_sum") == 7 + 7 + 4


def test_waiting_by_reason_splits_num_requests_waiting(client):
    text = client.get("/metrics").text
    for reason in ("capacity", "deferred"):
        assert f'reason="{reason}"' in text
    capacity = series(text, "num_requests_waiting_by_reason", 'reason="capacity"')
    deferred = series(text, "num_requests_waiting_by_reason", 'reason="deferred"')
    assert capacity + deferred == series(text, "num_requests_waiting")


class StatsOnly:
    """An engine as the exporter sees one (the cluster feeds it a replica's stats the same
    way): stats with some of the waiting requests deferred."""

    def get_stats(self, drain: bool = True) -> EngineStats:
        return EngineStats(num_waiting=5, num_waiting_deferred=2)


def test_deferred_requests_are_not_counted_as_waiting_for_capacity():
    text = EngineMetrics(StatsOnly(), MODEL).render().decode()
    assert series(text, "num_requests_waiting_by_reason", 'reason="capacity"') == 3
    assert series(text, "num_requests_waiting_by_reason", 'reason="deferred"') == 2
    assert "cache_config_info" not in text  # an engine without a cache_config has no info


def test_cache_config_info_has_the_kv_caches_configuration_in_its_labels(client, engine):
    text = client.get("/metrics").text
    (labels,) = re.findall(r"^pagedserve:cache_config_info\{([^}]*)\} 1\.0$", text, re.MULTILINE)
    info = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    assert info["block_size"] == str(engine.cache_config.block_size)
    assert info["num_gpu_blocks_override"] == "128"  # make_engine's
    assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "auto"

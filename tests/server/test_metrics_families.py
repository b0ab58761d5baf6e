"""/metrics exports vLLM's families (under ``pagedserve:``): each moves by what one request did,
counted independently here (its prompt and output lengths, the steps it took)."""

from __future__ import annotations

import re

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
    # one prefill of the whole prompt, then four one-token decodes (the fifth token comes
    # from the fourth decode's logits)
    assert moved("iteration_tokens_total_sum") == len(prompt) + 4
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

"""Disaggregated prefill and decode in one process: a prefill engine (kv_producer) and a
decode engine (kv_consumer), their blocks over a real TCP socket (tiny Llama, fp32, greedy).

- The decode engine's greedy output equals a single engine's, its prompt's full blocks
  fetched from the prefill engine (counted), and neither engine keeps a block afterwards.
- A transfer that fails (nobody listening, the prefill engine gone mid-stream, a stall past
  the timeout, an expired or already fetched handle) is recomputed: the output is still the
  single engine's, and no block is leaked.
- A prefill engine of another model is refused by the blocks' headers, counted.
- kv_transfer_params are checked: refused without a transfer connector, with an unknown field,
  or asking for a part the engine does not play.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from pagedserve.engine import LLM, InvalidRequestError, SamplingParams

BLOCK = 8
NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, length: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def _engine(model: str, role: str | None = None, **extra) -> LLM:
    config = None
    if role is not None:
        config = {"kv_role": role, "kv_port": 0, "kv_connector_extra_config": extra}
    return LLM(
        model=model,
        block_size=BLOCK,
        num_gpu_blocks_override=NUM_BLOCKS,
        kv_transfer_config=config,
    )


def _params(max_tokens: int, transfer: dict) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": transfer},
    )


def prefill(llm: LLM, prompt: list[int]) -> dict:
    """The prefill engine's part: the prompt with max_tokens 1; its output's handle."""
    (out,) = llm.generate([{"prompt_token_ids": prompt}], _params(1, {"do_remote_decode": True}))
    return out.kv_transfer_params


def decode(llm: LLM, prompt: list[int], handle: dict):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], _params(8, handle), use_tqdm=False)
    return out


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def engines(model):
    return _engine(model), _engine(model, "kv_producer"), _engine(model, "kv_consumer")


def _single(engines, prompt):
    (out,) = engines[0].generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids


def _no_block_held(*llms) -> bool:
    return all(llm.engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS for llm in llms)


def test_decode_with_fetched_blocks_equals_a_single_engine(engines):
    _, producer, consumer = engines
    before = consumer.engine.get_stats().kv_connector.hit_tokens["remote"]
    for seed, length in ((1, 41), (2, 64), (3, 8)):
        prompt = _prompt(seed, length)
        handle = prefill(producer, prompt)
        assert handle["do_remote_prefill"] and handle["remote_num_blocks"] == (length - 1) // 8
        out = decode(consumer, prompt, handle)
        assert out.outputs[0].token_ids == _single(engines, prompt)
        assert out.num_cached_tokens == (length - 1) // 8 * 8
        assert out.kv_transfer_params is None
    stats = consumer.engine.get_stats().kv_connector
    assert stats.hit_tokens["remote"] - before == 40 + 56 and stats.failed_loads == 0
    assert producer.engine.get_stats().kv_connector.tier_bytes["remote"] == 0  # all fetched
    assert _no_block_held(producer, consumer)


def _recomputed(engines, prompt, handle) -> None:
    consumer = engines[2]
    failed = consumer.engine.get_stats().kv_connector.failed_loads
    out = decode(consumer, prompt, handle)
    assert out.outputs[0].token_ids == _single(engines, prompt)
    assert consumer.engine.get_stats().kv_connector.failed_loads == failed + 1
    assert _no_block_held(consumer)
    return out


def test_nobody_listening_is_recomputed(engines):
    prompt = _prompt(4)
    handle = prefill(engines[1], prompt)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # free, and nobody listens once it is closed
    out = _recomputed(engines, prompt, {**handle, "remote_port": port})
    assert out.num_cached_tokens == 0


def test_an_expired_or_fetched_handle_is_recomputed(model, engines):
    prompt = _prompt(5)
    handle = prefill(engines[1], prompt)
    decode(engines[2], _prompt(5), handle)  # fetched once: the transfer is gone after
    _recomputed(engines, [7] + _prompt(5), handle)  # another prompt: no prefix-cache hit
    producer = _engine(model, "kv_producer", transfer_ttl=0.2)
    handle = prefill(producer, _prompt(9))
    time.sleep(0.5)  # nobody fetched it in time: dropped
    _recomputed(engines, _prompt(9), handle)
    assert _no_block_held(producer)


def _relay(target: tuple[str, int], cut_after: int | None):
    """A server between the decode and prefill engines that forwards ``cut_after`` bytes of
    the answer and then closes (the prefill engine dying mid-transfer), or (None) answers
    nothing at all (a stalled prefill engine)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        client, _ = server.accept()
        with client, socket.create_connection(target) as upstream:
            upstream.sendall(client.recv(4096))
            if cut_after is None:
                time.sleep(5)
                return
            sent = 0
            while sent < cut_after:
                data = upstream.recv(min(65536, cut_after - sent))
                if not data:
                    break
                client.sendall(data)
                sent += len(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_prefill_engine_dying_mid_transfer_leaves_the_rest_recomputed(engines):
    prompt = _prompt(6)
    handle = prefill(engines[1], prompt)
    target = (handle["remote_host"], handle["remote_port"])
    block_record = 102 + 2 * 2 * BLOCK * 2 * 16 * 4  # header + keys and values of 2 layers
    cut = 20 + 2 * (8 + block_record) + 100  # the reply line, two blocks, part of a third
    with _relay(target, cut) as relay:
        out = _recomputed(engines, prompt, {**handle, "remote_port": relay.getsockname()[1]})
    assert out.num_cached_tokens == 16  # the two blocks that arrived whole


def test_a_stalled_prefill_engine_times_out_and_is_recomputed(model, engines):
    consumer = _engine(model, "kv_consumer", transfer_timeout=0.5)
    prompt = _prompt(7)
    handle = prefill(engines[1], prompt)
    with _relay((handle["remote_host"], handle["remote_port"]), None) as relay:
        start = time.monotonic()
        out = decode(consumer, prompt, {**handle, "remote_port": relay.getsockname()[1]})
        assert time.monotonic() - start < 4
    assert out.outputs[0].token_ids == _single(engines, prompt)
    assert consumer.engine.get_stats().kv_connector.failed_loads == 1
    assert _no_block_held(consumer)


def test_another_models_blocks_are_refused(engines, tiny_checkpoint):
    other = _engine(tiny_checkpoint("llama", seed=1), "kv_producer")
    prompt = _prompt(8)
    consumer = engines[2]
    rejected = consumer.engine.get_stats().kv_connector.rejected_blocks["mismatch"]
    _recomputed(engines, prompt, prefill(other, prompt))
    assert consumer.engine.get_stats().kv_connector.rejected_blocks["mismatch"] == rejected + 1


@pytest.mark.parametrize(
    "which, transfer, message",
    [
        (0, {"do_remote_decode": True}, "--kv-transfer-config"),
        (1, {"do_remote_decode": True, "remote_block_ids": [1]}, "remote_block_ids"),
        (2, {"do_remote_decode": True}, "kv_role is kv_consumer"),
        (2, {"do_remote_prefill": True, "remote_host": "h"}, "lacks"),
        (2, {"do_remote_prefill": True, "remote_port": "80"}, "must be a int"),
    ],
)
def test_bad_transfer_params_are_refused_naming_them(engines, which, transfer, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        engines[which].engine.add_request("bad", [1, 2, 3], _params(1, transfer))
    assert error.value.param == "kv_transfer_params"

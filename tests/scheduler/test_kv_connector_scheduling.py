"""The scheduler with a KV connector (vLLM V1's protocol), through a scripted connector.

- tokens a connector supplies synchronously are computed in the admission step itself: the
  chunk starts after them, and they cost nothing of the token budget;
- an asynchronous load holds the request in the queue (WAITING_FOR_REMOTE_KVS) with its
  blocks, not registered in the prefix cache; requests behind it pass it;
- ``finish_kv_loads`` puts what arrived in the prefix cache and frees the request's blocks:
  its next admission hits them there, and what failed is recomputed;
- an abort while the load runs frees its blocks and tells the connector;
- the connector's returned kv_transfer_params reach the finished request.
"""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

BLOCK = 4


class ScriptedConnector:
    """Supplies ``supply[request_id]`` tokens (asynchronously when ``load_async``)."""

    def __init__(self, supply: dict[str, int], load_async: bool) -> None:
        self.supply, self.load_async = supply, load_async
        self.allocated: dict[str, tuple[list[int], int, bool]] = {}
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.supply.get(request.request_id, 0), self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens, load_async):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens, load_async)

    def build_connector_meta(self, output):
        return {"step": [r.request_id for r in output.requests]}

    def request_finished(self, request):
        self.finished.append(request.request_id)
        return {"done": request.request_id}


def make(connector, num_blocks=16, budget=64):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True, watermark=0)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(config, kv, connector), kv


def test_synchronous_tokens_are_computed_at_admission_and_free_of_budget():
    connector = ScriptedConnector({"a": 8}, load_async=False)
    s, _ = make(connector, budget=3)
    s.add_request(Request("a", list(range(10, 21)), max_tokens=2))  # 11 tokens
    out = s.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens) == (8, 3)  # 8 supplied, 3 budgeted
    assert connector.allocated["a"] == (list(item.block_table), 8, False)
    assert len(item.block_table) == 3  # the supplied tokens' blocks and the chunk's
    assert out.kv_connector_metadata == {"step": ["a"]}
    assert item.request.num_cached_tokens == 8


def test_asynchronous_load_holds_the_request_and_others_pass_it():
    connector = ScriptedConnector({"a": 8}, load_async=True)
    s, kv = make(connector)
    s.add_request(Request("a", list(range(10, 21)), max_tokens=2))
    s.add_request(Request("b", [1, 2, 3], max_tokens=2))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["b"]
    a = s.requests["a"]
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert kv.get_block_table("a") and connector.allocated["a"][1:] == (8, True)
    # not in the prefix cache while they hold nothing: the same prompt does not hit them
    assert kv.get_computed_blocks(list(range(10, 21)))[1] == 0
    s.update(out, {"b": 9})
    out = s.schedule()
    assert out.requests == [s.requests["b"]]  # still held: only b runs
    s.update(out, {"b": 9})

    s.finish_kv_loads({"a": 8})
    assert kv.get_block_table("a") == [] and a.status is RequestStatus.WAITING
    connector.supply = {}  # what it loaded is the prefix cache's now
    out = s.schedule()
    item = next(x for x in out.scheduled if x.request.request_id == "a")
    assert (item.num_computed_tokens, item.num_new_tokens) == (8, 3)
    assert a.status is RequestStatus.RUNNING and a.num_cached_tokens == 8
    assert kv.get_computed_blocks(list(range(10, 21)) + [99])[1] == 8  # registered now


@pytest.mark.parametrize("arrived", [4, 0])
def test_what_a_load_did_not_bring_is_recomputed(arrived):
    """One block of two arrived (4 tokens), or none: the request's blocks go back to the pool
    (what arrived, cached) and its admission computes the rest."""
    connector = ScriptedConnector({"a": 8}, load_async=True)
    s, kv = make(connector)
    s.add_request(Request("a", list(range(10, 21)), max_tokens=2))
    s.schedule()
    s.finish_kv_loads({"a": arrived})
    assert kv.num_free_blocks == 16
    connector.supply = {}  # a connector offers a failed request nothing again
    item = s.schedule().scheduled[0]
    assert (item.num_computed_tokens, item.num_new_tokens) == (arrived, 11 - arrived)


def test_abort_while_loading_frees_blocks_and_tells_the_connector():
    connector = ScriptedConnector({"a": 8}, load_async=True)
    s, kv = make(connector)
    s.add_request(Request("a", list(range(10, 21)), max_tokens=2))
    s.schedule()
    assert kv.num_free_blocks < 16
    (aborted,) = s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 16 and connector.finished == ["a"]
    assert aborted.kv_transfer_params == {"done": "a"}
    assert not s.has_unfinished_requests()
    s.finish_kv_loads({"a": 8})  # the load's end, after the abort: ignored
    assert kv.num_free_blocks == 16


def test_finished_request_carries_the_connectors_params():
    connector = ScriptedConnector({}, load_async=False)
    s, _ = make(connector)
    s.add_request(Request("a", [1, 2, 3], max_tokens=1, kv_transfer_params={"x": 1}))
    out = s.schedule()
    (updated,) = s.update(out, {"a": 5})
    assert updated.is_finished and updated.kv_transfer_params == {"done": "a"}

"""Routing inside a model, without Ray running: the prefix key is the prefix cache's own chain
hash, rendezvous ranking keeps keys in place when replicas come and go, and the Serve router
sends a prompt to its preferred replica unless that one is busy."""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from pagedserve.cluster.router import ReplicaRouter  # noqa: E402
from pagedserve.cluster.routing import (  # noqa: E402
    ReplicaRequest,
    RoundRobin,
    prefix_key,
    rendezvous_order,
)
from pagedserve.engine import SamplingParams, extend_block_hashes  # noqa: E402

BLOCK = 16


def test_prefix_key_is_the_block_managers_hash_of_the_first_blocks():
    shared = list(range(100, 100 + BLOCK))
    a, b = shared + [1, 2, 3], shared + [7, 8, 9, 10, 11]
    assert prefix_key(a, BLOCK, 1) == prefix_key(b, BLOCK, 1)
    assert prefix_key(a, BLOCK, 1) == extend_block_hashes([], shared, BLOCK)[0]
    other = [99] + shared[1:] + [1, 2, 3]
    assert prefix_key(other, BLOCK, 1) != prefix_key(a, BLOCK, 1)
    assert prefix_key(shared[:-1], BLOCK, 1) is None  # no full block: nothing to share
    # two prefix blocks: the second block decides too (the chain covers both)
    two = shared + list(range(BLOCK))
    assert prefix_key(two + [5], BLOCK, 2) != prefix_key(
        shared + list(range(1, BLOCK + 1)), BLOCK, 2
    )
    assert prefix_key(two + [5], BLOCK, 2) == prefix_key(two + [6, 6], BLOCK, 2)


def test_rendezvous_moves_only_the_keys_of_a_replica_that_leaves_or_joins():
    rng = random.Random(0)
    keys = [rng.randbytes(32) for _ in range(400)]
    three = ["r-a", "r-b", "r-c"]
    before = {k: rendezvous_order(k, three)[0] for k in keys}
    shares = [sum(v == r for v in before.values()) / len(keys) for r in three]
    assert all(0.25 < s < 0.42 for s in shares), shares
    after_leave = {k: rendezvous_order(k, ["r-a", "r-c"])[0] for k in keys}
    assert all(after_leave[k] == v for k, v in before.items() if v != "r-b")
    after_join = {k: rendezvous_order(k, [*three, "r-d"])[0] for k in keys}
    moved = [k for k in keys if after_join[k] != before[k]]
    assert all(after_join[k] == "r-d" for k in moved) and 0.15 < len(moved) / len(keys) < 0.35


def test_round_robin_takes_each_replica_in_turn():
    rr = RoundRobin()
    assert [rr.pick(["b", "a", "c"]) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


class FakeReplica:
    def __init__(self, unique_id: str, deployment_id: DeploymentID) -> None:
        self.replica_id = ReplicaID(unique_id, deployment_id)
        self.max_ongoing_requests = 32


class FakePending:
    def __init__(self, request) -> None:
        self.args = [request]


@pytest.fixture
def router_and_replicas():
    deployment = DeploymentID(name="engine", app_name="model-x")
    router = ReplicaRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas = [FakeReplica(f"rep{i}", deployment) for i in range(3)]
    for r in replicas:
        router._replica_queue_len_cache.update(r.replica_id, 0)
    return router, replicas


def _request(tokens, **kwargs) -> FakePending:
    return FakePending(ReplicaRequest(tokens, SamplingParams(max_tokens=1), "id", **kwargs))


def _choose(router, replicas, pending):
    groups = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in group] for group in groups]


def test_router_keeps_a_prefix_on_its_replica_until_that_one_is_busy(router_and_replicas):
    router, replicas = router_and_replicas
    system = list(range(200, 200 + BLOCK))
    picks = {_choose(router, replicas, _request(system + [i] * 5))[0][0] for i in range(10)}
    assert len(picks) == 1  # every prompt of this system prompt: one replica
    (preferred,) = picks
    second = rendezvous_order(
        prefix_key(system, BLOCK, 1), [r.replica_id.unique_id for r in replicas]
    )[1]
    busy = next(r for r in replicas if r.replica_id.unique_id == preferred)
    router._replica_queue_len_cache.update(busy.replica_id, 4)  # = busy_threshold
    assert _choose(router, replicas, _request(system + [1])) == [[preferred, second]]
    # a replica that died under this request is not offered again
    request = _request(system + [1])
    request.args[0].tried.add(preferred)
    assert preferred not in _choose(router, replicas, request)[0]


def test_router_spreads_prompts_round_robin_when_asked(router_and_replicas):
    router, replicas = router_and_replicas
    system = list(range(300, 300 + BLOCK))
    picks = [
        _choose(router, replicas, _request(system, routing="round_robin"))[0][0] for _ in range(6)
    ]
    assert picks == ["rep0", "rep1", "rep2"] * 2


def test_router_offers_two_replicas_for_control_calls_and_short_prompts(router_and_replicas):
    router, replicas = router_and_replicas
    (group,) = _choose(router, replicas, FakePending(True))  # stats(drain=True): not a request
    assert len(group) == 2 and len(set(group)) == 2
    (group,) = _choose(router, replicas, _request([1, 2, 3]))  # no full block
    assert len(group) == 2

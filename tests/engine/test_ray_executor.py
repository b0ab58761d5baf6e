"""``distributed_executor_backend="ray"``: the workers are Ray actors in a placement group.

A Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``): a head with no CPU
to give, so the worker's bundle must land on the second node. Two pipeline stages there give
the single-process greedy tokens; a killed actor fails the engine by name, and shutting down
removes the placement group.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, EngineArgs, SamplingParams
from pagedserve.engine.errors import DistributedError

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray cluster and an actor: ~30 s

PROMPTS = [list(range(5, 22)), [100, 200, 300], list(range(30, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(block_size=8, max_num_batched_tokens=24, kv_cache_memory=8 << 20)


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture
def two_node_ray():
    from ray.cluster_utils import Cluster

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    worker_node = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield worker_node
    finally:
        ray.shutdown()
        cluster.shutdown()
        torch.set_num_threads(before)


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="distributed_executor_backend 'uni'"):
        EngineArgs(model="unused", distributed_executor_backend="uni")


def test_two_stages_on_ray_actors_equal_one_process(tiny_checkpoint, two_node_ray):
    path = tiny_checkpoint("llama")
    expected = _greedy(LLM(model=path, **ENGINE_ARGS))
    llm = LLM(
        model=path, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS
    )
    runner = llm.engine.runner
    try:
        assert _greedy(llm) == expected
        assert runner.workers.nodes == {1: two_node_ray.node_id}  # the head had no CPU for it
        (actor,) = runner.workers.actors.values()
        assert [m.stage for m in runner.rank_memory] == [1, 0]
        ray.kill(actor)
        with pytest.raises(DistributedError, match=r"rank 1 \(a Ray actor\) died"):
            _greedy(llm)
        # the failure itself released what the engine held on the cluster: no orphan
        states = [g["state"] for g in ray.util.placement_group_table().values()]
        assert states and all(state == "REMOVED" for state in states)
    finally:
        runner.shutdown()

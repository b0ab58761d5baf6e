"""ReplicaRouter: the routing policies of ``routing`` as Ray Serve's request router.

Serve runs it inside every deployment handle (so in the ingress) and gives it the live replica
set; it answers which replicas to try, in ranked groups, and Serve probes their queue lengths,
skips a full one and retries with backoff. Serve pickles this module *by value* into the
deployment's config, so it holds only the router: what it shares with the ingress
(``ReplicaRequest``) lives in ``routing`` and is pickled by reference, one class for both.
"""

from __future__ import annotations

import random

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from pagedserve.cluster.routing import ReplicaRequest, RoundRobin, prefix_key, rendezvous_order


def routed_request(pending: PendingRequest | None) -> ReplicaRequest | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], ReplicaRequest):
        return None  # a control call (describe, stats) or a probe: any replica will do
    return pending.args[0]


class ReplicaRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve request router for engine replicas: prefix-aware or round-robin per request
    (the policy travels with the request, so the ingress switches it without a restart).

    No FIFO mixin: a replica chosen for one request must serve that request, not the oldest
    pending one, or the prefix affinity is lost.
    """

    def initialize_state(self, **kwargs) -> None:
        self._round_robin = RoundRobin()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = routed_request(pending_request)
        live = [r for r in candidate_replicas if request is None or _id(r) not in request.tried]
        live = live or list(candidate_replicas)
        if not live:
            return []
        by_id = {_id(r): r for r in live}
        if request is None:
            return [random.sample(live, min(2, len(live)))]
        if request.routing == "round_robin":
            return [[by_id[self._round_robin.pick(list(by_id))]]]
        key = prefix_key(request.prompt_token_ids, request.block_size, request.prefix_blocks)
        if key is None:
            return [random.sample(live, min(2, len(live)))]
        ranked = [by_id[r] for r in rendezvous_order(key, list(by_id))]
        if await self._ongoing(ranked[0]) < request.busy_threshold:
            return [[ranked[0]]]
        return [ranked[:2]]  # Serve takes the one with the shorter queue

    async def _ongoing(self, replica: RunningReplica) -> float:
        """The replica's ongoing requests, from Serve's cache or a probe (inf if unknown)."""
        queue_len = self._replica_queue_len_cache.get(replica.replica_id)
        if queue_len is None:
            ((_, queue_len),) = await self._probe_queue_lens([replica], 0)
        return float("inf") if queue_len is None else queue_len


def _id(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id

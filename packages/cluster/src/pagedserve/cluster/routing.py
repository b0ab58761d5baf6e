"""Which replica of a model takes a request: prefix-aware (keep the prefix cache hitting) or
round-robin (the baseline it is measured against).

Prefix-aware: the key of a request is the chained hash of its prompt's first
``prefix_blocks`` full blocks, computed with the block manager's own hash
(``extend_block_hashes``), so two requests get the same key exactly when the prefix cache could
share those blocks between them. The key ranks the replicas by rendezvous hashing (highest
``sha256(key, replica id)`` first): every key has a preferred replica, and when a replica joins
or leaves only the keys it wins or held move. The preferred replica takes the request unless it
is busy (``busy_threshold`` ongoing requests or more); then the less loaded of the first two in
the ranking does, which keeps the request on a replica that has likely seen the prefix.

``router.ReplicaRouter`` plugs this into Ray Serve as the deployment's request router (it runs
in the ingress, inside the deployment handle); Serve still owns the replica set, the
queue-length probes, backpressure and the retries of a replica that refuses.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.engine import PoolingParams, SamplingParams, extend_block_hashes


@dataclass
class ReplicaRequest:
    """One engine request on its way to a replica, with what the router needs to place it."""

    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: a pooling model's request
    request_id: str
    prompt: str | None = None
    priority: int = 0
    routing: str = "prefix"
    block_size: int = 16
    prefix_blocks: int = 1
    busy_threshold: int = 4
    tried: set[str] = field(default_factory=set)  # replicas that died under this request
    token_type_ids: list[int] | None = None  # a pooling request's sentence-pair segments
    multi_modal_data: dict | None = None  # a vision model's images (PIL images pickle)


def prefix_key(token_ids: Sequence[int], block_size: int, num_blocks: int) -> bytes | None:
    """The chained hash of the first ``num_blocks`` full blocks (fewer if the prompt is shorter);
    None when the prompt has no full block (nothing the prefix cache could share)."""
    hashes = extend_block_hashes([], token_ids, block_size, num_tokens=block_size * num_blocks)
    return hashes[-1] if hashes else None


def rendezvous_order(key: bytes, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` ranked for ``key``, best first (highest-random-weight hashing)."""
    return sorted(
        replica_ids, key=lambda r: hashlib.sha256(key + r.encode()).digest(), reverse=True
    )


class RoundRobin:
    """The next replica in turn, over the replica ids in a fixed order."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, replica_ids: Sequence[str]) -> str:
        ordered = sorted(replica_ids)
        return ordered[next(self._counter) % len(ordered)]

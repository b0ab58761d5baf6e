"""What the scheduler asks of a KV connector: vLLM V1's scheduler-side interface.

A KV connector supplies keys and values that this engine did not compute: blocks offloaded to
host memory or disk, or blocks a prefill engine computed (disaggregated prefill). The
scheduler stays in charge of blocks; the connector only says how many of a request's tokens
it can supply, and moves the data (in the model runner, around the forward):

1. At admission, after the prefix cache's lookup (``num_computed_tokens`` tokens hit there),
   ``get_num_new_matched_tokens`` says how many more tokens, in whole blocks, it can supply,
   and whether they arrive now or later (``load_async``). It never supplies a prompt's last
   token: its logits are needed to sample.
2. The scheduler allocates blocks for them and calls ``update_state_after_alloc`` with the
   request's block ids. A synchronous load runs in this very step, before the forward; an
   asynchronous one leaves the request waiting (``RequestStatus.WAITING_FOR_REMOTE_KVS``),
   holding its blocks, which are not registered in the prefix cache until they are loaded.
3. Each step, ``build_connector_meta`` turns what was decided into the runner's work (loads to
   run, newly computed blocks to save); it rides on ``SchedulerOutput.kv_connector_metadata``.
4. The engine hands back the asynchronous loads that ended (``Scheduler.finish_kv_loads``):
   the loaded blocks are registered in the prefix cache and the request waits as any other,
   its admission hitting them there; what failed is recomputed.
5. ``request_finished`` when a request leaves (finished, aborted): the connector forgets it
   (an unfinished load is cancelled) and may return what the caller gets back (a prefill's
   transfer handle, vLLM's ``kv_transfer_params``).

Keys are the prefix cache's chained block hashes (``KVCacheManager.hash_prefix``), so the
connector and the prefix cache name a block alike. The implementations live in the engine
(``pagedserve.engine.kv_connector``); this module only states the contract, and what the
scheduler does with a load's end (``release_loaded_blocks``, step 4), so the scheduler depends
on no engine code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from pagedserve.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.blockmgr import KVCacheManager
    from pagedserve.scheduler.output import SchedulerOutput


class KVConnectorScheduler(Protocol):
    """The scheduler's side of a KV connector (the module docstring gives the protocol)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens after ``num_computed_tokens`` (whole blocks, never the last token) the
        connector can supply, and whether they arrive asynchronously."""
        ...

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: Sequence[int],
        num_external_tokens: int,
        load_async: bool,
    ) -> None:
        """The request now holds ``block_ids``; the ``num_external_tokens`` after its
        computed ones are the connector's to load."""
        ...

    def build_connector_meta(self, output: SchedulerOutput) -> object:
        """The step's work for the runner's side of the connector."""
        ...

    def request_finished(self, request: Request) -> dict | None:
        """Forget ``request``; the ``kv_transfer_params`` its caller gets back, if any."""
        ...


def release_loaded_blocks(
    kv: KVCacheManager, requests: Mapping[str, Request], num_computed: Mapping[str, int]
) -> None:
    """After asynchronous loads ended (request id -> tokens whose keys and values its blocks
    now hold: the prefix-cache hit and what arrived, fewer than asked when part of the load
    failed): each request's full blocks are registered in the prefix cache and its blocks
    freed, as a finished request's are. They wait in the free queue's most recently used end,
    and the request waits as any other, its admission hitting them in the prefix cache and
    computing the rest. So no waiting request holds blocks once its load has ended (waiting
    requests holding the pool while nothing runs could never move). Unknown or finished ids
    (an abort raced with the load) are ignored."""
    for request_id, num_tokens in num_computed.items():
        request = requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        tokens, salt, lora = request.all_token_ids, request.cache_salt, request.lora_int_id
        kv.cache_blocks(request_id, tokens, num_tokens, salt, lora)
        kv.free(request_id)
        request.status = RequestStatus.WAITING

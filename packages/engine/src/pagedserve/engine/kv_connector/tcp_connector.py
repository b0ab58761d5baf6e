"""TCPConnector: disaggregated prefill and decode, the prompt's blocks moved over TCP.

vLLM's shape, with its request fields (``kv_transfer_params``):

1. A proxy sends the prompt to the prefill engine (``kv_role`` ``kv_producer``) with
   ``{"do_remote_decode": true}`` and ``max_tokens`` 1. As the prefill computes the prompt's
   full blocks, they are copied into the transfer buffer (transfer.py); when the request
   finishes, its output's ``kv_transfer_params`` is the handle of the transfer:
   ``{"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id",
   "remote_num_blocks", "remote_engine_id"}``.
2. The proxy sends the same prompt to the decode engine (``kv_consumer``) with that handle.
   At admission the connector offers the blocks after the decode engine's own prefix-cache
   hit, up to the block before the prompt's last token (which the decode engine computes, for
   its logits); the request waits while a loader thread fetches them, and its admission then
   finds them in the prefix cache. A fetch is tried once per request: what it did not bring
   (a dead prefill engine, a timeout, a refused block) is recomputed, so the answer is right.

Keys: each block is named by the chain hash of its tokens from the public ``TRANSFER_ROOT``,
which both engines compute from the prompt alone, so a block can only land where the decode
engine's prompt has the same tokens; the record's header pins model, dtype and shape too.
``kv_both`` plays either part, as each request's parameters ask.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from pagedserve.blockmgr import extend_block_hashes
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.kv_connector.base import BlockSave, KVConnectorBase, LoadJob
from pagedserve.engine.kv_connector.block_record import BlockLayout
from pagedserve.engine.kv_connector.config import KVTransferConfig
from pagedserve.engine.kv_connector.stats import StatsRecorder
from pagedserve.engine.kv_connector.transfer import (
    TRANSFER_ROOT,
    TransferBuffer,
    TransferServer,
    fetch_blocks,
)
from pagedserve.scheduler import Request, RequestStatus, SchedulerOutput

# the kv_transfer_params fields pagedserve reads, and their types
TRANSFER_PARAMS = {
    "do_remote_decode": bool,
    "do_remote_prefill": bool,
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_request_id": str,
    "remote_num_blocks": int,
}
HANDLE = ("remote_host", "remote_port", "remote_request_id", "remote_num_blocks")


@dataclass
class _Produced:
    """A prefill's transfer: its id, its blocks' keys, and how many are saved so far."""

    transfer_id: str
    keys: list[bytes]
    num_saved: int = 0


class TCPConnector(KVConnectorBase):
    """The prefill engine's and/or the decode engine's side of a transfer (module docstring)."""

    def __init__(self, config: KVTransferConfig, layout: BlockLayout, stats: StatsRecorder):
        super().__init__(layout.block_size, stats)
        self.config, self.layout = config, layout
        self.engine_id = config.engine_id or f"pagedserve-{secrets.token_hex(4)}"
        self.timeout = float(config.extra("transfer_timeout"))
        self.buffer = self.server = None
        if config.is_producer:
            self.buffer = TransferBuffer(int(config.kv_buffer_size), stats)
            self.server = TransferServer(self.buffer, layout, config.kv_ip, config.kv_port)
        self._produced: dict[str, _Produced] = {}
        self._fetch_from: dict[str, int] = {}  # request id -> the first block it fetches
        self._tried: set[str] = set()

    def check_transfer_params(self, params: dict) -> None:
        """A request's ``kv_transfer_params``: known fields of the right types, and a part
        this engine plays (``InvalidRequestError`` naming the field)."""
        for key, value in params.items():
            kind = TRANSFER_PARAMS.get(key)
            if kind is None:
                raise InvalidRequestError(
                    f"kv_transfer_params.{key} is not a field pagedserve reads (it reads "
                    f"{', '.join(TRANSFER_PARAMS)})",
                    "kv_transfer_params",
                )
            if value is not None and (type(value) is not kind):
                raise InvalidRequestError(
                    f"kv_transfer_params.{key} must be a {kind.__name__}", "kv_transfer_params"
                )
        role = self.config.kv_role
        if params.get("do_remote_decode") and not self.config.is_producer:
            raise InvalidRequestError(
                f"do_remote_decode asks for a prefill, and this engine's kv_role is {role}",
                "kv_transfer_params",
            )
        if params.get("do_remote_prefill"):
            missing = [key for key in HANDLE if params.get(key) is None]
            if not self.config.is_consumer or missing:
                why = f"its kv_role is {role}" if not missing else f"it lacks {missing}"
                raise InvalidRequestError(
                    f"do_remote_prefill: this engine cannot fetch the blocks: {why}",
                    "kv_transfer_params",
                )

    # ---- the decode engine (consumer) -----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or request.request_id in self._tried:
            return 0, False
        usable = min(params["remote_num_blocks"], (request.num_tokens - 1) // self.block_size)
        first = num_computed // self.block_size
        if first >= usable:
            return 0, False
        self._fetch_from[request.request_id] = first
        return (usable - first) * self.block_size, True

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external: int, load_async: bool
    ) -> None:
        request_id, params = request.request_id, request.kv_transfer_params
        self._tried.add(request_id)  # once: after this its blocks are the prefix cache's
        first, count = self._fetch_from.pop(request_id), num_external // self.block_size
        keys = self._keys(request, first + count)[first:]
        address = (params["remote_host"], params["remote_port"])
        fetch = partial(
            fetch_blocks,
            address,
            params["remote_request_id"],
            first,
            keys,
            self.layout,
            self.timeout,
            self.stats,
        )
        block_ids = list(block_ids[first : first + count])
        self.plan_load(
            LoadJob(request_id, block_ids, ["remote"] * count, first * self.block_size, keys, None,
                    fetch)
        )  # fmt: skip

    # ---- the prefill engine (producer) ----------------------------------------------------------

    def blocks_to_save(self, output: SchedulerOutput) -> list[BlockSave]:
        """A prefill-for-remote-decode's full prompt blocks (those a decode engine can use) as
        they are computed, the prefix cache's hits included."""
        saves, block_size = [], self.block_size
        for request, start, count, block_ids in zip(
            output.requests, output.num_computed_tokens, output.num_new_tokens, output.block_ids
        ):
            params = request.kv_transfer_params
            if not params or not params.get("do_remote_decode"):
                continue
            produced = self._produced.get(request.request_id) or self._open_transfer(request)
            end = min((start + count) // block_size, len(produced.keys))
            for index in range(produced.num_saved, end):
                saves.append(BlockSave(request.request_id, block_ids[index], produced.keys[index]))
            produced.num_saved = max(produced.num_saved, end)
        return saves

    def store(self, saves: Sequence[BlockSave], payloads: Sequence[np.ndarray]) -> None:
        for save, payload in zip(saves, payloads, strict=True):
            self.buffer.add(self._produced[save.request_id].transfer_id, payload)

    def request_finished(self, request: Request) -> dict | None:
        """The handle of a finished prefill's transfer (an aborted one's is dropped)."""
        super().request_finished(request)
        self._tried.discard(request.request_id)
        self._fetch_from.pop(request.request_id, None)
        produced = self._produced.pop(request.request_id, None)
        if produced is None:
            return None
        if request.status is RequestStatus.FINISHED_ABORTED:
            self.buffer.drop(produced.transfer_id)
            return None
        ttl = float(self.config.extra("transfer_ttl"))
        num_blocks = self.buffer.finish(produced.transfer_id, ttl)
        if not num_blocks:  # a prompt of less than a block and a token: nothing to fetch
            self.buffer.drop(produced.transfer_id)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": _advertised(self.config.kv_ip),
            "remote_port": self.server.port,
            "remote_request_id": produced.transfer_id,
            "remote_num_blocks": num_blocks,
        }

    def shutdown(self) -> None:
        super().shutdown()
        if self.server is not None:
            self.server.close()

    # ---- internals -----------------------------------------------------------------------------

    def _open_transfer(self, request: Request) -> _Produced:
        usable = (request.num_prompt_tokens - 1) // self.block_size
        produced = _Produced(secrets.token_urlsafe(16), self._keys(request, usable))
        self.buffer.open(produced.transfer_id, produced.keys)
        self._produced[request.request_id] = produced
        return produced

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The transfer keys of the prompt's first ``num_blocks`` blocks."""
        tokens, block_size = request.prompt_token_ids, self.block_size
        return extend_block_hashes([], tokens, block_size, None, num_blocks * block_size, 0,
                                   TRANSFER_ROOT)  # fmt: skip


def _advertised(host: str) -> str:
    """The address a decode engine reaches the transfer server at: ``kv_ip``, or this
    machine's when it listens on every interface."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host

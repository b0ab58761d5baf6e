"""Disaggregated prefill from the decode server: each prompt's prefill runs on the prefill
server first (the proxy, as a route of the decode server).

A decode engine started with ``--kv-transfer-config '{"kv_role": "kv_consumer",
"kv_connector_extra_config": {"prefill_url": URL}}'`` is wrapped in ``PrefillFirst`` (and the
cluster's P/D pairs wrap their decode replicas the same way, over their prefill replicas:
``EnginePrefill``): before a request reaches the engine, its prompt (as token ids: the decode server's chat template and
tokenizer decide them once) goes to ``URL/v1/completions`` with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; the prefill server computes its KV blocks and
answers with the transfer's handle, which the request then carries into the decode engine,
whose connector fetches the blocks (kv_connector/tcp_connector.py). Every route that generates
(completions, chat, responses, messages) goes through it, streaming or not; the client talks
to the decode server alone.

When the prefill server cannot be reached, answers an error or takes longer than
``PREFILL_TIMEOUT_S`` seconds, the request runs on the decode engine alone, which computes the
prompt itself: the answer is the same, later. Requests with a LoRA adapter, prompt logprobs or
their own ``kv_transfer_params``, and prompts too short to fill a block, skip the prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import httpx

from pagedserve.engine import EngineClient, RequestOutput, RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedserve.server")

PREFILL_TIMEOUT_S = 600.0  # a long prompt's prefill on a CPU takes a while


class PrefillFirst:
    """An ``EngineClient`` whose ``generate`` has a prefill engine prefill first
    (``prefill(prompt_token_ids, request_id) -> handle | None``: ``HTTPPrefill``, a prefill
    server; ``EnginePrefill``, any EngineClient, as the cluster's replicas); every other member
    is the wrapped engine's. ``block_size``: the decode engine's (a shorter prompt has nothing
    to transfer)."""

    def __init__(self, engine: EngineClient, prefill, block_size: int):
        self.engine = engine
        self.prefill = prefill
        self.block_size = block_size

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        lora_request=None,
        multi_modal_data=None,
    ) -> AsyncIterator[RequestOutput]:
        params, extra = sampling_params, {}
        if multi_modal_data is not None:  # refused by an engine with a KV transfer
            extra["multi_modal_data"] = multi_modal_data
        if lora_request is not None:
            extra["lora_request"] = lora_request
        elif self._prefills(prompt_token_ids, params):
            handle = await self.prefill(prompt_token_ids, request_id)
            if handle is not None:
                params = dataclasses.replace(params, extra_args={"kv_transfer_params": handle})
        async for output in self.engine.generate(
            prompt_token_ids, params, request_id, prompt, priority, **extra
        ):
            yield output

    def _prefills(self, prompt_token_ids, params: SamplingParams) -> bool:
        return (
            params.prompt_logprobs is None
            and params.kv_transfer_params is None
            and len(prompt_token_ids) > self.block_size
        )

    async def shutdown(self) -> None:
        close = getattr(self.prefill, "aclose", None)
        if close is not None:
            await close()
        await self.engine.shutdown()


def _usable(handle, request_id: str) -> dict | None:
    """A prefill's answer, if it is a transfer handle (else the decode engine computes)."""
    if isinstance(handle, dict) and handle.get("do_remote_prefill"):
        return handle
    logger.warning("prefill of %s gave no transfer handle: computing it here", request_id)
    return None


class HTTPPrefill:
    """A prefill server's ``/v1/completions`` as ``PrefillFirst``'s prefill."""

    def __init__(self, url: str, timeout: float = PREFILL_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, prompt_token_ids: list[int], request_id: str) -> dict | None:
        body = {
            "prompt": prompt_token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        try:
            reply = await self._http().post(
                f"{self.url}/v1/completions",
                json=body,
                headers={"X-Request-Id": f"prefill-{request_id}"},
            )
            reply.raise_for_status()
            return _usable(reply.json().get("kv_transfer_params"), request_id)
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("prefill of %s on %s failed (%s): computing it here", request_id,
                           self.url, e)  # fmt: skip
            return None

    def _http(self) -> httpx.AsyncClient:
        """One client per event loop (connections are reused between requests)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client, self._loop = httpx.AsyncClient(timeout=self.timeout), loop
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class EnginePrefill:
    """A prefill engine behind an ``EngineClient`` (the cluster's prefill replicas) as
    ``PrefillFirst``'s prefill: the prompt with ``max_tokens`` 1, its final output's handle."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def __call__(self, prompt_token_ids: list[int], request_id: str) -> dict | None:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        )
        handle = None
        try:
            async for output in self.engine.generate(
                prompt_token_ids, params, f"prefill-{request_id}"
            ):
                handle = output.kv_transfer_params
        except Exception as e:  # a refusal, a dead replica: the decode engine computes
            logger.warning("prefill of %s failed (%r): computing it here", request_id, e)
            return None
        return _usable(handle, request_id)


def with_remote_prefill(
    engine: EngineClient, kv_transfer_config: dict | None, block_size: int
) -> EngineClient:
    """``engine`` (whose KV blocks hold ``block_size`` tokens), wrapped in ``PrefillFirst``
    when its KV transfer config names a prefill server
    (``kv_connector_extra_config.prefill_url``)."""
    extra = (kv_transfer_config or {}).get("kv_connector_extra_config") or {}
    url = extra.get("prefill_url")
    if not url:
        return engine
    return PrefillFirst(engine, HTTPPrefill(url), block_size)

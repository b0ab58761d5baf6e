"""Disaggregated prefill from the decode server: each prompt's prefill runs on the prefill
server first (the proxy, as a route of the decode server).

A decode engine started with ``--kv-transfer-config '{"kv_role": "kv_consumer",
"kv_connector_extra_config": {"prefill_url": URL}}'`` is wrapped in ``PrefillFirst``: before a
request reaches the engine, its prompt (as token ids: the decode server's chat template and
tokenizer decide them once) goes to ``URL/v1/completions`` with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; the prefill server computes its KV blocks and
answers with the transfer's handle, which the request then carries into the decode engine,
whose connector fetches the blocks (kv_connector/tcp_connector.py). Every route that generates
(completions, chat, responses, messages) goes through it, streaming or not; the client talks
to the decode server alone.

When the prefill server cannot be reached, answers an error or takes longer than
``prefill_timeout`` seconds, the request runs on the decode engine alone, which computes the
prompt itself: the answer is the same, later. Requests with a LoRA adapter, prompt logprobs or
their own ``kv_transfer_params``, and prompts too short to fill a block, skip the prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import httpx

from pagedserve.engine import EngineClient, RequestOutput, SamplingParams

logger = logging.getLogger("pagedserve.server")

PREFILL_TIMEOUT_S = 600.0  # a long prompt's prefill on a CPU takes a while


class PrefillFirst:
    """An ``EngineClient`` whose ``generate`` has the prefill server prefill first; every other
    member is the wrapped engine's."""

    def __init__(self, engine: EngineClient, prefill_url: str, timeout: float = PREFILL_TIMEOUT_S):
        self.engine = engine
        self.prefill_url = prefill_url.rstrip("/")
        self.timeout = timeout
        self.block_size = engine.cache_config.block_size
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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
    ) -> AsyncIterator[RequestOutput]:
        params = sampling_params
        if self._prefills(prompt_token_ids, params, lora_request):
            handle = await self.prefill(prompt_token_ids, request_id)
            if handle is not None:
                params = dataclasses.replace(params, extra_args={"kv_transfer_params": handle})
        async for output in self.engine.generate(
            prompt_token_ids, params, request_id, prompt, priority, lora_request
        ):
            yield output

    def _prefills(self, prompt_token_ids, params: SamplingParams, lora_request) -> bool:
        return (
            lora_request is None
            and params.prompt_logprobs is None
            and params.kv_transfer_params is None
            and len(prompt_token_ids) > self.block_size
        )

    async def prefill(self, prompt_token_ids: list[int], request_id: str) -> dict | None:
        """The transfer handle of the prompt's prefill on the prefill server (None: it failed,
        and the decode engine computes the prompt itself)."""
        body = {
            "prompt": prompt_token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        try:
            reply = await self._http().post(
                f"{self.prefill_url}/v1/completions",
                json=body,
                headers={"X-Request-Id": f"prefill-{request_id}"},
            )
            reply.raise_for_status()
            handle = reply.json().get("kv_transfer_params")
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("prefill of %s on %s failed (%s): computing it here", request_id,
                           self.prefill_url, e)  # fmt: skip
            return None
        return handle if isinstance(handle, dict) and handle.get("do_remote_prefill") else None

    def _http(self) -> httpx.AsyncClient:
        """One client per event loop (connections are reused between requests)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client, self._loop = httpx.AsyncClient(timeout=self.timeout), loop
        return self._client

    async def shutdown(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        await self.engine.shutdown()


def with_remote_prefill(engine: EngineClient, kv_transfer_config: dict | None) -> EngineClient:
    """``engine``, wrapped in ``PrefillFirst`` when its KV transfer config names a prefill
    server (``kv_connector_extra_config.prefill_url``)."""
    extra = (kv_transfer_config or {}).get("kv_connector_extra_config") or {}
    url = extra.get("prefill_url")
    return PrefillFirst(engine, url) if url else engine

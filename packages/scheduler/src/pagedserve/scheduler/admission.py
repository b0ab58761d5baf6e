"""Admission control: the checks a request meets before it may wait for a place in a step.

A request that can never run (an empty or too long prompt, more KV blocks than the cache can
give one request) is refused for good, naming the field at fault; a request that finds the
waiting queue full is refused for now (retry later).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import RequestRejectedError, SchedulerOverloadedError
from pagedserve.scheduler.request import Request

if TYPE_CHECKING:
    from pagedserve.scheduler.queue import WaitingQueue


def check_fits(request: Request, config: SchedulerConfig, kv: KVCacheManager) -> None:
    """Refuse a request that could never run (see ``Scheduler.add_request``)."""
    num_prompt = request.num_prompt_tokens
    max_len = config.max_model_len
    if num_prompt == 0:
        raise RequestRejectedError("the prompt is empty: give at least one token", "prompt")
    if request.pooling:  # prefill only: the prompt may fill max_model_len, no token follows
        if num_prompt > max_len:
            raise RequestRejectedError(
                f"the prompt has {num_prompt} tokens, more than max_model_len ({max_len}): "
                "shorten it, or truncate it (truncate_prompt_tokens)",
                "prompt",
            )
        _check_blocks(request, num_prompt, kv)
        return
    if num_prompt >= max_len:
        raise RequestRejectedError(
            f"the prompt has {num_prompt} tokens; max_model_len is {max_len}, which leaves "
            "no room for a new token: shorten the prompt",
            "prompt",
        )
    if request.max_tokens < 1:
        raise RequestRejectedError(
            f"max_tokens must be >= 1, got {request.max_tokens}", "max_tokens"
        )
    if num_prompt + request.max_tokens > max_len:
        raise RequestRejectedError(
            f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) exceeds "
            f"max_model_len ({max_len}): shorten the prompt or lower max_tokens",
            "max_tokens",
        )
    # The last sampled token is never fed back, so it needs no slot.
    _check_blocks(request, num_prompt + request.max_tokens - 1, kv)


def _check_blocks(request: Request, max_kv_tokens: int, kv: KVCacheManager) -> None:
    """The watermark is kept free on admission, so one request may hold at most num_blocks -
    watermark blocks (a request that needed more could wait at the head of the queue
    forever). A model without a KV cache (``NoKVCacheManager``: no blocks) needs none."""
    if not kv.num_blocks:
        return
    blocks_needed = -(-max_kv_tokens // kv.block_size)
    blocks_usable = kv.num_blocks - kv.watermark_blocks
    if blocks_needed > blocks_usable:
        what, param = (
            ("the prompt", "prompt")
            if request.pooling
            else (f"prompt + max_tokens ({request.max_tokens})", "max_tokens")
        )
        raise RequestRejectedError(
            f"{what} ({max_kv_tokens} tokens in the cache) needs {blocks_needed} KV blocks of "
            f"{kv.block_size} tokens, but the KV cache can give one request at most "
            f"{blocks_usable}: shorten it or enlarge the cache",
            param,
        )


def check_not_overloaded(request: Request, config: SchedulerConfig, waiting: WaitingQueue) -> None:
    """Refuse a request while the waiting queue is full (``SchedulerOverloadedError``)."""
    if len(waiting) >= config.max_num_waiting:
        raise SchedulerOverloadedError(
            f"the waiting queue is full ({len(waiting)} requests, max_num_waiting = "
            f"{config.max_num_waiting}): retry later"
        )
    cap = config.max_num_waiting_tokens
    if cap and waiting.num_tokens + request.num_tokens > cap:
        raise SchedulerOverloadedError(
            f"the waiting queue is full ({waiting.num_tokens} tokens waiting, "
            f"max_num_waiting_tokens = {cap}): retry later"
        )

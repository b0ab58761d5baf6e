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
    # The last sampled token is never fed back, so it needs no slot. The watermark is kept
    # free on admission, so one request may hold at most num_blocks - watermark blocks (a
    # request that needed more could wait at the head of the queue forever).
    max_kv_tokens = num_prompt + request.max_tokens - 1
    blocks_needed = -(-max_kv_tokens // kv.block_size)
    blocks_usable = kv.num_blocks - kv.watermark_blocks
    if blocks_needed > blocks_usable:
        raise RequestRejectedError(
            f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) needs "
            f"{blocks_needed} KV blocks of {kv.block_size} tokens, but the KV cache can "
            f"give one request at most {blocks_usable}: lower max_tokens or enlarge the cache",
            "max_tokens",
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

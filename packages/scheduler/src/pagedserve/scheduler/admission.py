"""Admission control: the checks a request meets before it may wait for a place in a step,
and what admitting it would take (its first chunk, its blocks).

A request that can never run (an empty or too long prompt, more KV blocks than the cache can
give one request) is refused for good, naming the field at fault; a request that finds the
waiting queue full is refused for now (retry later).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import RequestRejectedError, SchedulerOverloadedError
from pagedserve.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.scheduler.encoder_cache import EncoderCacheManager
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
    _check_images(request, config)


def _check_images(request: Request, config: SchedulerConfig) -> None:
    """Every image must fit the encoder cache (which holds it while its placeholders are
    computed); without chunked prefill, all of a prompt's images at once. An image computed in
    one chunk (``whole_images``) must fit one step's token budget."""
    # a picture repeated in the prompt is encoded once, and held once
    sizes = list({image.content_hash: image.length for image in request.images}.values())
    room, budget = config.encoder_cache_size, config.max_num_batched_tokens
    if sizes and config.whole_images and max(sizes) > budget:
        raise RequestRejectedError(
            f"an image of the prompt takes {max(sizes)} tokens, more than one step computes "
            f"(max_num_batched_tokens = {budget}): this model reads an image's tokens in one "
            "step (they attend to each other both ways)",
            "multi_modal_data",
        )
    if sizes and max(sizes) > room:
        raise RequestRejectedError(
            f"an image of the prompt takes {max(sizes)} tokens, more than the encoder cache "
            f"holds ({room}; raise encoder_cache_size)",
            "multi_modal_data",
        )
    if sizes and not config.enable_chunked_prefill and sum(sizes) > room:
        raise RequestRejectedError(
            f"the prompt's images take {sum(sizes)} tokens, more than the encoder cache holds "
            f"({room}) and chunked prefill is off: raise encoder_cache_size",
            "multi_modal_data",
        )


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


def next_chunk(
    request: Request,
    num_computed: int,
    budget: int,
    config: SchedulerConfig,
    encoder: EncoderCacheManager,
) -> int:
    """The next chunk's size: every uncomputed token, capped by the long-prefill threshold
    (when chunked prefill is on) and by what is left of the budget, ending before an image the
    encoder cache cannot take in this step, and never inside an image read whole."""
    num_new = request.num_tokens - num_computed
    threshold = config.long_prefill_token_threshold
    if threshold and config.enable_chunked_prefill:
        num_new = min(num_new, threshold)
    num_new = min(num_new, budget)
    if request.images:
        end = num_computed + num_new
        if config.whole_images:
            end = _around_whole_images(request, num_computed, end, num_computed + budget)
        num_new = encoder.chunk_end(request, num_computed, end) - num_computed
    return num_new


def _around_whole_images(request: Request, start: int, end: int, budget_end: int) -> int:
    """Where the chunk ``[start, end)`` ends so that it cuts no image: before the first image it
    would cut; past it when the chunk starts inside it (a prefix hit that ends mid-image: the
    rest is computed at once, over the threshold if need be) and the budget reaches its end;
    else at ``start`` (nothing this step)."""
    for image in request.images:
        image_end = image.offset + image.length
        if image.offset < end < image_end:
            if image.offset > start:
                return image.offset
            return image_end if image_end <= budget_end else start
    return end


def blocks_to_admit(
    request: Request, kv: KVCacheManager, config: SchedulerConfig, encoder: EncoderCacheManager
) -> int:
    """The free blocks that admitting ``request`` takes: those of its first chunk, and of its
    cached prefix those that no running request holds (the pool counts them as free, ready to
    evict), plus the watermark an admission leaves. Asked again after each preemption, since
    a victim may have held blocks of that prefix."""
    hits, num_cached = kv.get_computed_blocks(
        request.all_token_ids, request.cache_salt, request.lora_int_id, request.images
    )
    num_new = next_chunk(request, num_cached, config.max_num_batched_tokens, config, encoder)
    num_blocks = -(-(num_cached + num_new) // kv.block_size)
    num_idle_hits = sum(1 for block in hits if block.ref_count == 0)
    return num_blocks - len(hits) + num_idle_hits + kv.watermark_blocks


def check_fork(requests: Mapping[str, Request], parent_request_id: str, child: Request) -> Request:
    """The running parent that ``child`` may fork from, or ValueError: the parent must run,
    the child's id be new, and its tokens extend the parent's computed ones."""
    parent = requests.get(parent_request_id)
    if parent is None or parent.status is not RequestStatus.RUNNING:
        raise ValueError(f"request {parent_request_id!r} is not running: it cannot be forked")
    if child.request_id in requests:
        raise ValueError(f"request id {child.request_id!r} is already in use")
    computed = parent.num_computed_tokens
    if child.num_tokens <= computed or (
        child.all_token_ids[:computed] != parent.all_token_ids[:computed]
    ):
        raise ValueError(
            f"a child of {parent_request_id!r} must start with the parent's {computed} "
            "computed tokens and have at least one more"
        )
    return parent

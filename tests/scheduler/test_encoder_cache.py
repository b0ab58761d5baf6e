"""Images in the schedule: each encoded once, chunks that stop before an image with no room,
and prefix-cache blocks keyed by the image's content as well as its placeholder tokens."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import ImagePlaceholder, KVCacheManager
from pagedserve.scheduler import Request, RequestRejectedError, Scheduler, SchedulerConfig

IMG = 99  # the placeholder token


def make_scheduler(prefix_caching=False, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 8)
    config.setdefault("max_model_len", 64)
    config.setdefault("encoder_cache_size", 16)
    kv = KVCacheManager(64, 4, enable_prefix_caching=prefix_caching, watermark=0)
    return Scheduler(SchedulerConfig(**config), kv)


def image_request(request_id: str, picture: bytes, before=2, length=12, after=3, **kw):
    """``before`` text tokens, one image of ``length`` placeholders, ``after`` text tokens."""
    prompt = [1] * before + [IMG] * length + [2] * after
    image = ImagePlaceholder(before, length, picture.ljust(32, b"\0"))
    return Request(request_id, prompt, max_tokens=kw.pop("max_tokens", 2), images=(image,), **kw)


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    sampled = {s.request.request_id: [5] for s in out.scheduled if s.needs_sample}
    scheduler.update(out, sampled)
    chunks = [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
    encoded = [(r.request_id, i) for r, i in out.encoder_inputs]
    return chunks, encoded, out


def test_a_prompt_chunked_through_its_image_encodes_it_once():
    s = make_scheduler()
    s.add_request(image_request("a", b"cat"))
    assert step(s)[:2] == ([("a", 0, 8)], [("a", 0)])  # the chunk ends mid-image
    assert step(s)[:2] == ([("a", 8, 8)], [])  # the rest comes from the cache
    assert step(s)[:2] == ([("a", 16, 1)], [])
    assert s.encoder.num_encoded == 1


def test_a_chunk_stops_before_an_image_the_cache_has_no_room_for():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(image_request("a", b"cat"))
    s.add_request(image_request("b", b"dog"))
    chunks, encoded, _ = step(s)
    # a's image takes 12 of the 16 rows: b reads its text up to its image, no further
    assert chunks == [("a", 0, 17), ("b", 0, 2)] and encoded == [("a", 0)]
    chunks, encoded, out = step(s)
    assert ("b", 2, 15) in chunks and encoded == [("b", 0)]
    assert out.encoder_cache_freed == [b"cat".ljust(32, b"\0")]  # a is past it: evicted


def test_the_same_picture_again_is_an_encoder_cache_hit():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(image_request("a", b"cat", max_tokens=1))
    step(s)
    s.add_request(image_request("b", b"cat", max_tokens=1))
    chunks, encoded, _ = step(s)
    assert chunks == [("b", 0, 17)] and encoded == []
    assert (s.encoder.num_encoded, s.encoder.num_hits) == (1, 1)


def test_an_image_larger_than_the_encoder_cache_is_refused():
    s = make_scheduler(encoder_cache_size=8)
    with pytest.raises(RequestRejectedError) as e:
        s.add_request(image_request("a", b"cat"))
    assert e.value.param == "multi_modal_data" and "encoder_cache_size" in str(e.value)


def test_prefix_blocks_hit_only_for_the_same_picture():
    s = make_scheduler(prefix_caching=True, max_num_batched_tokens=32)
    s.add_request(image_request("a", b"cat", max_tokens=1))
    step(s)
    same_text_other_picture = image_request("b", b"dog", max_tokens=1)
    _, hit = s.kv.get_computed_blocks(
        same_text_other_picture.all_token_ids, images=same_text_other_picture.images
    )
    assert hit == 0
    same_picture = image_request("c", b"cat", max_tokens=1)
    _, hit = s.kv.get_computed_blocks(same_picture.all_token_ids, images=same_picture.images)
    assert hit == 16  # every full block but the one with the last token
    text_only_prefix = Request("d", [1, 1, IMG, IMG, 7], max_tokens=1)
    _, hit = s.kv.get_computed_blocks(text_only_prefix.all_token_ids)
    assert hit == 0  # the first block holds image placeholders: keyed by the picture too

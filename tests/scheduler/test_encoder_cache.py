"""Images in the schedule: each encoded once, chunks that stop before an image with no room,
and prefix-cache blocks keyed by the image's content as well as its placeholder tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.blockmgr import ImagePlaceholder, KVCacheManager
from pagedserve.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)

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
    chunks = [
        (s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled
    ]
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


def test_a_cached_picture_later_in_a_chunk_is_no_room_for_an_earlier_new_one():
    """The chunk reaches a new picture first, then a cached one it must keep: the new one may
    not count on evicting the kept one, so the chunk ends before the cached picture."""
    s = make_scheduler(max_num_batched_tokens=32, encoder_cache_size=10)
    s.add_request(image_request("a", b"yard", before=0, length=5, after=1, max_tokens=1))
    step(s)  # "yard" is cached and, a finished, unreferenced
    prompt = [IMG] * 8 + [IMG] * 5 + [2]
    pictures = (
        ImagePlaceholder(0, 8, b"new".ljust(32, b"\0")),
        ImagePlaceholder(8, 5, b"yard".ljust(32, b"\0")),
    )
    s.add_request(Request("b", prompt, max_tokens=1, images=pictures))
    chunks, encoded, _ = step(s)
    assert chunks == [("b", 0, 8)] and encoded == [("b", 0)]
    assert s.encoder.num_cached_rows <= s.encoder.capacity
    chunks, encoded, _ = step(s)
    assert chunks == [("b", 8, 6)] and encoded == [("b", 1)]  # "yard" was evicted for "new"


def test_a_picture_twice_in_a_prompt_is_held_until_its_last_copy_is_read():
    """Between the copies the request keeps its reference (an eviction there would encode the
    picture again): the second copy is no hit of its own, and nothing is encoded twice."""
    s = make_scheduler(max_num_batched_tokens=4, encoder_cache_size=8)
    cat = b"cat".ljust(32, b"\0")
    prompt = [IMG] * 4 + [1] * 4 + [IMG] * 4 + [2]
    twice = (ImagePlaceholder(0, 4, cat), ImagePlaceholder(8, 4, cat))
    s.add_request(Request("a", prompt, max_tokens=1, images=twice))
    encoded = [step(s)[1] for _ in range(4)]
    assert encoded == [[("a", 0)], [], [], []]
    assert (s.encoder.num_encoded, s.encoder.num_hits) == (1, 0)


def test_without_chunked_prefill_a_repeated_picture_counts_once():
    s = make_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=64, encoder_cache_size=8
    )
    cat = b"cat".ljust(32, b"\0")
    twice = (ImagePlaceholder(0, 8, cat), ImagePlaceholder(9, 8, cat))
    s.add_request(Request("a", [IMG] * 8 + [1] + [IMG] * 8 + [2], max_tokens=1, images=twice))
    assert step(s)[:2] == ([("a", 0, 18)], [("a", 0)])


PICTURE_LENGTHS = (4, 6, 8, 6)  # picture i has one size, as a model gives a picture one size


@st.composite
def image_workloads(draw):
    requests = []
    for i in range(draw(st.integers(1, 8))):
        tokens, images = [], []
        for _ in range(draw(st.integers(1, 3))):
            tokens += [1] * draw(st.integers(0, 4))
            picture = draw(st.integers(0, len(PICTURE_LENGTHS) - 1))
            length = PICTURE_LENGTHS[picture]
            images.append(ImagePlaceholder(len(tokens), length, bytes([picture]) * 32))
            tokens += [IMG] * length
        tokens += [2] * draw(st.integers(1, 3))
        requests.append(Request(f"r{i}", tokens, max_tokens=draw(st.integers(1, 3)), images=images))
    config = dict(
        max_num_batched_tokens=draw(st.sampled_from([3, 5, 8, 16])),
        encoder_cache_size=draw(st.sampled_from([8, 10, 16])),
        max_num_seqs=draw(st.sampled_from([2, 4])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 4])),
        whole_images=draw(st.booleans()),
    )
    blocks = draw(st.sampled_from([12, 40]))
    return requests, config, blocks, draw(st.booleans()), draw(st.randoms())


@given(image_workloads())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_runner_always_holds_what_a_step_reads_and_the_cache_its_capacity(workload):
    """Over random prompts of repeated pictures, tiny pools (preemption), prefix caching and
    aborts: every image a scheduled chunk covers is in the runner's cache (what the steps told
    it to encode, minus what they told it to drop), the cache never holds more than its
    capacity, and every request finishes. With images read both ways (``whole_images``) no
    chunk ends inside an image, and an image longer than a step is refused at once."""
    requests, config, blocks, prefix_caching, rng = workload
    kv = KVCacheManager(blocks, 4, enable_prefix_caching=prefix_caching, watermark=0)
    s = Scheduler(SchedulerConfig(max_model_len=64, **config), kv)
    for request in requests:
        longest = max(image.length for image in request.images)
        if config["whole_images"] and longest > config["max_num_batched_tokens"]:
            with pytest.raises(RequestRejectedError):
                s.add_request(request)
            continue
        s.add_request(request)
    runner: set[bytes] = set()
    for _ in range(500):
        if not s.requests:
            break
        out = s.schedule()
        runner -= set(out.encoder_cache_freed)
        runner |= {r.images[i].content_hash for r, i in out.encoder_inputs}
        for item in out.scheduled:
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            for image in item.request.images:
                assert not image.overlaps(start, end) or image.content_hash in runner
                cut = image.offset < end < image.offset + image.length
                assert not (config["whole_images"] and cut), (start, end, image)
        assert s.encoder.num_cached_rows <= s.encoder.capacity
        s.update(out, {i.request.request_id: [5] for i in out.scheduled if i.needs_sample})
        if s.running and rng.random() < 0.05:
            s.finish_requests([rng.choice(s.running).request_id], RequestStatus.FINISHED_ABORTED)
    assert not s.requests, "a request never finished: a livelock"


def test_an_image_read_both_ways_is_never_split_across_chunks():
    """Gemma 3's image tokens attend to each other both ways: the chunk that would cut the
    image stops before it, and the next takes the whole image (over the long-prefill
    threshold when need be)."""
    s = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8, whole_images=True)
    s.add_request(image_request("a", b"cat", before=3, length=12, after=3))
    assert step(s)[:2] == ([("a", 0, 3)], [])  # up to the image, not into it
    assert step(s)[:2] == ([("a", 3, 12)], [("a", 0)])  # the image whole, past the threshold
    assert step(s)[:2] == ([("a", 15, 3)], [])


def test_an_image_read_both_ways_waits_for_a_step_with_room_for_it():
    s = make_scheduler(max_num_batched_tokens=16, whole_images=True)
    s.add_request(Request("text", [1] * 10, max_tokens=8))
    step(s)  # text's prompt; it decodes from here on, one token of each step's budget
    s.add_request(image_request("a", b"cat", before=0, length=16, after=1))
    chunks, _, _ = step(s)
    assert ("a", 0, 16) not in chunks and ("text", 10, 1) in chunks  # 15 left: not the image
    s.finish_requests(["text"], RequestStatus.FINISHED_ABORTED)
    chunks, encoded, _ = step(s)
    assert chunks == [("a", 0, 16)] and encoded == [("a", 0)]


def test_an_image_read_both_ways_larger_than_a_step_is_refused():
    s = make_scheduler(max_num_batched_tokens=8, whole_images=True)
    with pytest.raises(RequestRejectedError) as e:
        s.add_request(image_request("a", b"cat", length=12))
    assert e.value.param == "multi_modal_data" and "max_num_batched_tokens" in str(e.value)

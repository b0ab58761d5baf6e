"""The encoder cache's bookkeeping: which images' embeddings the model runner holds.

A prompt with an image is a run of placeholder tokens whose rows the model fills with the
image's embeddings, which a vision encoder computes from the pixels. The encoder runs once per
image: its output stays in the model runner's encoder cache, keyed by the image's content hash,
while any request still has placeholders of that image to compute, and after that for as long
as the room is not needed (the same picture in the next request is a hit). So a prompt chunked
across steps, whose chunk ends in the middle of an image, never encodes the image twice.

This class is the scheduler's half: it decides, under one capacity in tokens (image embedding
rows), which images a step encodes, and which cached entries the runner drops; the runner holds
the tensors (engine/encoder_cache.py). The capacity also bounds the image tokens one step
encodes (``begin_step``), so that a burst of images cannot make one step's encoder work
unbounded beside the step's token budget.

A chunk of a prompt may cover an image's placeholders only if the image's embeddings are cached
or can be computed in this step (its tokens fit the step's encoder budget and the cache's free
room); otherwise the chunk ends where that image starts. A request holds a reference on each
image from the step that first needs it until its computed tokens pass the image's end (then
it is released, not evicted), or until it finishes or is preempted. A request holds references
only on images it is in the middle of, and those always make progress (their embeddings are
cached), so no two requests can wait on each other's room forever.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.scheduler.request import Request


class EncoderCacheManager:
    """Image embeddings cached in the model runner, by content hash, in LRU order."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the encoder cache needs room for at least one token, got {capacity}")
        self.capacity = capacity
        self._tokens: OrderedDict[bytes, int] = OrderedDict()  # cached entries, LRU first
        self._users: dict[bytes, set[str]] = {}  # entries some request still needs
        self._used = 0
        self._step_budget = capacity
        self._freed: list[bytes] = []
        self.num_encoded = 0  # images encoded since the start (a repeated image: once)
        self.num_hits = 0  # images a request found already encoded

    @property
    def num_cached_rows(self) -> int:
        """The embedding rows the cached entries hold: never more than ``capacity``."""
        return self._used

    # ---- one step ------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._step_budget = self.capacity

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """Where the chunk ``[start, end)`` of ``request`` must end for every image it covers
        to be cached or encodable in this step: ``end``, or the start of the first image that
        cannot be (no earlier than ``start``). Changes nothing.

        Images are taken in prompt order, as the chunk reaches them. The free room counts the
        unreferenced cached entries as evictable; a cached image the chunk reaches is kept (no
        longer evictable), so when the images before it have already counted on its room, the
        chunk ends before it."""
        budget, room = self._step_budget, self.capacity - self._used + self._evictable()
        counted: set[bytes] = set()
        for image in request.images:
            key = image.content_hash
            if not image.overlaps(start, end) or key in counted:
                continue
            counted.add(key)
            if key in self._tokens:
                if not self._users.get(key):  # cached, unreferenced: this chunk keeps it
                    if room < image.length:
                        return max(start, image.offset)
                    room -= image.length
                continue
            if image.length > min(budget, room):
                return max(start, image.offset)
            budget, room = budget - image.length, room - image.length
        return end

    def schedule(self, request: Request, start: int, end: int) -> list[int]:
        """Reference every image the chunk ``[start, end)`` covers (``chunk_end`` said they
        fit); returns the indices, in ``request.images``, of those to encode in this step."""
        to_encode: list[int] = []
        covered = [(i, m) for i, m in enumerate(request.images) if m.overlaps(start, end)]
        for _, image in covered:  # first the cached ones: no eviction may take them now
            key = image.content_hash
            if key in self._tokens:
                self._tokens.move_to_end(key)
                users = self._users.setdefault(key, set())
                self.num_hits += request.request_id not in users
                users.add(request.request_id)
        for index, image in covered:
            key = image.content_hash
            if key in self._tokens:  # cached before, or encoded for an earlier placeholder
                self._users.setdefault(key, set()).add(request.request_id)
                continue
            self._make_room(image.length)
            self._tokens[key], self._used = image.length, self._used + image.length
            self._step_budget -= image.length
            self._users.setdefault(key, set()).add(request.request_id)
            self.num_encoded += 1
            to_encode.append(index)
        return to_encode

    def take_freed(self) -> list[bytes]:
        """The hashes evicted since the last call: the runner drops their embeddings before
        it encodes this step's images."""
        freed, self._freed = self._freed, []
        return freed

    # ---- references ----------------------------------------------------------------------

    def release_consumed(self, request: Request) -> None:
        """Drop ``request``'s references on the pictures its computed tokens have passed (a
        picture that appears twice in the prompt: once past its last copy)."""
        last_end: dict[bytes, int] = {}
        for image in request.images:
            end = image.offset + image.length
            last_end[image.content_hash] = max(end, last_end.get(image.content_hash, 0))
        for key, end in last_end.items():
            if end <= request.num_computed_tokens:
                self._drop_user(key, request.request_id)

    def release(self, request: Request) -> None:
        """Drop all of ``request``'s references (it finished, or was preempted)."""
        for image in request.images:
            self._drop_user(image.content_hash, request.request_id)

    def _drop_user(self, key: bytes, request_id: str) -> None:
        users = self._users.get(key)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self._users[key]

    def _evictable(self) -> int:
        return sum(n for key, n in self._tokens.items() if key not in self._users)

    def _make_room(self, num_tokens: int) -> None:
        """Evict unreferenced entries, least recently used first, until ``num_tokens`` fit."""
        for key in [k for k in self._tokens if k not in self._users]:
            if self._used + num_tokens <= self.capacity:
                return
            self._used -= self._tokens.pop(key)
            self._freed.append(key)

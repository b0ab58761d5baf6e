"""Chained block hashes for prefix caching.

The hash of block ``i`` covers the hash of block ``i-1`` (and so every token before it), the
block's own tokens, and extra keys: the LoRA adapter the tokens were computed with (its keys
and values differ from the base model's and every other adapter's), a cache salt, and the
content hash of every image whose placeholder tokens the block holds. Two requests get the same
hash for a block only when their whole prefix up to the end of that block is identical, images
included, and was computed with the same adapter.

Why images need their own key: an image enters the prompt as a run of identical placeholder
tokens, whose rows the model replaces with the image's embeddings. Two prompts with the same
text and different pictures have the same token ids, and different keys and values from the
first placeholder on; hashing the picture's bytes into the blocks that hold its placeholders
(and, through the chain, into every block after them) keeps them apart, while the same picture
again hashes the same and hits.

SHA-256 (not Python's ``hash``) with a random seed as the chain's root: a collision would
silently serve one request another request's keys and values, so it must be infeasible to find
or forge. The root is per process unless the caller gives one (``root``): a KV store that
outlives the process (the disk tier of KV offloading) keeps its own random root beside its
blocks, so a restarted engine names the same prefix with the same hashes.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_PROCESS_SEED = os.urandom(16)


@dataclass(frozen=True)
class ImagePlaceholder:
    """Where one image sits in a prompt: its placeholder tokens ``[offset, offset + length)``
    and a hash of its content (the engine's: of the decoded pixels, never of the URL)."""

    offset: int
    length: int
    content_hash: bytes

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.offset + self.length


def hash_block(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_key: str | None = None,
    lora_int_id: int = 0,
    root: bytes | None = None,
    images: Sequence[tuple[int, bytes]] = (),
) -> bytes:
    """Hash one full block given its parent's hash (None for the first block, which hashes
    ``root``, by default the process's own random seed); ``lora_int_id`` 0 is the base model.
    ``images``: (where the image starts relative to the block's first token, its content
    hash) for each image with placeholders in the block."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else root or _PROCESS_SEED)
    h.update(array("q", token_ids).tobytes())  # fixed width: the token/salt boundary is unambiguous
    if lora_int_id:  # fixed width too, and before the salt: no salt can spell an adapter
        h.update(b"\x00lora\x00" + lora_int_id.to_bytes(8, "little", signed=True))
    if extra_key:
        h.update(b"\x00salt\x00" + extra_key.encode("utf-8"))
    for start, content_hash in images:  # fixed width, after the salt, which it cannot spell
        h.update(b"\x00image\x00" + start.to_bytes(8, "little", signed=True) + content_hash)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    extra_key: str | None = None,
    num_tokens: int | None = None,
    lora_int_id: int = 0,
    root: bytes | None = None,
    images: Sequence[ImagePlaceholder] = (),
) -> list[bytes]:
    """Append the hashes of any full blocks of ``token_ids`` not yet in ``hashes`` (in place).

    ``num_tokens`` limits the blocks to the first ``num_tokens`` tokens without the caller
    slicing (copying) the whole sequence at every step. ``images``: the prompt's images, each
    hashed into the blocks its placeholders fall in.
    """
    known = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    num_full = known // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[-1] if hashes else None
        start, end = i * block_size, (i + 1) * block_size
        in_block = [(m.offset - start, m.content_hash) for m in images if m.overlaps(start, end)]
        hashes.append(
            hash_block(parent, token_ids[start:end], extra_key, lora_int_id, root, in_block)
        )
    return hashes

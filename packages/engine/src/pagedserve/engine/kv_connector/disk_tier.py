"""The disk tier of KV offloading: one file per block, LRU within a byte budget, and a prefix
cache that outlives the process.

Layout of ``--kv-offload-dir``::

    hash_root               16 random bytes: the root of the prefix hash chain (below)
    <layout tag>/<hash>.kv  one block record (block_record.py) per prefix hash

The prefix cache names a block by a hash chain whose root is normally random per process.
An engine with a disk tier takes the root from ``hash_root`` instead (created once, at
random), so after a restart the same prompt hashes to the same names and finds its files. The
layout tag keeps engines of different models, dtypes or block sizes that share a folder apart.

Safety: a block is written to a temporary file and renamed into place (``os.replace`` is
atomic), so a reader sees a whole file or none, even if the process is killed mid-write (its
temporary file is removed at the next start). Every read checks the record's header and
checksum against this engine's layout and the key it asked for; a file that fails (another
model's block, a torn or corrupted file) is counted, deleted and never loaded.

Threads: saves are queued to one writer thread (a full queue drops the save, counted: the
engine never waits for the disk); reads run in the connector's loader threads; the index of
files (name -> size, in LRU order) is shared under a lock. Files past ``capacity_bytes`` are
deleted oldest first; a read makes a file the newest again (in the index, and its mtime, which
orders the index the next start builds).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from pagedserve.engine.kv_connector.block_record import BlockLayout, check_record, encode_header
from pagedserve.engine.kv_connector.stats import StatsRecorder

ROOT_FILE = "hash_root"
SUFFIX = ".kv"
WRITE_QUEUE_BLOCKS = 256


def load_hash_root(folder: Path) -> bytes:
    """The folder's hash root, created (16 random bytes, atomically) if it has none yet."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ROOT_FILE
    if not path.exists():
        temporary = folder / f".{ROOT_FILE}.{os.getpid()}.tmp"
        temporary.write_bytes(os.urandom(16))
        with contextlib.suppress(FileExistsError):  # another engine made it first: use theirs
            os.link(temporary, path)
        temporary.unlink()
    root = path.read_bytes()
    if len(root) != 16:
        raise ValueError(f"{path} is not a pagedserve hash root (16 bytes); remove the folder")
    return root


class DiskTier:
    """Blocks of one layout under ``folder``, at most ``capacity_bytes`` of files."""

    name = "disk"

    def __init__(
        self, folder: str, layout: BlockLayout, capacity_bytes: int, stats: StatsRecorder
    ) -> None:
        self.layout = layout
        self.block_bytes = layout.payload_bytes
        if capacity_bytes < self.block_bytes:
            raise ValueError(
                f"kv_offload_disk ({capacity_bytes} bytes) holds no KV block of "
                f"{self.block_bytes} bytes: give it at least one block's worth"
            )
        self.capacity_bytes = capacity_bytes
        self.hash_root = load_hash_root(Path(folder))
        self.folder = Path(folder) / layout.tag()
        self.folder.mkdir(exist_ok=True)
        self._stats = stats
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._queued: set[bytes] = set()
        self._used = 0
        self._scan()
        self._writes: queue.Queue = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """Index the files a previous run left, oldest first; remove its temporary files."""
        found = []
        for path in self.folder.iterdir():
            if path.suffix == SUFFIX and len(path.stem) == 64:
                stat = path.stat()
                found.append((stat.st_mtime_ns, bytes.fromhex(path.stem), stat.st_size))
            elif path.name.endswith(".tmp") and not _writer_alive(path.name):
                path.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        with self._lock:
            self._evict_over_capacity()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    def put(self, key: bytes, payload: np.ndarray) -> None:
        """Queue a block to be written (nothing if it is on disk or queued already)."""
        with self._lock:
            if key in self._index or key in self._queued:
                return
            self._queued.add(key)
        try:
            self._writes.put_nowait((key, payload))
        except queue.Full:
            with self._lock:
                self._queued.discard(key)
            self._stats.dropped(self.name)

    def read(self, key: bytes) -> np.ndarray:
        """The block saved under ``key`` (loader threads). ``FileNotFoundError`` when it is
        gone; ``BlockRecordError`` when the file is not a sound record of this engine's block
        under ``key`` (counted, deleted)."""
        path = self._path(key)
        try:
            record = path.read_bytes()
        except FileNotFoundError:
            self._forget(key, delete=False)  # evicted since the lookup: a miss
            raise
        try:
            payload = check_record(self.layout, key, record)
        except ValueError:
            self._forget(key, delete=True)
            raise
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)
        return payload

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (a restart should find it), then stop the writer."""
        self._writes.put((None, None))
        self._writer.join(timeout)

    # ---- the writer thread -----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            key, payload = self._writes.get()
            if key is None:
                return
            try:
                self._write(key, payload)
            except OSError:
                self._stats.dropped(self.name)
            finally:
                with self._lock:
                    self._queued.discard(key)

    def _write(self, key: bytes, payload: np.ndarray) -> None:
        """Write to a temporary file, rename it into place, index it, keep to the budget."""
        path = self._path(key)
        temporary = path.with_name(f".{key.hex()}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as f:
                f.write(encode_header(self.layout, key, payload))
                f.write(memoryview(payload))
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        size = path.stat().st_size
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._used += size
            self._evict_over_capacity()
        self._stats.saved(self.name, payload.nbytes)

    def _evict_over_capacity(self) -> None:
        """Delete the least recently used files until the budget holds (lock held)."""
        while self._used > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self._path(key).unlink(missing_ok=True)
        self._stats.usage(self.name, len(self._index), self._used)

    def _forget(self, key: bytes, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            self._stats.usage(self.name, len(self._index), self._used)
        if delete:
            self._path(key).unlink(missing_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)


def _writer_alive(name: str) -> bool:
    """Whether the process that is writing temporary file ``.<hash>.<pid>.tmp`` still runs
    (another engine sharing the folder): its file is not ours to remove."""
    try:
        pid = int(name.split(".")[-2])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
